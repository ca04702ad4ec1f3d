/* GPU-wide budget shared by every capped process on one GPU (opt-in: DISTMEM_CAP_GPU_BYTES).
 *
 * One small file per physical GPU, named by its UUID, in DISTMEM_CAP_SHM_DIR (default /dev/shm),
 * mapped by every process that allocates on that GPU. It holds a process-shared robust mutex and
 * one slot per process: (pid, start time, bytes in use). A reservation takes the mutex, drops the
 * slots of processes that no longer exist (or whose pid was reused), sums the rest and grants only
 * if the sum plus the request stays within the budget. A process killed while holding the mutex
 * leaves it to the next one (EOWNERDEAD); one killed holding memory loses its slot at the next
 * reservation by anyone, as the driver frees its memory.
 *
 * Processes must share a PID namespace for the liveness check (as with HAMi-core). If the table
 * cannot be set up (no UUID, no directory, a different layout), this process falls back to its own
 * cap alone and says so once.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define DM_SHM_MAGIC 0x64636170u /* "dcap" */
#define DM_SHM_VERSION 1u
#define DM_SHM_SLOTS 512

typedef struct dm_shm_slot {
    _Atomic int32_t pid;
    int32_t reserved;
    uint64_t start; /* process start time (clock ticks since boot, /proc/PID/stat field 22) */
    _Atomic uint64_t used;
} dm_shm_slot_t;

typedef struct dm_shm {
    _Atomic uint32_t magic; /* written last by the creator */
    uint32_t version;
    uint32_t slots;
    uint32_t pad;
    pthread_mutex_t mu;
    char uuid[48];
    dm_shm_slot_t slot[DM_SHM_SLOTS];
} dm_shm_t;

enum { SH_UNKNOWN = 0, SH_READY = 1, SH_OFF = -1 };

static uint64_t budgets[DISTMEM_CAP_MAX_DEVICES];
static int enabled;
static char shm_dir[256] = "/dev/shm";
static pthread_mutex_t setup_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int state[DISTMEM_CAP_MAX_DEVICES];
static dm_shm_t *maps[DISTMEM_CAP_MAX_DEVICES];
static int my_slot[DISTMEM_CAP_MAX_DEVICES];
static uint64_t my_start;

typedef struct {
    unsigned char bytes[16];
} dm_uuid_t;
typedef CUresult (*cuDeviceGetUuid_fn)(dm_uuid_t *, CUdevice);
typedef CUresult (*cuDeviceGet_fn)(CUdevice *, int);

/* Start time of pid (clock ticks since boot, /proc/PID/stat field 22); 0 if unknown. *zombie says
 * whether it has exited and waits to be reaped (it holds no GPU memory any more). */
static uint64_t start_time_of(int pid, int *zombie) {
    char path[64], buf[1024];
    *zombie = 0;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (!p || p[1] != ' ') return 0;
    *zombie = p[2] == 'Z' || p[2] == 'X';
    int field = 2; /* after ")": field 3 (state) ... field 22 (starttime) */
    for (p++; *p && field < 22; p++)
        if (*p == ' ') field++;
    return strtoull(p, NULL, 10);
}

static int alive(int32_t pid, uint64_t start) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    int zombie;
    uint64_t now = start_time_of(pid, &zombie);
    if (zombie) return 0;
    return now == 0 || start == 0 || now == start; /* unknown counts as alive: never drop a live one */
}

void dm_shared_configure(const char *spec, const char *dir) {
    uint64_t dflt;
    char err[256];
    if (!spec || !*spec) return;
    if (dm_parse_spec(spec, budgets, &dflt, err, sizeof err) != 0) {
        fprintf(stderr,
                "distmem-cap: DISTMEM_CAP_GPU_BYTES=%s is invalid (%s); the GPU-wide budget is off, each "
                "process keeps its own cap\n",
                spec, err);
        return;
    }
    if (dir && *dir) snprintf(shm_dir, sizeof shm_dir, "%s", dir);
    int zombie;
    my_start = start_time_of((int)getpid(), &zombie);
    enabled = 1;
}

static void lock(dm_shm_t *m) {
    int rc = pthread_mutex_lock(&m->mu);
    if (rc == EOWNERDEAD) pthread_mutex_consistent(&m->mu); /* its owner died mid-update: slots are rechecked */
}

static void turn_off(int dev, const char *why);
#define OFF(dev, why)          \
    do {                       \
        turn_off((dev), (why)); \
        return;                \
    } while (0)

static void turn_off(int dev, const char *why) {
    atomic_store(&state[dev], SH_OFF);
    fprintf(stderr, "distmem-cap: GPU-wide budget off for GPU %d in pid %d (%s); this process keeps its own cap\n",
            dev, (int)getpid(), why);
}

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

/* Maps the GPU's table and claims a slot. Called with setup_mu held. */
static void setup(int dev) {
    char uuid[40];
    if (uuid_of(dev, uuid, sizeof uuid) != 0) OFF(dev, "cuDeviceGetUuid failed");
    char path[400];
    snprintf(path, sizeof path, "%s/distmem-cap-%s", shm_dir, uuid);
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    int creator = fd >= 0;
    if (!creator) fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        char why[512];
        snprintf(why, sizeof why, "cannot open %s: %s", path, strerror(errno));
        OFF(dev, why);
    }
    if (creator) {
        fchmod(fd, 0666); /* other users' jobs on the same GPU share the budget too */
        if (ftruncate(fd, sizeof(dm_shm_t)) != 0) {
            close(fd);
            OFF(dev, "cannot size the shared table");
        }
    } else {
        /* the creator may still be initialising: wait for its size, then its magic */
        struct stat st;
        for (int i = 0; i < 2000 && (fstat(fd, &st) != 0 || st.st_size < (off_t)sizeof(dm_shm_t)); i++)
            usleep(1000);
    }
    dm_shm_t *m = mmap(NULL, sizeof(dm_shm_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) OFF(dev, "mmap of the shared table failed");
    if (creator) {
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&m->mu, &a);
        pthread_mutexattr_destroy(&a);
        m->version = DM_SHM_VERSION;
        m->slots = DM_SHM_SLOTS;
        snprintf(m->uuid, sizeof m->uuid, "%s", uuid);
        atomic_store(&m->magic, DM_SHM_MAGIC);
    } else {
        for (int i = 0; i < 2000 && atomic_load(&m->magic) != DM_SHM_MAGIC; i++) usleep(1000);
        if (atomic_load(&m->magic) != DM_SHM_MAGIC || m->version != DM_SHM_VERSION || m->slots != DM_SHM_SLOTS) {
            munmap(m, sizeof *m);
            OFF(dev, "the shared table has another layout (a different distmem version?)");
        }
    }
    int32_t me = (int32_t)getpid();
    int slot = -1;
    lock(m);
    for (int i = 0; i < DM_SHM_SLOTS; i++) { /* reuse our own slot (after a fork+exec with this pid) */
        if (atomic_load(&m->slot[i].pid) == me) {
            slot = i;
            break;
        }
    }
    for (int i = 0; i < DM_SHM_SLOTS && slot < 0; i++) {
        int32_t pid = atomic_load(&m->slot[i].pid);
        if (pid == 0 || !alive(pid, m->slot[i].start)) slot = i;
    }
    if (slot >= 0) {
        atomic_store(&m->slot[slot].pid, me);
        m->slot[slot].start = my_start;
        atomic_store(&m->slot[slot].used, 0);
    }
    pthread_mutex_unlock(&m->mu);
    if (slot < 0) {
        munmap(m, sizeof *m);
        OFF(dev, "all slots of the shared table are taken by live processes");
    }
    maps[dev] = m;
    my_slot[dev] = slot;
    atomic_store(&state[dev], SH_READY);
}

static dm_shm_t *table_for(int dev) {
    if (!enabled || budgets[dev] == DISTMEM_CAP_UNLIMITED) return NULL;
    int s = atomic_load(&state[dev]);
    if (s == SH_UNKNOWN) {
        pthread_mutex_lock(&setup_mu);
        if (atomic_load(&state[dev]) == SH_UNKNOWN) setup(dev);
        pthread_mutex_unlock(&setup_mu);
        s = atomic_load(&state[dev]);
    }
    return s == SH_READY ? maps[dev] : NULL;
}

int dm_shared_reserve(int dev, uint64_t bytes, uint64_t *all_used, uint64_t *budget) {
    dm_shm_t *m = table_for(dev);
    if (!m) return 1;
    uint64_t sum = 0;
    int granted;
    lock(m);
    for (int i = 0; i < DM_SHM_SLOTS; i++) {
        int32_t pid = atomic_load(&m->slot[i].pid);
        if (pid == 0) continue;
        if (i != my_slot[dev] && !alive(pid, m->slot[i].start)) {
            atomic_store(&m->slot[i].used, 0);
            atomic_store(&m->slot[i].pid, 0);
            continue;
        }
        sum += atomic_load(&m->slot[i].used);
    }
    granted = bytes <= budgets[dev] && sum <= budgets[dev] - bytes;
    if (granted) atomic_fetch_add(&m->slot[my_slot[dev]].used, bytes);
    pthread_mutex_unlock(&m->mu);
    *all_used = sum;
    *budget = budgets[dev];
    return granted;
}

void dm_shared_release(int dev, uint64_t bytes) {
    if (!enabled || budgets[dev] == DISTMEM_CAP_UNLIMITED || atomic_load(&state[dev]) != SH_READY) return;
    atomic_fetch_sub(&maps[dev]->slot[my_slot[dev]].used, bytes);
}

DM_EXPORT int distmem_cap_get_shared(int device, distmem_cap_shared_t *out, size_t out_size) {
    dm_init();
    if (device < 0 || device >= DISTMEM_CAP_MAX_DEVICES || !out) return -1;
    distmem_cap_shared_t s = {.budget_bytes = enabled ? budgets[device] : DISTMEM_CAP_UNLIMITED};
    if (atomic_load(&state[device]) == SH_READY) {
        dm_shm_t *m = maps[device];
        lock(m);
        for (int i = 0; i < DM_SHM_SLOTS; i++) {
            if (atomic_load(&m->slot[i].pid) == 0) continue;
            s.processes++;
            s.used_bytes += atomic_load(&m->slot[i].used);
        }
        pthread_mutex_unlock(&m->mu);
        s.active = 1;
    }
    memcpy(out, &s, out_size < sizeof s ? out_size : sizeof s);
    return 0;
}
