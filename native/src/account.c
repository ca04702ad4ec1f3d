/* Per-device accounting, the pointer/handle tables, the denial log and the status interface. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

typedef struct dm_device {
    _Atomic uint64_t used;
    _Atomic uint64_t peak;
    _Atomic uint64_t denials;
    _Atomic uint64_t last_denied;
    _Atomic uint64_t live;
    _Atomic uint64_t total;
    uint64_t cap;
} dm_device_t;

static dm_device_t devices[DISTMEM_CAP_MAX_DEVICES];
static uint64_t default_cap = DISTMEM_CAP_UNLIMITED;
static int config_ok = 1;
static int any_cap = 0;
static char spec_text[256];
static char config_error[512];
static _Atomic int denial_logged;
static _Atomic int budget_error_logged;
static _Atomic uint64_t total_denials;

_Atomic uint64_t dm_dlsym_lookups;
_Atomic uint64_t dm_procaddr_lookups;
_Atomic uint64_t dm_wrapped_calls;
int dm_verbose;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void init_from_env(void) {
    const char *verbose = getenv("DISTMEM_CAP_VERBOSE");
    dm_verbose = verbose && *verbose && strcmp(verbose, "0") != 0;
    const char *spec = getenv("DISTMEM_CAP_BYTES");
    uint64_t caps[DISTMEM_CAP_MAX_DEVICES];
    snprintf(spec_text, sizeof spec_text, "%s", spec ? spec : "");
    if (dm_parse_spec(spec, caps, &default_cap, config_error, sizeof config_error) != 0) {
        /* Fail closed: a cap the user asked for and we cannot read must not become no cap. */
        config_ok = 0;
        any_cap = 1;
        default_cap = 0;
        for (int i = 0; i < DISTMEM_CAP_MAX_DEVICES; i++) devices[i].cap = 0;
        /* Said at load only when asked (every child process inherits LD_PRELOAD, most never touch a
         * GPU); otherwise the first denial says it. */
        if (dm_verbose)
            fprintf(stderr,
                    "distmem-cap: DISTMEM_CAP_BYTES=%s is invalid (%s); every GPU allocation of pid %d "
                    "will be denied until it is fixed or unset\n",
                    spec_text, config_error, (int)getpid());
        return;
    }
    for (int i = 0; i < DISTMEM_CAP_MAX_DEVICES; i++) {
        devices[i].cap = caps[i];
        if (caps[i] != DISTMEM_CAP_UNLIMITED) any_cap = 1;
    }
    dm_shared_configure(getenv("DISTMEM_CAP_GPU_BYTES"), getenv("DISTMEM_CAP_SHM_DIR"),
                        getenv("DISTMEM_CAP_SHM_GROUP"));
    if (dm_verbose) {
        char buf[32];
        dm_format_bytes(default_cap, buf, sizeof buf);
        fprintf(stderr, "distmem-cap: active in pid %d, DISTMEM_CAP_BYTES='%s' (default cap %s)\n",
                (int)getpid(), spec_text, buf);
    }
}

void dm_init(void) { pthread_once(&init_once, init_from_env); }

/* DISTMEM_CAP_CONFIRM=FD:NONCE (set by distmem-exec for its check): say on that pipe that the
 * library is loaded and how it read its configuration, then forget the variable so that programs
 * this one starts do not write to whatever their FD is. */
static void confirm_loaded(void) {
    const char *v = getenv("DISTMEM_CAP_CONFIRM");
    if (!v) return;
    char *end;
    long fd = strtol(v, &end, 10);
    struct stat st;
    if (end != v && *end == ':' && fd > 2 && fd < 1 << 20 && fstat((int)fd, &st) == 0 && S_ISFIFO(st.st_mode)) {
        char line[160];
        int n = snprintf(line, sizeof line, "%.64s abi=%d config_ok=%d pid=%d\n", end + 1, DISTMEM_CAP_ABI_VERSION,
                         config_ok, (int)getpid());
        if (n > 0 && write((int)fd, line, (size_t)n) < 0) { /* the checker is gone: nothing to tell */
        }
        close((int)fd);
    }
    unsetenv("DISTMEM_CAP_CONFIRM");
}

__attribute__((constructor)) static void dm_constructor(void) {
    dm_init();
    dm_ensure_real_dlsym();
    pthread_atfork(NULL, NULL, dm_account_after_fork);
    confirm_loaded();
}

int dm_dev_index(int dev) {
    if (dev < 0) return 0;
    if (dev >= DISTMEM_CAP_MAX_DEVICES) return DISTMEM_CAP_MAX_DEVICES - 1;
    return dev;
}

uint64_t dm_cap(int dev) {
    dm_init();
    return devices[dm_dev_index(dev)].cap;
}

uint64_t dm_used(int dev) { return atomic_load(&devices[dm_dev_index(dev)].used); }

static void log_denial(int dev, uint64_t bytes, uint64_t used, uint64_t cap, const char *entry) {
    int first = atomic_exchange(&denial_logged, 1) == 0;
    if (!first && !dm_verbose) return;
    char req[32], usedb[32], capb[32], left[32];
    dm_format_bytes(bytes, req, sizeof req);
    dm_format_bytes(used, usedb, sizeof usedb);
    dm_format_bytes(cap, capb, sizeof capb);
    dm_format_bytes(cap > used ? cap - used : 0, left, sizeof left);
    if (!config_ok) {
        fprintf(stderr,
                "distmem-cap: denied %s of %s (%llu bytes) on GPU %d in pid %d: DISTMEM_CAP_BYTES=%s "
                "is invalid (%s), so every GPU allocation will be denied; fix or unset it\n",
                entry, req, (unsigned long long)bytes, dev, (int)getpid(), spec_text, config_error);
        return;
    }
    fprintf(stderr,
            "distmem-cap: denied %s of %s (%llu bytes) on GPU %d in pid %d: %s of its %s cap in use, "
            "%s left; returning CUDA_ERROR_OUT_OF_MEMORY. Raise the cap (DISTMEM_CAP_BYTES, from the "
            "plan) or use less memory%s\n",
            entry, req, (unsigned long long)bytes, dev, (int)getpid(), usedb, capb, left,
            dm_verbose ? "" : "; further denials are counted, not logged");
}

static void log_shared_denial(int dev, uint64_t bytes, uint64_t all_used, uint64_t budget, const char *entry,
                              const char *why) {
    char req[32], usedb[32], budb[32], left[32];
    dm_format_bytes(bytes, req, sizeof req);
    if (why) {
        if (atomic_exchange(&budget_error_logged, 1) != 0 && !dm_verbose) return;
        fprintf(stderr,
                "distmem-cap: denied %s of %s (%llu bytes) on GPU %d in pid %d: the GPU-wide budget "
                "(DISTMEM_CAP_GPU_BYTES) cannot be enforced: %s. Every allocation on this GPU is denied until "
                "that is fixed; unset DISTMEM_CAP_GPU_BYTES to run under this process's own cap alone\n",
                entry, req, (unsigned long long)bytes, dev, (int)getpid(), why);
        return;
    }
    int first = atomic_exchange(&denial_logged, 1) == 0;
    if (!first && !dm_verbose) return;
    dm_format_bytes(all_used, usedb, sizeof usedb);
    dm_format_bytes(budget, budb, sizeof budb);
    dm_format_bytes(budget > all_used ? budget - all_used : 0, left, sizeof left);
    fprintf(stderr,
            "distmem-cap: denied %s of %s (%llu bytes) on GPU %d in pid %d: the capped processes on this GPU "
            "hold %s of its %s GPU-wide budget (DISTMEM_CAP_GPU_BYTES), %s left; returning "
            "CUDA_ERROR_OUT_OF_MEMORY. Wait for the others, raise the budget or use less memory%s\n",
            entry, req, (unsigned long long)bytes, dev, (int)getpid(), usedb, budb, left,
            dm_verbose ? "" : "; further denials are counted, not logged");
}

static void count_denial(dm_device_t *d, uint64_t bytes) {
    atomic_fetch_add(&d->denials, 1);
    atomic_fetch_add(&total_denials, 1);
    atomic_store(&d->last_denied, bytes);
}

int dm_reserve(int dev, uint64_t bytes, const char *entry) {
    dm_init();
    dev = dm_dev_index(dev);
    dm_device_t *d = &devices[dev];
    uint64_t cap = d->cap;
    uint64_t cur = atomic_load(&d->used);
    for (;;) {
        if (cap != DISTMEM_CAP_UNLIMITED && (bytes > cap || cur > cap - bytes)) {
            count_denial(d, bytes);
            log_denial(dev, bytes, cur, cap, entry);
            return 0;
        }
        if (atomic_compare_exchange_weak(&d->used, &cur, cur + bytes)) break;
    }
    uint64_t all_used = 0, budget = 0;
    const char *why = NULL;
    if (!dm_shared_reserve(dev, bytes, &all_used, &budget, &why)) {
        atomic_fetch_sub(&d->used, bytes);
        count_denial(d, bytes);
        log_shared_denial(dev, bytes, all_used, budget, entry, why);
        return 0;
    }
    uint64_t now = cur + bytes;
    uint64_t peak = atomic_load(&d->peak);
    while (now > peak && !atomic_compare_exchange_weak(&d->peak, &peak, now)) {
    }
    return 1;
}

void dm_unreserve(int dev, uint64_t bytes) {
    dev = dm_dev_index(dev);
    atomic_fetch_sub(&devices[dev].used, bytes);
    dm_shared_release(dev, bytes);
}

void dm_note_allocation(int dev) {
    dm_device_t *d = &devices[dm_dev_index(dev)];
    atomic_fetch_add(&d->live, 1);
    atomic_fetch_add(&d->total, 1);
}

void dm_freed(int dev, uint64_t bytes) {
    dev = dm_dev_index(dev);
    dm_device_t *d = &devices[dev];
    atomic_fetch_sub(&d->used, bytes);
    atomic_fetch_sub(&d->live, 1);
    dm_shared_release(dev, bytes);
}

/* ---- pointer and handle tables ----------------------------------------------------------------
 * Striped chained hash tables: a free looks its pointer up to learn the size and device the
 * allocation was charged to. Stripes keep threads that allocate at once from serialising. */

#define DM_STRIPES 64

typedef struct dm_rec {
    uint64_t key;
    uint64_t size;
    int dev;
    struct dm_rec *next;
} dm_rec_t;

typedef struct dm_stripe {
    pthread_mutex_t mu;
    dm_rec_t **buckets;
    size_t nbuckets; /* power of two */
    size_t count;
    dm_rec_t *spare; /* freed records kept for reuse: no malloc on the steady-state path */
} dm_stripe_t;

static dm_stripe_t tables[2][DM_STRIPES] = {
    [0 ... 1] = {[0 ... DM_STRIPES - 1] = {.mu = PTHREAD_MUTEX_INITIALIZER}}};

static inline uint64_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static void grow(dm_stripe_t *s) {
    size_t n = s->nbuckets ? s->nbuckets * 2 : 64;
    dm_rec_t **b = calloc(n, sizeof *b);
    if (!b) return; /* keep the old buckets: longer chains, still correct */
    for (size_t i = 0; i < s->nbuckets; i++) {
        dm_rec_t *r = s->buckets[i];
        while (r) {
            dm_rec_t *next = r->next;
            size_t j = (mix(r->key) >> 6) & (n - 1);
            r->next = b[j];
            b[j] = r;
            r = next;
        }
    }
    free(s->buckets);
    s->buckets = b;
    s->nbuckets = n;
}

void dm_table_insert(int table, uint64_t key, uint64_t size, int dev) {
    uint64_t h = mix(key);
    dm_stripe_t *s = &tables[table][h & (DM_STRIPES - 1)];
    uint64_t stale_size = 0;
    int stale_dev = -1;
    pthread_mutex_lock(&s->mu);
    if (s->count >= s->nbuckets) grow(s);
    if (!s->buckets) {
        pthread_mutex_unlock(&s->mu);
        return; /* out of host memory: the allocation stays charged, never released */
    }
    size_t j = (h >> 6) & (s->nbuckets - 1);
    dm_rec_t *r = s->buckets[j];
    while (r && r->key != key) r = r->next;
    if (r) {
        /* The driver handed out an address we still hold: its old allocation went away without a
         * free we saw (a destroyed context). Release the stale charge. */
        stale_size = r->size;
        stale_dev = r->dev;
    } else {
        r = s->spare;
        if (r)
            s->spare = r->next;
        else
            r = malloc(sizeof *r);
        if (!r) {
            pthread_mutex_unlock(&s->mu);
            return;
        }
        r->key = key;
        r->next = s->buckets[j];
        s->buckets[j] = r;
        s->count++;
    }
    r->size = size;
    r->dev = dev;
    pthread_mutex_unlock(&s->mu);
    if (stale_dev >= 0) dm_freed(stale_dev, stale_size);
}

int dm_table_remove(int table, uint64_t key, uint64_t *size, int *dev) {
    uint64_t h = mix(key);
    dm_stripe_t *s = &tables[table][h & (DM_STRIPES - 1)];
    int found = 0;
    pthread_mutex_lock(&s->mu);
    if (s->nbuckets) {
        dm_rec_t **pp = &s->buckets[(h >> 6) & (s->nbuckets - 1)];
        while (*pp && (*pp)->key != key) pp = &(*pp)->next;
        if (*pp) {
            dm_rec_t *r = *pp;
            *pp = r->next;
            *size = r->size;
            *dev = r->dev;
            r->next = s->spare;
            s->spare = r;
            s->count--;
            found = 1;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return found;
}

/* The child of a fork without exec: none of its parent's GPU memory is its own (a CUDA context does
 * not survive fork), so it starts with nothing counted and its own cap. The records are abandoned,
 * not freed: a thread of the parent may have been changing them when it forked. */
void dm_account_after_fork(void) {
    for (int i = 0; i < DISTMEM_CAP_MAX_DEVICES; i++) {
        dm_device_t *d = &devices[i];
        atomic_store(&d->used, 0);
        atomic_store(&d->peak, 0);
        atomic_store(&d->denials, 0);
        atomic_store(&d->last_denied, 0);
        atomic_store(&d->live, 0);
        atomic_store(&d->total, 0);
    }
    atomic_store(&total_denials, 0);
    atomic_store(&denial_logged, 0);
    atomic_store(&budget_error_logged, 0);
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    for (int t = 0; t < 2; t++) {
        for (int k = 0; k < DM_STRIPES; k++) {
            dm_stripe_t *s = &tables[t][k];
            memcpy(&s->mu, &fresh, sizeof fresh);
            s->buckets = NULL;
            s->nbuckets = 0;
            s->count = 0;
            s->spare = NULL;
        }
    }
}

/* ---- status interface (exported) ------------------------------------------------------------ */

DM_EXPORT int distmem_cap_get_stats(int device, distmem_cap_stats_t *out, size_t out_size) {
    dm_init();
    if (device < 0 || device >= DISTMEM_CAP_MAX_DEVICES || !out) return -1;
    dm_device_t *d = &devices[device];
    distmem_cap_stats_t s = {
        .cap_bytes = d->cap,
        .used_bytes = atomic_load(&d->used),
        .peak_bytes = atomic_load(&d->peak),
        .denials = atomic_load(&d->denials),
        .last_denied_bytes = atomic_load(&d->last_denied),
        .live_allocations = atomic_load(&d->live),
        .total_allocations = atomic_load(&d->total),
    };
    memcpy(out, &s, out_size < sizeof s ? out_size : sizeof s);
    return 0;
}

DM_EXPORT int distmem_cap_get_info(distmem_cap_info_t *out, size_t out_size) {
    dm_init();
    if (!out) return -1;
    distmem_cap_info_t s = {
        .abi_version = DISTMEM_CAP_ABI_VERSION,
        .max_devices = DISTMEM_CAP_MAX_DEVICES,
        .config_ok = (uint32_t)config_ok,
        .capped = (uint32_t)any_cap,
        .default_cap_bytes = default_cap,
        .dlsym_lookups = atomic_load(&dm_dlsym_lookups),
        .procaddr_lookups = atomic_load(&dm_procaddr_lookups),
        .wrapped_calls = atomic_load(&dm_wrapped_calls),
        .denials = atomic_load(&total_denials),
    };
    memcpy(out, &s, out_size < sizeof s ? out_size : sizeof s);
    return 0;
}

DM_EXPORT const char *distmem_cap_spec(void) {
    dm_init();
    return spec_text;
}

DM_EXPORT const char *distmem_cap_config_error(void) {
    dm_init();
    return config_error;
}
