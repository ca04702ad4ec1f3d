/* A fake CUDA driver for the tests: the one fake in the suite, since a real driver cannot exist on
 * machines without a GPU. Built as libcuda.so.1 in a temporary directory.
 *
 * It behaves like the driver where the cap can tell: device memory is a counter per device
 * (FAKE_CUDA_TOTAL bytes each, default 8 GiB; FAKE_CUDA_DEVICES devices, default 2) that refuses
 * with CUDA_ERROR_OUT_OF_MEMORY past the total; addresses are handed out again after a free (as the
 * driver does), so the cap's pointer records see reuse; cuGetProcAddress(_v2) answers base names by
 * version and per-thread-stream flag with internal functions whose addresses differ from the
 * exported symbols (as a driver may). fakeStats() lets a test check what the "device" saw, which is
 * the proof that the cap held: the fake's own peak never exceeds the cap. With FAKE_CUDA_SHARED=PATH
 * (a file of 128 zero bytes) the processes that name it also keep what the GPU as a whole holds
 * there: used[8] then peak[8], uint64 each, so a test sees what a GPU-wide budget let through.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))
#define MAXDEV 8

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUstream;
typedef void *CUmemoryPool;
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

enum { OK = 0, E_INVALID = 1, E_OOM = 2, E_NOT_FOUND = 500, E_NO_CTX = 201 };

/* ---- state -------------------------------------------------------------------------------- */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t total_bytes = 8ULL << 30;
static int ndev = 2;
static uint64_t used[MAXDEV], peak[MAXDEV], live[MAXDEV];
static _Atomic uint64_t *gpu_used, *gpu_peak; /* FAKE_CUDA_SHARED: the whole GPU, across processes */

static void gpu_add(int dev, uint64_t size) {
    if (!gpu_used) return;
    uint64_t now = atomic_fetch_add(&gpu_used[dev], size) + size;
    uint64_t p = atomic_load(&gpu_peak[dev]);
    while (now > p && !atomic_compare_exchange_weak(&gpu_peak[dev], &p, now)) {
    }
}
static __thread int cur_dev = 0;
static int no_context = 0;

typedef struct blk {
    uint64_t addr, size;
    int dev;
    int in_use;
    struct blk *next;
} blk_t;
static blk_t *blocks; /* every address ever handed out; freed ones are reused by size */
static uint64_t next_addr = 0x700000000000ULL;
static uint64_t next_handle = 1;

enum {
    C_ALLOC, C_FREE, C_INFO, C_PITCH, C_MANAGED, C_ASYNC, C_ASYNC_PTSZ, C_FREE_ASYNC, C_FREE_ASYNC_PTSZ,
    C_POOL, C_POOL_PTSZ, C_CREATE, C_RELEASE, C_LEGACY_ALLOC, C_GPA, C_GPA_V2, C_COUNT
};
static const char *counter_names[C_COUNT] = {
    "alloc", "free", "info", "pitch", "managed", "async", "async_ptsz", "free_async", "free_async_ptsz",
    "pool", "pool_ptsz", "create", "release", "legacy_alloc", "gpa", "gpa_v2"};
static _Atomic uint64_t counters[C_COUNT];

__attribute__((constructor)) static void fake_init(void) {
    const char *t = getenv("FAKE_CUDA_TOTAL");
    if (t) total_bytes = strtoull(t, NULL, 10);
    const char *n = getenv("FAKE_CUDA_DEVICES");
    if (n) ndev = atoi(n);
    if (ndev < 1 || ndev > MAXDEV) ndev = 2;
    no_context = getenv("FAKE_CUDA_NO_CONTEXT") != NULL;
    const char *sh = getenv("FAKE_CUDA_SHARED");
    int fd = sh ? open(sh, O_RDWR) : -1;
    if (fd >= 0) {
        void *m = mmap(NULL, 2 * MAXDEV * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (m != MAP_FAILED) {
            gpu_used = (_Atomic uint64_t *)m;
            gpu_peak = gpu_used + MAXDEV;
        }
    }
}

static CUresult take(int dev, uint64_t size, unsigned long long *addr, int is_handle) {
    if (dev < 0 || dev >= ndev) return E_INVALID;
    if (size == 0) return E_INVALID;
    pthread_mutex_lock(&mu);
    if (used[dev] + size > total_bytes) {
        pthread_mutex_unlock(&mu);
        return E_OOM;
    }
    blk_t *b = NULL;
    if (!is_handle)
        for (b = blocks; b; b = b->next)
            if (!b->in_use && b->size == size && b->addr < (1ULL << 62)) break;
    if (!b) {
        b = calloc(1, sizeof *b);
        b->size = size;
        if (is_handle) {
            b->addr = (1ULL << 62) + next_handle++;
        } else {
            b->addr = next_addr;
            next_addr += (size + 0xFFFFF) & ~0xFFFFFULL;
        }
        b->next = blocks;
        blocks = b;
    }
    b->in_use = 1;
    b->dev = dev;
    used[dev] += size;
    gpu_add(dev, size);
    live[dev]++;
    if (used[dev] > peak[dev]) peak[dev] = used[dev];
    *addr = b->addr;
    pthread_mutex_unlock(&mu);
    return OK;
}

static CUresult give(uint64_t addr) {
    pthread_mutex_lock(&mu);
    blk_t *b = blocks;
    while (b && !(b->addr == addr && b->in_use)) b = b->next;
    if (!b) {
        pthread_mutex_unlock(&mu);
        return E_INVALID;
    }
    b->in_use = 0;
    used[b->dev] -= b->size;
    if (gpu_used) atomic_fetch_sub(&gpu_used[b->dev], b->size);
    live[b->dev]--;
    pthread_mutex_unlock(&mu);
    return OK;
}

static int ctx_dev(int *dev) {
    if (no_context) return E_NO_CTX;
    *dev = cur_dev;
    return OK;
}

#define COUNT(c) atomic_fetch_add(&counters[c], 1)

/* ---- implementations (what cuGetProcAddress hands out) ------------------------------------ */

static CUresult i_alloc(CUdeviceptr *p, size_t n) {
    COUNT(C_ALLOC);
    int d;
    if (ctx_dev(&d)) return E_NO_CTX;
    return take(d, n, p, 0);
}
static CUresult i_free(CUdeviceptr p) {
    COUNT(C_FREE);
    return give(p);
}
static CUresult i_info(size_t *f, size_t *t) {
    COUNT(C_INFO);
    int d;
    if (ctx_dev(&d)) return E_NO_CTX;
    pthread_mutex_lock(&mu);
    *f = total_bytes - used[d];
    *t = total_bytes;
    pthread_mutex_unlock(&mu);
    return OK;
}
static CUresult i_pitch(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e) {
    COUNT(C_PITCH);
    int d;
    if (ctx_dev(&d)) return E_NO_CTX;
    size_t pt = (w + 511) & ~(size_t)511;
    CUresult rc = take(d, (uint64_t)pt * h, p, 0);
    if (rc == OK) *pitch = pt;
    return rc;
}
static CUresult i_managed(CUdeviceptr *p, size_t n, unsigned flags) {
    COUNT(C_MANAGED);
    int d;
    if (ctx_dev(&d)) return E_NO_CTX;
    return take(d, n, p, 0);
}
static CUresult i_async(CUdeviceptr *p, size_t n, CUstream s) {
    COUNT(C_ASYNC);
    int d;
    if (ctx_dev(&d)) return E_NO_CTX;
    return take(d, n, p, 0);
}
static CUresult i_async_ptsz(CUdeviceptr *p, size_t n, CUstream s) {
    COUNT(C_ASYNC_PTSZ);
    int d;
    if (ctx_dev(&d)) return E_NO_CTX;
    return take(d, n, p, 0);
}
static CUresult i_free_async(CUdeviceptr p, CUstream s) {
    COUNT(C_FREE_ASYNC);
    return give(p);
}
static CUresult i_free_async_ptsz(CUdeviceptr p, CUstream s) {
    COUNT(C_FREE_ASYNC_PTSZ);
    return give(p);
}
static CUresult i_pool(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s) {
    COUNT(C_POOL);
    int d;
    if (ctx_dev(&d)) return E_NO_CTX;
    return take(d, n, p, 0);
}
static CUresult i_pool_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s) {
    COUNT(C_POOL_PTSZ);
    int d;
    if (ctx_dev(&d)) return E_NO_CTX;
    return take(d, n, p, 0);
}
static CUresult i_create(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                         unsigned long long flags) {
    COUNT(C_CREATE);
    if (!prop) return E_INVALID;
    if (prop->location.type != 1) { /* host memory: handed out, not counted on a device */
        *h = (1ULL << 63) + next_handle++;
        return OK;
    }
    return take(prop->location.id, n, h, 1);
}
static CUresult i_release(CUmemGenericAllocationHandle h) {
    COUNT(C_RELEASE);
    if (h >> 63) return OK;
    return give(h);
}
static CUresult i_legacy_alloc(unsigned int *p, unsigned int n) {
    COUNT(C_LEGACY_ALLOC);
    unsigned long long a;
    int d;
    if (ctx_dev(&d)) return E_NO_CTX;
    CUresult rc = take(d, n, &a, 0);
    if (rc == OK) *p = (unsigned int)a;
    return rc;
}
static CUresult i_ctx_get_device(int *dev) { return ctx_dev(dev); }
static CUresult i_device_get(int *dev, int ordinal) {
    if (ordinal < 0 || ordinal >= ndev) return E_INVALID;
    *dev = ordinal;
    return OK;
}
/* One UUID per (FAKE_CUDA_UUID, device): processes given the same FAKE_CUDA_UUID share "a GPU". */
static CUresult i_device_get_uuid(unsigned char *uuid, int dev) {
    if (dev < 0 || dev >= ndev) return E_INVALID;
    const char *seed = getenv("FAKE_CUDA_UUID");
    if (!seed) seed = "fake-gpu";
    memset(uuid, 0, 16);
    for (size_t i = 0; seed[i]; i++) uuid[i % 15] ^= (unsigned char)seed[i];
    uuid[15] = (unsigned char)dev;
    return OK;
}
static CUresult i_gpa(const char *sym, void **pfn, int ver, cuuint64_t flags);
static CUresult i_gpa_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, int *status);

static void *lookup(const char *s, int ver, cuuint64_t flags) {
    int ptsz = (flags & 2) != 0;
    if (!strcmp(s, "cuGetProcAddress")) return ver >= 12000 ? (void *)i_gpa_v2 : (void *)i_gpa;
    if (!strcmp(s, "cuMemAlloc")) return ver >= 3020 ? (void *)i_alloc : (void *)i_legacy_alloc;
    if (!strcmp(s, "cuMemFree")) return ver >= 3020 ? (void *)i_free : NULL;
    if (!strcmp(s, "cuMemGetInfo")) return ver >= 3020 ? (void *)i_info : NULL;
    if (!strcmp(s, "cuMemAllocPitch")) return ver >= 3020 ? (void *)i_pitch : NULL;
    if (!strcmp(s, "cuMemAllocManaged")) return (void *)i_managed;
    if (!strcmp(s, "cuMemAllocAsync")) return ptsz ? (void *)i_async_ptsz : (void *)i_async;
    if (!strcmp(s, "cuMemFreeAsync")) return ptsz ? (void *)i_free_async_ptsz : (void *)i_free_async;
    if (!strcmp(s, "cuMemAllocFromPoolAsync")) return ptsz ? (void *)i_pool_ptsz : (void *)i_pool;
    if (!strcmp(s, "cuMemCreate")) return (void *)i_create;
    if (!strcmp(s, "cuMemRelease")) return (void *)i_release;
    if (!strcmp(s, "cuCtxGetDevice")) return (void *)i_ctx_get_device;
    if (!strcmp(s, "cuDeviceGet")) return (void *)i_device_get;
    if (!strcmp(s, "cuDeviceGetUuid")) return (void *)i_device_get_uuid;
    return NULL;
}

static CUresult i_gpa(const char *sym, void **pfn, int ver, cuuint64_t flags) {
    COUNT(C_GPA);
    if (!sym || !pfn) return E_INVALID;
    *pfn = lookup(sym, ver, flags);
    return *pfn ? OK : E_NOT_FOUND;
}
static CUresult i_gpa_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, int *status) {
    COUNT(C_GPA_V2);
    if (!sym || !pfn) return E_INVALID;
    *pfn = lookup(sym, ver, flags);
    if (status) *status = *pfn ? 0 : 1;
    return *pfn ? OK : E_NOT_FOUND;
}

/* ---- exported driver names: thin calls into the implementations --------------------------- */

API CUresult cuInit(unsigned flags) { return OK; }
API CUresult cuCtxGetDevice(int *dev) { return i_ctx_get_device(dev); }
API CUresult cuDeviceGet(int *dev, int ordinal) { return i_device_get(dev, ordinal); }
API CUresult cuDeviceGetUuid(unsigned char *uuid, int dev) { return i_device_get_uuid(uuid, dev); }
API CUresult cuDeviceGetUuid_v2(unsigned char *uuid, int dev) { return i_device_get_uuid(uuid, dev); }
API CUresult cuMemAlloc(unsigned int *p, unsigned int n) { return i_legacy_alloc(p, n); }
API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return i_alloc(p, n); }
API CUresult cuMemFree_v2(CUdeviceptr p) { return i_free(p); }
API CUresult cuMemGetInfo_v2(size_t *f, size_t *t) { return i_info(f, t); }
API CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pt, size_t w, size_t h, unsigned e) {
    return i_pitch(p, pt, w, h, e);
}
API CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned f) { return i_managed(p, n, f); }
API CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { return i_async(p, n, s); }
API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { return i_async_ptsz(p, n, s); }
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { return i_free_async(p, s); }
API CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return i_free_async_ptsz(p, s); }
API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool pl, CUstream s) {
    return i_pool(p, n, pl, s);
}
API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool pl, CUstream s) {
    return i_pool_ptsz(p, n, pl, s);
}
API CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                         unsigned long long f) {
    return i_create(h, n, prop, f);
}
API CUresult cuMemRelease(CUmemGenericAllocationHandle h) { return i_release(h); }
API CUresult cuGetProcAddress(const char *s, void **pfn, int v, cuuint64_t f) { return i_gpa(s, pfn, v, f); }
API CUresult cuGetProcAddress_v2(const char *s, void **pfn, int v, cuuint64_t f, int *st) {
    return i_gpa_v2(s, pfn, v, f, st);
}

/* ---- test helpers -------------------------------------------------------------------------- */

API void fakeSetDevice(int dev) { cur_dev = dev; }

API void fakeStats(int dev, uint64_t *u, uint64_t *p, uint64_t *l) {
    pthread_mutex_lock(&mu);
    *u = used[dev];
    *p = peak[dev];
    *l = live[dev];
    pthread_mutex_unlock(&mu);
}

/* What destroying a context does: every allocation gone, without a free the cap could see. */
API void fakeReset(void) {
    pthread_mutex_lock(&mu);
    for (blk_t *b = blocks; b; b = b->next) b->in_use = 0;
    for (int d = 0; d < MAXDEV; d++) used[d] = live[d] = 0;
    pthread_mutex_unlock(&mu);
}

API uint64_t fakeCounter(const char *name) {
    for (int i = 0; i < C_COUNT; i++)
        if (!strcmp(counter_names[i], name)) return atomic_load(&counters[i]);
    return UINT64_MAX;
}
