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
 * Sizes run from 0 to 9223372036854775807 (2^63 - 1); anything larger is malformed.
 *
 * Optional GPU-wide budget, shared by this user's capped processes on a physical GPU (by UUID)
 * through a table in DISTMEM_CAP_SHM_DIR (default /dev/shm)/distmem-cap-u<uid>/ (0700, checked);
 * same syntax as DISTMEM_CAP_BYTES:
 *   DISTMEM_CAP_GPU_BYTES=70GiB          all of this user's capped processes on each GPU together
 *   DISTMEM_CAP_SHM_GROUP=GID            share the budget with every member of group GID instead
 *                                        (distmem-cap-g<GID>/, 02770): members can read and change it
 *   DISTMEM_CAP_CONFIRM=FD:NONCE         write "NONCE abi=N config_ok=B pid=P" to the pipe FD at load
 *                                        (distmem-exec's check that the library really loads)
 *
 * Fails closed: a malformed DISTMEM_CAP_BYTES or DISTMEM_CAP_GPU_BYTES, or a GPU-wide table that
 * cannot be used as it must (another owner, a wrong mode or size, no UUID), denies every device
 * allocation it concerns, and stderr says why.
 *
 * Python reads these through ctypes (distmem/apply/native.py mirrors the structs; keep them in step
 * and bump DISTMEM_CAP_ABI_VERSION on any change).
 */
#ifndef DISTMEM_CAP_H
#define DISTMEM_CAP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DISTMEM_CAP_ABI_VERSION 2 /* 2: per-user tables that fail closed, distmem_cap_shared_error */
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
    uint64_t processes;    /* live processes holding a slot in the table */
    uint64_t active;       /* 1 once this process has joined the GPU's table (at its first allocation) */
} distmem_cap_shared_t;

/* Returns 0 and fills *out (at most out_size bytes), or -1 for a device outside [0, max_devices). */
int distmem_cap_get_stats(int device, distmem_cap_stats_t *out, size_t out_size);

/* Returns 0 and fills *out (at most out_size bytes), or -1 for a device outside [0, max_devices). */
int distmem_cap_get_shared(int device, distmem_cap_shared_t *out, size_t out_size);

/* Why the GPU-wide budget of this device cannot be enforced (every allocation there is then
 * denied), or "" when it can or none applies. */
const char *distmem_cap_shared_error(int device);

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
