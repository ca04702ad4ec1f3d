/* The wrapped CUDA driver entry points.
 *
 * Each allocation reserves its size against the device's cap before the driver is asked (so threads
 * racing for the last bytes cannot all win), then records pointer -> (size, device) on success or
 * gives the reservation back on failure. Each free removes the record before the driver is asked
 * (so an address the driver hands out again at once is never confused with the old one) and puts
 * it back if the driver refuses. Frees of pointers we never saw pass through uncounted.
 */
#include <string.h>

#include "internal.h"

static _Atomic(cuCtxGetDevice_fn) ctx_get_device;

static int current_device(void) {
    cuCtxGetDevice_fn f = atomic_load(&ctx_get_device);
    if (!f) {
        f = (cuCtxGetDevice_fn)dm_driver_symbol("cuCtxGetDevice");
        if (!f) return 0;
        atomic_store(&ctx_get_device, f);
    }
    CUdevice dev = 0;
    if (f(&dev) != CUDA_SUCCESS) return 0;
    return dev;
}

#define REAL(slot, type) ((type)dm_real(slot))
#define COUNT_CALL() atomic_fetch_add_explicit(&dm_wrapped_calls, 1, memory_order_relaxed)

/* ---- cuGetProcAddress ---------------------------------------------------------------------- */

/* Replaces a freshly looked-up driver function with ours when it is one we wrap. */
static void wrap_lookup(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    if (!symbol || !pfn || !*pfn) return;
    int slot = dm_slot_for_procaddr(symbol, version, flags);
    if (slot < 0) return;
    if (!dm_is_wrapper(*pfn)) dm_set_real(slot, *pfn);
    *pfn = dm_slots[slot].wrapper;
    atomic_fetch_add_explicit(&dm_procaddr_lookups, 1, memory_order_relaxed);
}

DM_HIDDEN CUresult dm_w_cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    CUresult rc;
    cuGetProcAddress_fn v1 = REAL(DM_GET_PROC_ADDRESS, cuGetProcAddress_fn);
    if (v1) {
        rc = v1(symbol, pfn, version, flags);
    } else {
        cuGetProcAddress_v2_fn v2 = REAL(DM_GET_PROC_ADDRESS_V2, cuGetProcAddress_v2_fn);
        if (!v2) return CUDA_ERROR_NOT_INITIALIZED;
        int status = 0;
        rc = v2(symbol, pfn, version, flags, &status);
    }
    if (rc == CUDA_SUCCESS) wrap_lookup(symbol, pfn, version, flags);
    return rc;
}

DM_HIDDEN CUresult dm_w_cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                            int *status) {
    CUresult rc;
    cuGetProcAddress_v2_fn v2 = REAL(DM_GET_PROC_ADDRESS_V2, cuGetProcAddress_v2_fn);
    if (v2) {
        rc = v2(symbol, pfn, version, flags, status);
    } else {
        cuGetProcAddress_fn v1 = REAL(DM_GET_PROC_ADDRESS, cuGetProcAddress_fn);
        if (!v1) return CUDA_ERROR_NOT_INITIALIZED;
        rc = v1(symbol, pfn, version, flags);
        if (status) *status = rc == CUDA_SUCCESS ? 0 : 1;
    }
    if (rc == CUDA_SUCCESS) wrap_lookup(symbol, pfn, version, flags);
    return rc;
}

/* ---- allocation ---------------------------------------------------------------------------- */

#define ALLOC_BODY(slot, type, entry, dev_expr, call)                                            \
    COUNT_CALL();                                                                               \
    type real = REAL(slot, type);                                                               \
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;                                               \
    int dev = (dev_expr);                                                                       \
    if (!dm_reserve(dev, (uint64_t)bytes, entry)) return CUDA_ERROR_OUT_OF_MEMORY;              \
    CUresult rc = call;                                                                         \
    if (rc == CUDA_SUCCESS && dptr) {                                                           \
        dm_table_insert(DM_TABLE_PTR, (uint64_t)*dptr, (uint64_t)bytes, dev);                   \
        dm_note_allocation(dev);                                                                \
    } else {                                                                                    \
        dm_unreserve(dev, (uint64_t)bytes);                                                     \
    }                                                                                           \
    return rc;

DM_HIDDEN CUresult dm_w_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    ALLOC_BODY(DM_MEM_ALLOC, cuMemAlloc_fn, "cuMemAlloc", current_device(), real(dptr, bytes))
}

DM_HIDDEN CUresult dm_w_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    ALLOC_BODY(DM_MEM_ALLOC_MANAGED, cuMemAllocManaged_fn, "cuMemAllocManaged", current_device(),
               real(dptr, bytes, flags))
}

DM_HIDDEN CUresult dm_w_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    ALLOC_BODY(DM_MEM_ALLOC_ASYNC, cuMemAllocAsync_fn, "cuMemAllocAsync", current_device(),
               real(dptr, bytes, stream))
}

DM_HIDDEN CUresult dm_w_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    ALLOC_BODY(DM_MEM_ALLOC_ASYNC_PTSZ, cuMemAllocAsync_fn, "cuMemAllocAsync", current_device(),
               real(dptr, bytes, stream))
}

DM_HIDDEN CUresult dm_w_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                                CUstream stream) {
    ALLOC_BODY(DM_MEM_ALLOC_FROM_POOL_ASYNC, cuMemAllocFromPoolAsync_fn, "cuMemAllocFromPoolAsync",
               current_device(), real(dptr, bytes, pool, stream))
}

DM_HIDDEN CUresult dm_w_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                                     CUstream stream) {
    ALLOC_BODY(DM_MEM_ALLOC_FROM_POOL_ASYNC_PTSZ, cuMemAllocFromPoolAsync_fn, "cuMemAllocFromPoolAsync",
               current_device(), real(dptr, bytes, pool, stream))
}

DM_HIDDEN CUresult dm_w_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                           unsigned int element_size) {
    COUNT_CALL();
    cuMemAllocPitch_fn real = REAL(DM_MEM_ALLOC_PITCH, cuMemAllocPitch_fn);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    int dev = current_device();
    /* The driver picks the pitch (>= width); charge width x height first, then the padding. */
    uint64_t guess = (height && width > UINT64_MAX / height) ? UINT64_MAX : (uint64_t)width * height;
    if (!dm_reserve(dev, guess, "cuMemAllocPitch")) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, pitch, width, height, element_size);
    if (rc != CUDA_SUCCESS || !dptr || !pitch) {
        dm_unreserve(dev, guess);
        return rc;
    }
    uint64_t actual = (uint64_t)*pitch * height;
    if (actual > guess) {
        if (!dm_reserve(dev, actual - guess, "cuMemAllocPitch")) {
            cuMemFree_fn free_fn = REAL(DM_MEM_FREE, cuMemFree_fn);
            if (free_fn) free_fn(*dptr);
            dm_unreserve(dev, guess);
            *dptr = 0;
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if (actual < guess) {
        dm_unreserve(dev, guess - actual);
    }
    dm_table_insert(DM_TABLE_PTR, (uint64_t)*dptr, actual, dev);
    dm_note_allocation(dev);
    return rc;
}

DM_HIDDEN CUresult dm_w_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                                    const CUmemAllocationProp *prop, unsigned long long flags) {
    COUNT_CALL();
    cuMemCreate_fn real = REAL(DM_MEM_CREATE, cuMemCreate_fn);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real(handle, bytes, prop, flags); /* host memory: not ours to cap */
    int dev = prop->location.id;
    if (!dm_reserve(dev, (uint64_t)bytes, "cuMemCreate")) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(handle, bytes, prop, flags);
    if (rc == CUDA_SUCCESS && handle) {
        dm_table_insert(DM_TABLE_HANDLE, (uint64_t)*handle, (uint64_t)bytes, dev);
        dm_note_allocation(dev);
    } else {
        dm_unreserve(dev, (uint64_t)bytes);
    }
    return rc;
}

/* ---- free ------------------------------------------------------------------------------------ */

#define FREE_BODY(table, key, call)                                                             \
    uint64_t size = 0;                                                                          \
    int dev = 0;                                                                                \
    int known = dm_table_remove(table, (uint64_t)(key), &size, &dev);                           \
    CUresult rc = call;                                                                         \
    if (known) {                                                                                \
        if (rc == CUDA_SUCCESS)                                                                 \
            dm_freed(dev, size);                                                                \
        else                                                                                    \
            dm_table_insert(table, (uint64_t)(key), size, dev);                                 \
    }                                                                                           \
    return rc;

DM_HIDDEN CUresult dm_w_cuMemFree_v2(CUdeviceptr dptr) {
    COUNT_CALL();
    cuMemFree_fn real = REAL(DM_MEM_FREE, cuMemFree_fn);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    FREE_BODY(DM_TABLE_PTR, dptr, real(dptr))
}

DM_HIDDEN CUresult dm_w_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    COUNT_CALL();
    cuMemFreeAsync_fn real = REAL(DM_MEM_FREE_ASYNC, cuMemFreeAsync_fn);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    FREE_BODY(DM_TABLE_PTR, dptr, real(dptr, stream))
}

DM_HIDDEN CUresult dm_w_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) {
    COUNT_CALL();
    cuMemFreeAsync_fn real = REAL(DM_MEM_FREE_ASYNC_PTSZ, cuMemFreeAsync_fn);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    FREE_BODY(DM_TABLE_PTR, dptr, real(dptr, stream))
}

DM_HIDDEN CUresult dm_w_cuMemRelease(CUmemGenericAllocationHandle handle) {
    COUNT_CALL();
    cuMemRelease_fn real = REAL(DM_MEM_RELEASE, cuMemRelease_fn);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    FREE_BODY(DM_TABLE_HANDLE, handle, real(handle))
}

/* ---- info ------------------------------------------------------------------------------------ */

DM_HIDDEN CUresult dm_w_cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    COUNT_CALL();
    cuMemGetInfo_fn real = REAL(DM_MEM_GET_INFO, cuMemGetInfo_fn);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(free_bytes, total_bytes);
    if (rc != CUDA_SUCCESS || !free_bytes || !total_bytes) return rc;
    int dev = current_device();
    uint64_t cap = dm_cap(dev);
    if (cap == DISTMEM_CAP_UNLIMITED) return rc;
    /* Frameworks size their pools from these two numbers: show them the cap as the device. */
    uint64_t total = (uint64_t)*total_bytes < cap ? (uint64_t)*total_bytes : cap;
    uint64_t used = dm_used(dev);
    uint64_t left = used < total ? total - used : 0;
    if ((uint64_t)*free_bytes > left) *free_bytes = (size_t)left;
    *total_bytes = (size_t)total;
    return rc;
}

/* ---- the table of entry points, and the exported names -------------------------------------- */

const dm_slot_info_t dm_slots[DM_SLOT_COUNT] = {
    [DM_GET_PROC_ADDRESS] = {"cuGetProcAddress", "cuGetProcAddress", 0, 0, (void *)dm_w_cuGetProcAddress},
    [DM_GET_PROC_ADDRESS_V2] = {"cuGetProcAddress_v2", "cuGetProcAddress", 12000, 0,
                                (void *)dm_w_cuGetProcAddress_v2},
    [DM_MEM_ALLOC] = {"cuMemAlloc_v2", "cuMemAlloc", 3020, 0, (void *)dm_w_cuMemAlloc_v2},
    [DM_MEM_FREE] = {"cuMemFree_v2", "cuMemFree", 3020, 0, (void *)dm_w_cuMemFree_v2},
    [DM_MEM_GET_INFO] = {"cuMemGetInfo_v2", "cuMemGetInfo", 3020, 0, (void *)dm_w_cuMemGetInfo_v2},
    [DM_MEM_ALLOC_PITCH] = {"cuMemAllocPitch_v2", "cuMemAllocPitch", 3020, 0, (void *)dm_w_cuMemAllocPitch_v2},
    [DM_MEM_ALLOC_MANAGED] = {"cuMemAllocManaged", "cuMemAllocManaged", 0, 0, (void *)dm_w_cuMemAllocManaged},
    [DM_MEM_ALLOC_ASYNC] = {"cuMemAllocAsync", "cuMemAllocAsync", 0, 0, (void *)dm_w_cuMemAllocAsync},
    [DM_MEM_ALLOC_ASYNC_PTSZ] = {"cuMemAllocAsync_ptsz", "cuMemAllocAsync", 0, 1,
                                 (void *)dm_w_cuMemAllocAsync_ptsz},
    [DM_MEM_FREE_ASYNC] = {"cuMemFreeAsync", "cuMemFreeAsync", 0, 0, (void *)dm_w_cuMemFreeAsync},
    [DM_MEM_FREE_ASYNC_PTSZ] = {"cuMemFreeAsync_ptsz", "cuMemFreeAsync", 0, 1, (void *)dm_w_cuMemFreeAsync_ptsz},
    [DM_MEM_ALLOC_FROM_POOL_ASYNC] = {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", 0, 0,
                                      (void *)dm_w_cuMemAllocFromPoolAsync},
    [DM_MEM_ALLOC_FROM_POOL_ASYNC_PTSZ] = {"cuMemAllocFromPoolAsync_ptsz", "cuMemAllocFromPoolAsync", 0, 1,
                                           (void *)dm_w_cuMemAllocFromPoolAsync_ptsz},
    [DM_MEM_CREATE] = {"cuMemCreate", "cuMemCreate", 0, 0, (void *)dm_w_cuMemCreate},
    [DM_MEM_RELEASE] = {"cuMemRelease", "cuMemRelease", 0, 0, (void *)dm_w_cuMemRelease},
};

/* Programs linked against libcuda call these names directly; the preload puts ours first. */
#define EXPORT_ALIAS(name) \
    extern __typeof__(dm_w_##name) name __attribute__((alias("dm_w_" #name), visibility("default")));

EXPORT_ALIAS(cuGetProcAddress)
EXPORT_ALIAS(cuGetProcAddress_v2)
EXPORT_ALIAS(cuMemAlloc_v2)
EXPORT_ALIAS(cuMemFree_v2)
EXPORT_ALIAS(cuMemGetInfo_v2)
EXPORT_ALIAS(cuMemAllocPitch_v2)
EXPORT_ALIAS(cuMemAllocManaged)
EXPORT_ALIAS(cuMemAllocAsync)
EXPORT_ALIAS(cuMemAllocAsync_ptsz)
EXPORT_ALIAS(cuMemFreeAsync)
EXPORT_ALIAS(cuMemFreeAsync_ptsz)
EXPORT_ALIAS(cuMemAllocFromPoolAsync)
EXPORT_ALIAS(cuMemAllocFromPoolAsync_ptsz)
EXPORT_ALIAS(cuMemCreate)
EXPORT_ALIAS(cuMemRelease)
