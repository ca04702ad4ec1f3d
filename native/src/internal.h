/* Internal declarations of libdistmem_cap.so. Nothing here is exported. */
#ifndef DISTMEM_CAP_INTERNAL_H
#define DISTMEM_CAP_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_min.h"
#include "distmem_cap.h"

#define DM_HIDDEN __attribute__((visibility("hidden")))
#define DM_EXPORT __attribute__((visibility("default")))

/* ---- configuration (config.c) ------------------------------------------------------------- */

/* Parses "SIZE" with an optional unit into *out. Returns a pointer past the size, or NULL. */
DM_HIDDEN const char *dm_parse_size(const char *s, uint64_t *out);
/* Parses a DISTMEM_CAP_BYTES spec into caps[DISTMEM_CAP_MAX_DEVICES] and *default_cap.
 * Returns 0, or -1 with a message in err. */
DM_HIDDEN int dm_parse_spec(const char *spec, uint64_t *caps, uint64_t *default_cap, char *err,
                            size_t errlen);
DM_HIDDEN void dm_format_bytes(uint64_t n, char *buf, size_t len);
/* The largest cap or budget: what a signed 64-bit byte count holds (Python refuses more too). */
#define DM_CAP_MAX 9223372036854775807ULL

/* ---- accounting (account.c) ---------------------------------------------------------------- */

DM_HIDDEN void dm_init(void);                     /* idempotent; reads the environment once */
DM_HIDDEN void dm_account_after_fork(void);       /* the child of a fork starts with nothing counted */
DM_HIDDEN int dm_reserve(int dev, uint64_t bytes, const char *entry); /* 1: granted, 0: denied */
DM_HIDDEN void dm_unreserve(int dev, uint64_t bytes); /* undo a grant whose allocation failed */
DM_HIDDEN void dm_note_allocation(int dev);
DM_HIDDEN void dm_freed(int dev, uint64_t bytes);
DM_HIDDEN uint64_t dm_cap(int dev);
DM_HIDDEN uint64_t dm_used(int dev);
DM_HIDDEN int dm_dev_index(int dev);             /* clamps a device ordinal into the table */

/* GPU-wide budget (shared.c): configured once from the environment; 1 granted, 0 denied. On a
 * denial *why is NULL when the budget is used up, else what keeps it from being enforced. */
DM_HIDDEN void dm_shared_configure(const char *spec, const char *dir, const char *group);
DM_HIDDEN int dm_shared_reserve(int dev, uint64_t bytes, uint64_t *all_used, uint64_t *budget, const char **why);
DM_HIDDEN void dm_shared_release(int dev, uint64_t bytes);

/* ptr/handle -> (size, device) tables; thread safe */
enum { DM_TABLE_PTR = 0, DM_TABLE_HANDLE = 1 };
DM_HIDDEN void dm_table_insert(int table, uint64_t key, uint64_t size, int dev);
DM_HIDDEN int dm_table_remove(int table, uint64_t key, uint64_t *size, int *dev);

DM_HIDDEN extern _Atomic uint64_t dm_dlsym_lookups;
DM_HIDDEN extern _Atomic uint64_t dm_procaddr_lookups;
DM_HIDDEN extern _Atomic uint64_t dm_wrapped_calls;
DM_HIDDEN extern int dm_verbose;

/* ---- entry points (wrappers.c, hook.c) ------------------------------------------------------ */

enum dm_slot {
    DM_GET_PROC_ADDRESS,
    DM_GET_PROC_ADDRESS_V2,
    DM_MEM_ALLOC,
    DM_MEM_FREE,
    DM_MEM_GET_INFO,
    DM_MEM_ALLOC_PITCH,
    DM_MEM_ALLOC_MANAGED,
    DM_MEM_ALLOC_ASYNC,
    DM_MEM_ALLOC_ASYNC_PTSZ,
    DM_MEM_FREE_ASYNC,
    DM_MEM_FREE_ASYNC_PTSZ,
    DM_MEM_ALLOC_FROM_POOL_ASYNC,
    DM_MEM_ALLOC_FROM_POOL_ASYNC_PTSZ,
    DM_MEM_CREATE,
    DM_MEM_RELEASE,
    DM_SLOT_COUNT
};

typedef struct dm_slot_info {
    const char *exported;   /* name the driver exports (what dlsym asks for) */
    const char *base;       /* name cuGetProcAddress is asked for */
    int min_version;        /* cuGetProcAddress versions below this get the legacy entry: not wrapped */
    int per_thread;         /* 1: the _ptsz variant (per-thread default stream) */
    void *wrapper;          /* ours */
} dm_slot_info_t;

DM_HIDDEN extern const dm_slot_info_t dm_slots[DM_SLOT_COUNT];

DM_HIDDEN void *dm_real(int slot);              /* the driver's function; resolves lazily */
DM_HIDDEN void dm_set_real(int slot, void *fn); /* first one wins; never one of ours */
DM_HIDDEN int dm_slot_for_export(const char *name);
DM_HIDDEN int dm_slot_for_procaddr(const char *name, int version, cuuint64_t flags);
DM_HIDDEN int dm_is_wrapper(void *fn);
DM_HIDDEN void *dm_driver_symbol(const char *name); /* an unwrapped driver function, e.g. cuCtxGetDevice */

typedef void *(*dm_dlsym_fn)(void *, const char *);
DM_HIDDEN extern void *distmem_real_dlsym;
DM_HIDDEN void dm_ensure_real_dlsym(void);

#endif /* DISTMEM_CAP_INTERNAL_H */
