/* A stand-in for the programs the cap must catch. It reaches the driver's allocation functions the
 * way each kind of real program does, runs a script of operations given on the command line, and
 * prints one JSON object per operation for tests/native to check.
 *
 *   capdrv [--api runtime|runtime11|xla|link] [--ptds] [--lib PATH] OP...
 *
 *   --api runtime    CUDA 12+ runtime: dlsym(h, "cuGetProcAddress"), then ask it for
 *                    "cuGetProcAddress" at 12000 (the _v2 form) and everything else through that
 *   --api runtime11  CUDA 11.3+ runtime: "cuGetProcAddress" at 11030 (the 4-argument form)
 *   --api xla        XLA / TensorFlow: dlsym(h, "cuMemAlloc_v2") and friends
 *   --api link       linked against libcuda: direct calls (only in the capdrv_link build)
 *   --ptds           ask for the per-thread default stream variants (flag 2 / the _ptsz names)
 *
 * OPs: dev N | alloc N | free | freeall | info | pitch W H | managed N | async N | freeasync |
 *      pool N | create N [DEV] | hostcreate N | release | legacy N | threads T ITERS N [HOLD] | status |
 *      fake [DEV] | counter NAME | gpa_status NAME VERSION | reset | badfree | touch PATH |
 *      waitfile PATH | die | shared | sleepms N | fork OUTFILE OP... endchild | reap
 *
 * fork: the child (fork without exec) runs the OPs up to "endchild", printing to OUTFILE, then
 * exits; the parent skips them and goes on. reap waits for every child and prints their statuses.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUstream;
typedef struct {
    int type;
    int requestedHandleTypes;
    struct {
        int type;
        int id;
    } location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;

typedef CUresult (*gpa_v1_t)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa_v2_t)(const char *, void **, int, cuuint64_t, int *);

static struct {
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*free)(CUdeviceptr);
    CUresult (*info)(size_t *, size_t *);
    CUresult (*pitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
    CUresult (*managed)(CUdeviceptr *, size_t, unsigned);
    CUresult (*async)(CUdeviceptr *, size_t, CUstream);
    CUresult (*free_async)(CUdeviceptr, CUstream);
    CUresult (*pool)(CUdeviceptr *, size_t, void *, CUstream);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*legacy)(unsigned int *, unsigned int);
    void (*set_device)(int);
    void (*fake_stats)(int, uint64_t *, uint64_t *, uint64_t *);
    uint64_t (*fake_counter)(const char *);
    void (*fake_reset)(void);
    gpa_v1_t gpa_v1;
    gpa_v2_t gpa_v2;
} f;

static void die(const char *what) {
    printf("{\"op\":\"error\",\"what\":\"%s\",\"dlerror\":\"%s\"}\n", what, dlerror() ? "set" : "");
    fflush(stdout);
    exit(3);
}

#ifdef CAPDRV_LINKED
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, void *, CUstream);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, int *);
void fakeSetDevice(int);
void fakeStats(int, uint64_t *, uint64_t *, uint64_t *);
uint64_t fakeCounter(const char *);
void fakeReset(void);
static void bind_linked(void) {
    f.alloc = cuMemAlloc_v2;
    f.free = cuMemFree_v2;
    f.info = cuMemGetInfo_v2;
    f.pitch = cuMemAllocPitch_v2;
    f.managed = cuMemAllocManaged;
    f.async = cuMemAllocAsync;
    f.free_async = cuMemFreeAsync;
    f.pool = cuMemAllocFromPoolAsync;
    f.create = cuMemCreate;
    f.release = cuMemRelease;
    f.gpa_v1 = cuGetProcAddress;
    f.gpa_v2 = cuGetProcAddress_v2;
    f.set_device = fakeSetDevice;
    f.fake_stats = fakeStats;
    f.fake_counter = fakeCounter;
    f.fake_reset = fakeReset;
}
#endif

static void *must_sym(void *h, const char *name) {
    void *p = dlsym(h, name);
    if (!p) die(name);
    return p;
}

static void *via_gpa(const char *name, int version, cuuint64_t flags) {
    void *p = NULL;
    int status = -1;
    CUresult rc = f.gpa_v2 ? f.gpa_v2(name, &p, version, flags, &status) : f.gpa_v1(name, &p, version, flags);
    if (rc != 0 || !p) die(name);
    return p;
}

static void bind(const char *api, const char *lib, int ptds) {
    if (!strcmp(api, "link")) {
#ifdef CAPDRV_LINKED
        bind_linked();
        return;
#else
        die("--api link needs the capdrv_link build");
#endif
    }
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) die("dlopen");
    f.set_device = must_sym(h, "fakeSetDevice");
    f.fake_stats = must_sym(h, "fakeStats");
    f.fake_counter = must_sym(h, "fakeCounter");
    f.fake_reset = must_sym(h, "fakeReset");
    if (!strcmp(api, "xla")) {
        f.alloc = must_sym(h, "cuMemAlloc_v2");
        f.free = must_sym(h, "cuMemFree_v2");
        f.info = must_sym(h, "cuMemGetInfo_v2");
        f.pitch = must_sym(h, "cuMemAllocPitch_v2");
        f.managed = must_sym(h, "cuMemAllocManaged");
        f.async = must_sym(h, ptds ? "cuMemAllocAsync_ptsz" : "cuMemAllocAsync");
        f.free_async = must_sym(h, ptds ? "cuMemFreeAsync_ptsz" : "cuMemFreeAsync");
        f.pool = must_sym(h, ptds ? "cuMemAllocFromPoolAsync_ptsz" : "cuMemAllocFromPoolAsync");
        f.create = must_sym(h, "cuMemCreate");
        f.release = must_sym(h, "cuMemRelease");
        f.legacy = must_sym(h, "cuMemAlloc");
        f.gpa_v2 = must_sym(h, "cuGetProcAddress_v2");
        return;
    }
    /* The runtime: one dlsym, then the driver's own lookup, asked for itself first. */
    gpa_v1_t first = (gpa_v1_t)must_sym(h, "cuGetProcAddress");
    int v12 = strcmp(api, "runtime11") != 0;
    void *p = NULL;
    if (first("cuGetProcAddress", &p, v12 ? 12000 : 11030, 0) != 0 || !p) die("cuGetProcAddress(cuGetProcAddress)");
    if (v12)
        f.gpa_v2 = (gpa_v2_t)p;
    else
        f.gpa_v1 = (gpa_v1_t)p;
    cuuint64_t fl = ptds ? 2 : 0;
    f.alloc = via_gpa("cuMemAlloc", 3020, fl);
    f.free = via_gpa("cuMemFree", 3020, fl);
    f.info = via_gpa("cuMemGetInfo", 3020, fl);
    f.pitch = via_gpa("cuMemAllocPitch", 3020, fl);
    f.managed = via_gpa("cuMemAllocManaged", 6000, fl);
    f.async = via_gpa("cuMemAllocAsync", 11020, fl);
    f.free_async = via_gpa("cuMemFreeAsync", 11020, fl);
    f.pool = via_gpa("cuMemAllocFromPoolAsync", 11020, fl);
    f.create = via_gpa("cuMemCreate", 10020, fl);
    f.release = via_gpa("cuMemRelease", 10020, fl);
    f.legacy = via_gpa("cuMemAlloc", 2000, fl);
}

/* ---- operations ---------------------------------------------------------------------------- */

#define MAXLIVE 4096
static CUdeviceptr ptrs[MAXLIVE];
static int nptrs;
static CUmemGenericAllocationHandle handles[MAXLIVE];
static int nhandles;

static void push(CUdeviceptr p) {
    if (nptrs < MAXLIVE) ptrs[nptrs++] = p;
}

typedef struct {
    int iters;
    int hold; /* allocations each thread keeps live at once (a ring; the oldest is freed first) */
    size_t size;
    int id;
    long ok, denied, other;
} worker_t;

static void *worker(void *arg) {
    worker_t *w = arg;
    CUdeviceptr ring[64] = {0};
    int hold = w->hold < 1 ? 1 : (w->hold > 64 ? 64 : w->hold);
    for (int i = 0; i < w->iters; i++) {
        int slot = i % hold;
        if (ring[slot]) {
            CUresult frc = (i & 1) ? f.free_async(ring[slot], NULL) : f.free(ring[slot]);
            if (frc != 0) w->other++;
            ring[slot] = 0;
        }
        CUdeviceptr p = 0;
        size_t n = w->size * (size_t)(1 + (i + w->id) % 3); /* 1, 2 or 3 units */
        int path = (i + w->id) % 4;
        CUresult rc = path == 0   ? f.alloc(&p, n)
                      : path == 1 ? f.async(&p, n, NULL)
                      : path == 2 ? f.pool(&p, n, NULL, NULL)
                                  : f.managed(&p, n, 1);
        if (rc == 0) {
            w->ok++;
            ring[slot] = p;
        } else if (rc == 2) {
            w->denied++;
        } else {
            w->other++;
        }
    }
    for (int k = 0; k < hold; k++)
        if (ring[k] && f.free(ring[k]) != 0) w->other++;
    return NULL;
}

typedef struct {
    uint64_t cap_bytes, used_bytes, peak_bytes, denials, last_denied_bytes, live_allocations, total_allocations;
} stats_t;

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *api = "runtime";
    const char *lib = "libcuda.so.1";
    int ptds = 0;
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (!strcmp(argv[i], "--api") && i + 1 < argc)
            api = argv[++i];
        else if (!strcmp(argv[i], "--lib") && i + 1 < argc)
            lib = argv[++i];
        else if (!strcmp(argv[i], "--ptds"))
            ptds = 1;
        else
            die(argv[i]);
    }
    bind(api, lib, ptds);
    for (; i < argc; i++) {
        const char *op = argv[i];
#define ARG(k) (i + (k) < argc ? strtoull(argv[i + (k)], NULL, 10) : 0ULL)
        if (!strcmp(op, "dev")) {
            int d = (int)ARG(1);
            i += 1;
            f.set_device(d);
            printf("{\"op\":\"dev\",\"dev\":%d}\n", d);
        } else if (!strcmp(op, "alloc") || !strcmp(op, "managed") || !strcmp(op, "async") || !strcmp(op, "pool")) {
            size_t n = (size_t)ARG(1);
            i += 1;
            CUdeviceptr p = 0;
            CUresult rc = !strcmp(op, "alloc")     ? f.alloc(&p, n)
                          : !strcmp(op, "managed") ? f.managed(&p, n, 1)
                          : !strcmp(op, "async")   ? f.async(&p, n, NULL)
                                                   : f.pool(&p, n, NULL, NULL);
            if (rc == 0) push(p);
            printf("{\"op\":\"%s\",\"bytes\":%zu,\"rc\":%d}\n", op, n, rc);
        } else if (!strcmp(op, "free") || !strcmp(op, "freeasync")) {
            CUresult rc = -1;
            if (nptrs > 0) {
                CUdeviceptr p = ptrs[--nptrs];
                rc = !strcmp(op, "free") ? f.free(p) : f.free_async(p, NULL);
            }
            printf("{\"op\":\"%s\",\"rc\":%d}\n", op, rc);
        } else if (!strcmp(op, "freeall")) {
            int bad = 0;
            while (nptrs > 0)
                if (f.free(ptrs[--nptrs]) != 0) bad++;
            while (nhandles > 0)
                if (f.release(handles[--nhandles]) != 0) bad++;
            printf("{\"op\":\"freeall\",\"failures\":%d}\n", bad);
        } else if (!strcmp(op, "info")) {
            size_t fr = 0, to = 0;
            CUresult rc = f.info(&fr, &to);
            printf("{\"op\":\"info\",\"rc\":%d,\"free\":%zu,\"total\":%zu}\n", rc, fr, to);
        } else if (!strcmp(op, "pitch")) {
            size_t w = (size_t)ARG(1), h = (size_t)ARG(2), pt = 0;
            i += 2;
            CUdeviceptr p = 0;
            CUresult rc = f.pitch(&p, &pt, w, h, 4);
            if (rc == 0) push(p);
            printf("{\"op\":\"pitch\",\"rc\":%d,\"pitch\":%zu}\n", rc, pt);
        } else if (!strcmp(op, "create") || !strcmp(op, "hostcreate")) {
            size_t n = (size_t)ARG(1);
            i += 1;
            CUmemAllocationProp prop;
            memset(&prop, 0, sizeof prop);
            prop.type = 1;
            prop.location.type = !strcmp(op, "create") ? 1 : 2;
            prop.location.id = 0;
            if (!strcmp(op, "create") && i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9') {
                prop.location.id = atoi(argv[++i]);
            }
            CUmemGenericAllocationHandle h = 0;
            CUresult rc = f.create(&h, n, &prop, 0);
            if (rc == 0 && nhandles < MAXLIVE) handles[nhandles++] = h;
            printf("{\"op\":\"%s\",\"bytes\":%zu,\"rc\":%d}\n", op, n, rc);
        } else if (!strcmp(op, "release")) {
            CUresult rc = nhandles > 0 ? f.release(handles[--nhandles]) : -1;
            printf("{\"op\":\"release\",\"rc\":%d}\n", rc);
        } else if (!strcmp(op, "legacy")) {
            unsigned int p = 0;
            unsigned int n = (unsigned int)ARG(1);
            i += 1;
            CUresult rc = f.legacy ? f.legacy(&p, n) : -1;
            printf("{\"op\":\"legacy\",\"bytes\":%u,\"rc\":%d}\n", n, rc);
        } else if (!strcmp(op, "threads")) {
            int t = (int)ARG(1), iters = (int)ARG(2);
            size_t n = (size_t)ARG(3);
            int hold = 1;
            i += 3;
            if (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9') hold = atoi(argv[++i]);
            pthread_t th[64];
            worker_t w[64];
            if (t > 64) t = 64;
            for (int k = 0; k < t; k++) {
                w[k] = (worker_t){.iters = iters, .hold = hold, .size = n, .id = k};
                pthread_create(&th[k], NULL, worker, &w[k]);
            }
            long ok = 0, denied = 0, other = 0;
            for (int k = 0; k < t; k++) {
                pthread_join(th[k], NULL);
                ok += w[k].ok;
                denied += w[k].denied;
                other += w[k].other;
            }
            printf("{\"op\":\"threads\",\"ok\":%ld,\"denied\":%ld,\"other\":%ld}\n", ok, denied, other);
        } else if (!strcmp(op, "reset")) {
            f.fake_reset();
            nptrs = nhandles = 0;
            printf("{\"op\":\"reset\"}\n");
        } else if (!strcmp(op, "badfree")) {
            CUresult rc = f.free((CUdeviceptr)0xdead0000ULL);
            printf("{\"op\":\"badfree\",\"rc\":%d}\n", rc);
        } else if (!strcmp(op, "touch")) {
            FILE *fp = fopen(argv[++i], "w");
            if (fp) fclose(fp);
            printf("{\"op\":\"touch\",\"ok\":%s}\n", fp ? "true" : "false");
        } else if (!strcmp(op, "waitfile")) {
            const char *path = argv[++i];
            int ok = 0;
            for (int k = 0; k < 3000 && !ok; k++) { /* 30 s at most */
                ok = access(path, F_OK) == 0;
                if (!ok) usleep(10000);
            }
            printf("{\"op\":\"waitfile\",\"ok\":%s}\n", ok ? "true" : "false");
            if (!ok) return 4;
        } else if (!strcmp(op, "fork")) {
            const char *out = argv[++i];
            fflush(stdout);
            pid_t pid = fork();
            if (pid < 0) die("fork");
            if (pid == 0) {
                if (!freopen(out, "w", stdout)) _exit(5);
                dup2(fileno(stdout), 2); /* the parent's pipes stay the parent's */
                setvbuf(stdout, NULL, _IOLBF, 0);
                printf("{\"op\":\"fork\",\"child\":true,\"pid\":%d}\n", (int)getpid());
                continue;
            }
            int depth = 0;
            for (i++; i < argc; i++) { /* the parent skips the child's part */
                if (!strcmp(argv[i], "fork")) depth++;
                if (!strcmp(argv[i], "endchild") && depth-- == 0) break;
            }
            printf("{\"op\":\"fork\",\"child\":false,\"pid\":%d}\n", (int)pid);
        } else if (!strcmp(op, "endchild")) {
            fflush(stdout);
            exit(0); /* only a child gets here: the parent skipped past it */
        } else if (!strcmp(op, "reap")) {
            int st, n = 0, bad = 0;
            pid_t p;
            while ((p = wait(&st)) > 0) {
                n++;
                if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) bad++;
            }
            printf("{\"op\":\"reap\",\"children\":%d,\"failed\":%d}\n", n, bad);
        } else if (!strcmp(op, "sleepms")) {
            usleep((useconds_t)ARG(1) * 1000);
            i += 1;
            printf("{\"op\":\"sleepms\"}\n");
        } else if (!strcmp(op, "die")) {
            fflush(stdout);
            raise(SIGKILL); /* dies holding its memory: the others must reclaim its share */
        } else if (!strcmp(op, "shared")) {
            typedef struct {
                uint64_t budget, used, processes, active;
            } shared_t;
            int (*get)(int, shared_t *, size_t) = (int (*)(int, shared_t *, size_t))dlsym(RTLD_DEFAULT, "distmem_cap_get_shared");
            shared_t sh = {0, 0, 0, 0};
            if (get) get(0, &sh, sizeof sh);
            printf("{\"op\":\"shared\",\"budget\":%llu,\"used\":%llu,\"processes\":%llu,\"active\":%llu}\n",
                   (unsigned long long)sh.budget, (unsigned long long)sh.used, (unsigned long long)sh.processes,
                   (unsigned long long)sh.active);
        } else if (!strcmp(op, "status")) {
            int (*get)(int, stats_t *, size_t) = (int (*)(int, stats_t *, size_t))dlsym(RTLD_DEFAULT, "distmem_cap_get_stats");
            if (!get) {
                printf("{\"op\":\"status\",\"loaded\":false}\n");
            } else {
                printf("{\"op\":\"status\",\"loaded\":true,\"devices\":[");
                for (int d = 0; d < 2; d++) {
                    stats_t s;
                    get(d, &s, sizeof s);
                    printf("%s{\"cap\":%llu,\"used\":%llu,\"peak\":%llu,\"denials\":%llu,\"last_denied\":%llu,"
                           "\"live\":%llu,\"total\":%llu}",
                           d ? "," : "", (unsigned long long)s.cap_bytes, (unsigned long long)s.used_bytes,
                           (unsigned long long)s.peak_bytes, (unsigned long long)s.denials,
                           (unsigned long long)s.last_denied_bytes, (unsigned long long)s.live_allocations,
                           (unsigned long long)s.total_allocations);
                }
                printf("]}\n");
            }
        } else if (!strcmp(op, "fake")) {
            int d = 0;
            if (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9') d = atoi(argv[++i]);
            uint64_t u, p, l;
            f.fake_stats(d, &u, &p, &l);
            printf("{\"op\":\"fake\",\"dev\":%d,\"used\":%llu,\"peak\":%llu,\"live\":%llu}\n", d,
                   (unsigned long long)u, (unsigned long long)p, (unsigned long long)l);
        } else if (!strcmp(op, "counter")) {
            const char *name = i + 1 < argc ? argv[++i] : "";
            printf("{\"op\":\"counter\",\"name\":\"%s\",\"value\":%llu}\n", name,
                   (unsigned long long)f.fake_counter(name));
        } else if (!strcmp(op, "gpa_status")) {
            /* what cuGetProcAddress_v2 says for a name at a version, and whether the answer is the
             * library's export of the same name or a wrapper */
            const char *name = argv[++i];
            int version = atoi(argv[++i]);
            void *p = NULL;
            int status = -1;
            CUresult rc = f.gpa_v2 ? f.gpa_v2(name, &p, version, 0, &status) : f.gpa_v1(name, &p, version, 0);
            Dl_info info;
            const char *where = (p && dladdr(p, &info) && info.dli_fname) ? info.dli_fname : "";
            printf("{\"op\":\"gpa_status\",\"name\":\"%s\",\"rc\":%d,\"status\":%d,\"from\":\"%s\"}\n", name, rc,
                   status, where);
        } else {
            die(op);
        }
    }
    return 0;
}
