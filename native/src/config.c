/* DISTMEM_CAP_BYTES: parsing and printing sizes. Pure functions, no allocation. */
#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

static const struct {
    const char *name;
    uint64_t mult;
} units[] = {
    {"", 1ULL},
    {"b", 1ULL},
    {"k", 1000ULL},
    {"kb", 1000ULL},
    {"m", 1000000ULL},
    {"mb", 1000000ULL},
    {"g", 1000000000ULL},
    {"gb", 1000000000ULL},
    {"t", 1000000000000ULL},
    {"tb", 1000000000000ULL},
    {"ki", 1ULL << 10},
    {"kib", 1ULL << 10},
    {"mi", 1ULL << 20},
    {"mib", 1ULL << 20},
    {"gi", 1ULL << 30},
    {"gib", 1ULL << 30},
    {"ti", 1ULL << 40},
    {"tib", 1ULL << 40},
};

const char *dm_parse_size(const char *s, uint64_t *out) {
    while (*s == ' ' || *s == '\t') s++;
    if (!isdigit((unsigned char)*s) && *s != '.') return NULL;
    /* Whole and fractional parts in integers: no floating point rounding for plain byte counts. A
     * value past 2^64 saturates to UINT64_MAX, so the caller can say it is too large. */
    uint64_t whole = 0, frac = 0, frac_scale = 1;
    int digits = 0, overflow = 0;
    while (isdigit((unsigned char)*s)) {
        uint64_t d = (uint64_t)(*s - '0');
        if (whole > (UINT64_MAX - d) / 10)
            overflow = 1;
        else
            whole = whole * 10 + d;
        s++;
        digits++;
    }
    if (*s == '.') {
        s++;
        while (isdigit((unsigned char)*s)) {
            if (frac_scale < 1000000000000ULL) {
                frac = frac * 10 + (uint64_t)(*s - '0');
                frac_scale *= 10;
            }
            s++;
            digits++;
        }
    }
    if (digits == 0) return NULL;
    while (*s == ' ' || *s == '\t') s++;
    const char *u = s;
    while (isalpha((unsigned char)*s)) s++;
    size_t ulen = (size_t)(s - u);
    uint64_t mult = 0;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strlen(units[i].name) == ulen && strncasecmp(units[i].name, u, ulen) == 0) {
            mult = units[i].mult;
            break;
        }
    }
    if (mult == 0) return NULL;
    if (whole != 0 && mult > UINT64_MAX / whole) overflow = 1;
    uint64_t value = overflow ? UINT64_MAX : whole * mult;
    if (frac && !overflow) {
        long double part = (long double)frac / (long double)frac_scale * (long double)mult;
        uint64_t add = (uint64_t)part;
        value = value > UINT64_MAX - add ? UINT64_MAX : value + add;
    }
    while (*s == ' ' || *s == '\t') s++;
    *out = value;
    return s;
}

int dm_parse_spec(const char *spec, uint64_t *caps, uint64_t *default_cap, char *err, size_t errlen) {
    for (int i = 0; i < DISTMEM_CAP_MAX_DEVICES; i++) caps[i] = DISTMEM_CAP_UNLIMITED;
    *default_cap = DISTMEM_CAP_UNLIMITED;
    if (!spec) return 0;
    const char *p = spec;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '\0') return 0;
    int explicit_dev[DISTMEM_CAP_MAX_DEVICES] = {0};
    for (;;) {
        while (*p == ' ' || *p == '\t') p++;
        const char *item = p;
        long dev = -1; /* -1: default for every device */
        const char *colon = NULL;
        for (const char *q = p; *q && *q != ','; q++) {
            if (*q == ':') {
                colon = q;
                break;
            }
        }
        if (colon) {
            const char *q = p;
            while (*q == ' ') q++;
            if (*q == '*') {
                q++;
            } else {
                if (!isdigit((unsigned char)*q)) goto bad_device;
                dev = 0;
                while (isdigit((unsigned char)*q)) {
                    dev = dev * 10 + (*q - '0');
                    if (dev >= DISTMEM_CAP_MAX_DEVICES) goto bad_device;
                    q++;
                }
            }
            while (*q == ' ') q++;
            if (q != colon) goto bad_device;
            p = colon + 1;
        }
        uint64_t value;
        const char *end = dm_parse_size(p, &value);
        if (!end || (*end != ',' && *end != '\0')) {
            size_t n = strcspn(item, ",");
            snprintf(err, errlen,
                     "cannot read '%.*s' as a size; write bytes (10737418240), a size with a unit "
                     "(10GiB, 512MB) or a per-device list (0:10GiB,1:8GiB,*:4GiB)",
                     (int)(n > 80 ? 80 : n), item);
            return -1;
        }
        if (value > DM_CAP_MAX) {
            size_t n = strcspn(item, ",");
            snprintf(err, errlen,
                     "'%.*s' is above the largest cap, 9223372036854775807 bytes (2^63 - 1, 8 EiB); "
                     "18446744073709551615 is not a size but the library's 'unlimited'",
                     (int)(n > 80 ? 80 : n), item);
            return -1;
        }
        if (dev < 0) {
            *default_cap = value;
        } else {
            caps[dev] = value;
            explicit_dev[dev] = 1;
        }
        p = end;
        if (*p == '\0') break;
        p++; /* ',' */
    }
    for (int i = 0; i < DISTMEM_CAP_MAX_DEVICES; i++)
        if (!explicit_dev[i]) caps[i] = *default_cap;
    return 0;

bad_device:
    snprintf(err, errlen,
             "bad device in '%.80s': write 'ORDINAL:SIZE' with ORDINAL in 0..%d or '*:SIZE', "
             "e.g. 0:10GiB,1:8GiB",
             spec, DISTMEM_CAP_MAX_DEVICES - 1);
    return -1;
}

void dm_format_bytes(uint64_t n, char *buf, size_t len) {
    if (n == DISTMEM_CAP_UNLIMITED) {
        snprintf(buf, len, "unlimited");
        return;
    }
    static const struct {
        const char *unit;
        uint64_t size;
    } steps[] = {{"TiB", 1ULL << 40}, {"GiB", 1ULL << 30}, {"MiB", 1ULL << 20}, {"KiB", 1ULL << 10}};
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        if (n >= steps[i].size) {
            snprintf(buf, len, "%.2f %s", (double)n / (double)steps[i].size, steps[i].unit);
            return;
        }
    }
    snprintf(buf, len, "%llu B", (unsigned long long)n);
}
