/*
 * distmem native hard cap: the status interface libdistmem_cap.so exports.
 *
 * The library is meant to be loaded with LD_PRELOAD. It interposes dlsym() and the CUDA driver's
 * allocation entry points, and denies (CUDA_ERROR_OUT_OF_MEMORY) any allocation that would take
 * this process's accounted usage on a device above its cap. The cap comes from the environment:
 *
 *   DISTMEM_CAP_BYTES=10737418240        every device this process uses: 10 GiB
 *   DISTMEM_CAP_BYTES=10GiB              same; units B, K/KB, M/MB, G/GB, T/TB (powers of 1000)
 *                                        and KiB, MiB, GiB, TiB (powers of 1024)
 *   DISTMEM_CAP_BYTES=0:8GiB,1:4GiB      per CUDA device ordinal (as this process numbers them);
 *                                        "*:SIZE" sets the default for unlisted devices, which
 *                                        are otherwise counted but not capped
 *   unset or empty                       counted, not capped
 *   DISTMEM_CAP_VERBOSE=1                one line at load, one per denial (default: the first only)
 *
 * Optional GPU-wide budget, shared by every capped process on a physical GPU (by UUID) through a
 * small table in DISTMEM_CAP_SHM_DIR (default /dev/shm); same syntax as DISTMEM_CAP_BYTES:
 *   DISTMEM_CAP_GPU_BYTES=70GiB          all capped processes on each GPU together
 *
 * A malformed DISTMEM_CAP_BYTES fails closed: every device allocation is denied and stderr says why.
 *
 * Python reads these through ctypes (distmem/native.py mirrors the structs; keep them in step and
 * bump DISTMEM_CAP_ABI_VERSION on any change).
 */
#ifndef DISTMEM_CAP_H
#define DISTMEM_CAP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DISTMEM_CAP_ABI_VERSION 1
#define DISTMEM_CAP_MAX_DEVICES 64
#define DISTMEM_CAP_UNLIMITED UINT64_MAX

/* One device's figures, in bytes unless named otherwise. */
typedef struct distmem_cap_stats {
    uint64_t cap_bytes;         /* DISTMEM_CAP_UNLIMITED when this device is counted, not capped */
    uint64_t used_bytes;        /* live allocations made through the wrapped entry points */
    uint64_t peak_bytes;        /* high-water mark of used_bytes */
    uint64_t denials;           /* allocations refused with CUDA_ERROR_OUT_OF_MEMORY by the cap */
    uint64_t last_denied_bytes; /* size of the most recent refused request (0 if none) */
    uint64_t live_allocations;  /* allocations and VMM handles not yet freed */
    uint64_t total_allocations; /* successful allocations since load */
} distmem_cap_stats_t;

/* Process-wide facts: is the interposition wired, and what did the environment say. */
typedef struct distmem_cap_info {
    uint32_t abi_version;       /* DISTMEM_CAP_ABI_VERSION */
    uint32_t max_devices;       /* DISTMEM_CAP_MAX_DEVICES */
    uint32_t config_ok;         /* 0: DISTMEM_CAP_BYTES was malformed and every allocation is denied */
    uint32_t capped;            /* 1 if any device has a cap */
    uint64_t default_cap_bytes; /* cap of devices not named in the spec (DISTMEM_CAP_UNLIMITED: none) */
    uint64_t dlsym_lookups;     /* wrapped entry points handed out by dlsym() */
    uint64_t procaddr_lookups;  /* wrapped entry points handed out by cuGetProcAddress(_v2) */
    uint64_t wrapped_calls;     /* calls that went through a wrapper (allocation, free or info) */
    uint64_t denials;           /* over all devices */
} distmem_cap_info_t;

/* The GPU-wide budget as this process sees it (DISTMEM_CAP_GPU_BYTES). */
typedef struct distmem_cap_shared {
    uint64_t budget_bytes; /* DISTMEM_CAP_UNLIMITED when no GPU-wide budget applies to this device */
    uint64_t used_bytes;   /* all capped processes on this GPU, as the shared table counts them */
    uint64_t processes;    /* processes holding a slot in the table */
    uint64_t active;       /* 1 once this process has joined the GPU's table (at its first allocation) */
} distmem_cap_shared_t;

/* Returns 0 and fills *out (at most out_size bytes), or -1 for a device outside [0, max_devices). */
int distmem_cap_get_stats(int device, distmem_cap_stats_t *out, size_t out_size);

/* Returns 0 and fills *out (at most out_size bytes), or -1 for a device outside [0, max_devices). */
int distmem_cap_get_shared(int device, distmem_cap_shared_t *out, size_t out_size);

/* Returns 0 and fills *out (at most out_size bytes). */
int distmem_cap_get_info(distmem_cap_info_t *out, size_t out_size);

/* The DISTMEM_CAP_BYTES text the library read at load ("" when unset), and why it was rejected
 * ("" when it was accepted). */
const char *distmem_cap_spec(void);
const char *distmem_cap_config_error(void);

#ifdef __cplusplus
}
#endif

#endif /* DISTMEM_CAP_H */
