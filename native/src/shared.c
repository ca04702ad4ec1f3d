/* GPU-wide budget shared by the capped processes of one user (opt-in: DISTMEM_CAP_GPU_BYTES).
 *
 * One table per physical GPU (by UUID) in a folder only that user can write, or with
 * DISTMEM_CAP_SHM_GROUP one group (table.c: where it lives, how it is made and checked). A table
 * that cannot be used as it must denies every allocation on its GPU (fails closed) and says why.
 *
 * No lock is taken to reserve. Each process owns one slot (its bytes in use) and writes only that
 * slot: it adds its request first, then sums every slot, and keeps the request only if the sum is
 * within the budget, else takes it back. With sequentially consistent atomics two racing processes
 * cannot both miss each other's addition, so the budget is never exceeded; a loser that would fit
 * once the other's tentative bytes are gone tries again.
 *
 * A slot is owned by whoever holds an open-file-description lock (fcntl F_OFD_SETLK) on its byte of
 * the table file, held for the life of the process. The kernel drops it when the process dies, so
 * liveness needs neither pids nor /proc (hidepid=2, PID namespaces and pid reuse do not matter);
 * a dead owner's bytes are cleared by whoever next needs them (they take the slot's lock first).
 * Every user of the table also holds a shared lock on byte 0; the last one out, finding none,
 * removes the table. After fork, the child drops what it inherited and takes a slot of its own.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "table.h"

#define WHY(...) dm_table_fail(t, __VA_ARGS__)

#define DM_ATTEMPTS 64

enum { SH_UNKNOWN = 0, SH_READY = 1, SH_BROKEN = -1 };

static uint64_t budgets[DISTMEM_CAP_MAX_DEVICES];
static int enabled;
static char config_error[512]; /* DISTMEM_CAP_GPU_BYTES / _SHM_GROUP unreadable: deny everything */
static pthread_mutex_t setup_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int state[DISTMEM_CAP_MAX_DEVICES];
static dm_gpu_table_t gpus[DISTMEM_CAP_MAX_DEVICES];

typedef struct {
    unsigned char bytes[16];
} dm_uuid_t;
typedef CUresult (*cuDeviceGetUuid_fn)(dm_uuid_t *, CUdevice);
typedef CUresult (*cuDeviceGet_fn)(CUdevice *, int);

static void after_fork_in_child(void);

void dm_shared_configure(const char *spec, const char *dir, const char *group) {
    uint64_t dflt;
    char err[256];
    if (!spec || !*spec) return;
    enabled = 1;
    for (int i = 0; i < DISTMEM_CAP_MAX_DEVICES; i++) gpus[i].fd = gpus[i].dirfd = -1;
    pthread_atfork(NULL, NULL, after_fork_in_child);
    if (dm_parse_spec(spec, budgets, &dflt, err, sizeof err) != 0) {
        snprintf(config_error, sizeof config_error, "DISTMEM_CAP_GPU_BYTES=%.80s is invalid (%s)", spec, err);
        return;
    }
    if (dir && *dir) snprintf(dm_shm_dir, sizeof dm_shm_dir, "%s", dir);
    if (group && *group) {
        char *end;
        errno = 0;
        long g = strtol(group, &end, 10);
        if (errno || *end || end == group || g < 0 || g > 0x7fffffffL) {
            snprintf(config_error, sizeof config_error,
                     "DISTMEM_CAP_SHM_GROUP=%.40s is not a numeric group id (distmem-exec --gpu-budget-group "
                     "NAME resolves a name)", group);
            return;
        }
        dm_shm_group = g;
    }
}

/* ---- joining the table ----------------------------------------------------------------------- */

static int uuid_of(int dev, char *out, size_t len) {
    cuDeviceGetUuid_fn get = (cuDeviceGetUuid_fn)dm_driver_symbol("cuDeviceGetUuid_v2");
    if (!get) get = (cuDeviceGetUuid_fn)dm_driver_symbol("cuDeviceGetUuid");
    cuDeviceGet_fn dget = (cuDeviceGet_fn)dm_driver_symbol("cuDeviceGet");
    CUdevice handle = dev;
    if (dget && dget(&handle, dev) != CUDA_SUCCESS) handle = dev;
    dm_uuid_t u;
    if (!get || get(&u, handle) != CUDA_SUCCESS) return -1;
    char *p = out;
    for (int i = 0; i < 16 && (size_t)(p - out) + 3 < len; i++) p += sprintf(p, "%02x", u.bytes[i]);
    return 0;
}

static void raise_hwm(dm_shm_t *m, uint32_t to) {
    uint32_t cur = atomic_load(&m->hwm);
    while (cur < to && !atomic_compare_exchange_weak(&m->hwm, &cur, to)) {
    }
}

/* Opens (or creates) the GPU's table and claims a slot. Called with setup_mu held. Returns
 * SH_READY, SH_BROKEN (t->why), or SH_UNKNOWN when every slot is taken (tried again next time). */
static int setup(int dev) {
    dm_gpu_table_t *t = &gpus[dev];
    char uuid[40];
    if (uuid_of(dev, uuid, sizeof uuid) != 0) {
        WHY("cuDeviceGetUuid failed for GPU %d, so its table cannot be named", dev);
        return SH_BROKEN;
    }
    snprintf(t->name, sizeof t->name, "distmem-cap-v%u-%s", DM_SHM_VERSION, uuid);
    if (t->dirfd < 0 && dm_table_open_dir(t) != 0) return SH_BROKEN;
    for (int attempt = 0; attempt < 50; attempt++) {
        int fd = openat(t->dirfd, t->name, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT) {
            fd = dm_table_create(t, uuid);
            if (fd == -2) continue;
            if (fd < 0) return SH_BROKEN;
        } else if (fd < 0) {
            WHY("cannot open the table %s in DISTMEM_CAP_SHM_DIR=%s: %s", t->name, dm_shm_dir, strerror(errno));
            return SH_BROKEN;
        }
        dm_shm_t *m = NULL;
        if (dm_table_check(t, fd, uuid, &m) != 0) {
            close(fd);
            return SH_BROKEN;
        }
        /* A table being removed by its last user (who holds byte 0 for writing), or already
         * unlinked: start again with whatever the name holds now. */
        if (dm_lock_byte(fd, F_RDLCK, DM_LOCK_INUSE) != 0 || !dm_table_same_file(t->dirfd, t->name, fd)) {
            munmap(m, sizeof *m);
            close(fd);
            usleep(1000);
            continue;
        }
        int slot = -1;
        for (int i = 0; i < DM_SHM_SLOTS && slot < 0; i++)
            if (dm_lock_byte(fd, F_WRLCK, DM_LOCK_SLOT(i)) == 0) slot = i;
        if (slot < 0) {
            munmap(m, sizeof *m);
            close(fd);
            WHY("all %d slots of the GPU's table are held by live processes", DM_SHM_SLOTS);
            return SH_UNKNOWN;
        }
        atomic_store(&m->slot[slot].used, 0); /* a dead owner's bytes: its memory went with it */
        atomic_store(&m->slot[slot].pid, (int32_t)getpid());
        atomic_store(&m->slot[slot].uid, (uint32_t)geteuid());
        raise_hwm(m, (uint32_t)slot + 1);
        t->map = m;
        t->fd = fd;
        t->slot = slot;
        t->why[0] = '\0';
        return SH_READY;
    }
    WHY("the table %s kept changing while this process joined it", t->name);
    return SH_BROKEN;
}

/* The GPU's table, or NULL with *why set (broken, or full for now). */
static dm_gpu_table_t *table_for(int dev, const char **why) {
    int s = atomic_load(&state[dev]);
    if (s == SH_UNKNOWN) {
        pthread_mutex_lock(&setup_mu);
        s = atomic_load(&state[dev]);
        if (s == SH_UNKNOWN) {
            s = setup(dev);
            atomic_store(&state[dev], s);
        }
        pthread_mutex_unlock(&setup_mu);
    }
    if (s == SH_READY) return &gpus[dev];
    *why = gpus[dev].why;
    return NULL;
}

/* ---- reserving --------------------------------------------------------------------------------- */

static uint64_t total(dm_shm_t *m) {
    uint32_t n = atomic_load(&m->hwm);
    if (n > DM_SHM_SLOTS) n = DM_SHM_SLOTS;
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t v = atomic_load(&m->slot[i].used);
        sum = sum + v < sum ? UINT64_MAX : sum + v;
    }
    return sum;
}

/* Clears the bytes of slots whose owner died: their lock is free, so taking it is safe. */
static void reclaim_dead(dm_gpu_table_t *t) {
    dm_shm_t *m = t->map;
    uint32_t n = atomic_load(&m->hwm);
    if (n > DM_SHM_SLOTS) n = DM_SHM_SLOTS;
    for (uint32_t i = 0; i < n; i++) {
        if ((int)i == t->slot || atomic_load(&m->slot[i].used) == 0) continue;
        if (dm_lock_byte(t->fd, F_WRLCK, DM_LOCK_SLOT(i)) != 0) continue; /* alive */
        atomic_store(&m->slot[i].used, 0);
        atomic_store(&m->slot[i].pid, 0);
        dm_lock_byte(t->fd, F_UNLCK, DM_LOCK_SLOT(i));
    }
}

/* 20-100 us times the attempt (at most 8): random per process and call, so racing processes part. */
static void backoff(int attempt) {
    static _Atomic uint64_t seq;
    uint64_t x = atomic_fetch_add(&seq, 0x9e3779b97f4a7c15ULL) ^ ((uint64_t)getpid() << 32);
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 29;
    struct timespec ts = {0, (long)(20000 + x % 80000) * (attempt < 8 ? attempt + 1 : 8)};
    nanosleep(&ts, NULL);
}

int dm_shared_reserve(int dev, uint64_t bytes, uint64_t *all_used, uint64_t *budget, const char **why) {
    *why = NULL;
    *all_used = 0;
    *budget = budgets[dev];
    if (!enabled) return 1;
    if (config_error[0]) {
        *why = config_error;
        return 0;
    }
    if (budgets[dev] == DISTMEM_CAP_UNLIMITED) return 1;
    dm_gpu_table_t *t = table_for(dev, why);
    if (!t) return 0;
    dm_shm_t *m = t->map;
    _Atomic uint64_t *mine = &m->slot[t->slot].used;
    uint64_t limit = budgets[dev];
    if (bytes > limit) {
        *all_used = total(m);
        return 0;
    }
    for (int attempt = 0; attempt < DM_ATTEMPTS; attempt++) {
        atomic_fetch_add(mine, bytes);
        uint64_t sum = total(m);
        if (sum <= limit) {
            *all_used = sum - bytes;
            return 1;
        }
        atomic_fetch_sub(mine, bytes);
        if (attempt == 0) reclaim_dead(t);
        /* Denied for real, or only because another process's tentative bytes were in the sum? */
        uint64_t others = total(m);
        for (int k = 0; k < 3 && others > limit - bytes; k++) {
            backoff(k);
            others = total(m);
        }
        *all_used = others;
        if (others > limit - bytes) return 0;
        backoff(attempt);
    }
    return 0;
}

void dm_shared_release(int dev, uint64_t bytes) {
    if (!enabled || atomic_load(&state[dev]) != SH_READY) return;
    atomic_fetch_sub(&gpus[dev].map->slot[gpus[dev].slot].used, bytes);
}

/* ---- fork and exit ----------------------------------------------------------------------------- */

/* The child of a fork without exec holds none of its parent's GPU memory (a CUDA context does not
 * survive fork): it gives up the parent's slot (the parent keeps its own lock through its own open
 * file description) and joins afresh at its first allocation. */
static void after_fork_in_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&setup_mu, &fresh, sizeof fresh);
    for (int dev = 0; dev < DISTMEM_CAP_MAX_DEVICES; dev++) {
        dm_gpu_table_t *t = &gpus[dev];
        if (t->map) munmap(t->map, sizeof(dm_shm_t));
        if (t->fd >= 0) close(t->fd);
        t->map = NULL;
        t->fd = -1;
        t->slot = -1;
        if (atomic_load(&state[dev]) != SH_BROKEN) atomic_store(&state[dev], SH_UNKNOWN);
    }
}

/* The last process using a table removes it: when no other holds byte 0, none can be joining.
 * Each gives up its own hold first, so of several exiting at once the last still finds it free. */
__attribute__((destructor)) static void remove_unused_tables(void) {
    for (int dev = 0; dev < DISTMEM_CAP_MAX_DEVICES; dev++) {
        dm_gpu_table_t *t = &gpus[dev];
        if (atomic_load(&state[dev]) != SH_READY || t->fd < 0) continue;
        dm_lock_byte(t->fd, F_UNLCK, DM_LOCK_INUSE);
        if (dm_lock_byte(t->fd, F_WRLCK, DM_LOCK_INUSE) != 0) continue;
        if (dm_table_same_file(t->dirfd, t->name, t->fd)) unlinkat(t->dirfd, t->name, 0);
        dm_lock_byte(t->fd, F_UNLCK, DM_LOCK_INUSE);
    }
}

/* ---- status ------------------------------------------------------------------------------------ */

DM_EXPORT int distmem_cap_get_shared(int device, distmem_cap_shared_t *out, size_t out_size) {
    dm_init();
    if (device < 0 || device >= DISTMEM_CAP_MAX_DEVICES || !out) return -1;
    distmem_cap_shared_t s = {.budget_bytes = enabled ? budgets[device] : DISTMEM_CAP_UNLIMITED};
    if (atomic_load(&state[device]) == SH_READY) {
        dm_gpu_table_t *t = &gpus[device];
        uint32_t n = atomic_load(&t->map->hwm);
        if (n > DM_SHM_SLOTS) n = DM_SHM_SLOTS;
        for (uint32_t i = 0; i < n; i++)
            if ((int)i == t->slot || dm_lock_held_elsewhere(t->fd, DM_LOCK_SLOT(i))) s.processes++;
        s.used_bytes = total(t->map);
        s.active = 1;
    }
    memcpy(out, &s, out_size < sizeof s ? out_size : sizeof s);
    return 0;
}

DM_EXPORT const char *distmem_cap_shared_error(int device) {
    dm_init();
    if (config_error[0]) return config_error;
    if (device < 0 || device >= DISTMEM_CAP_MAX_DEVICES) return "";
    return atomic_load(&state[device]) == SH_READY ? "" : gpus[device].why;
}
