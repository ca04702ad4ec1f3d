/* How the wrappers reach programs, and how they find the driver's own functions.
 *
 * Three roads lead a program to a driver function, and each is covered:
 *   1. dlsym(handle, "cuMemAlloc_v2")                       XLA / TensorFlow stream executor
 *   2. dlsym(handle, "cuGetProcAddress"), then cuGetProcAddress("cuMemAlloc", 3020, ...)
 *                                                            the CUDA 12+ runtime, NCCL, cuBLAS
 *   3. a direct call through the PLT of a program linked against libcuda   the preload comes first
 * dlsym itself is ours (dlsym_x86_64.S, or the C fallback below): it hands out a wrapper for the
 * names in dm_slots and otherwise jumps to the C library's dlsym with the caller's return address
 * intact, so RTLD_NEXT and RTLD_DEFAULT keep meaning "relative to the caller".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void *distmem_real_dlsym;

static pthread_once_t real_dlsym_once = PTHREAD_ONCE_INIT;

static void find_real_dlsym(void) {
    /* GLIBC_2.34 where libdl moved into libc; the older names for older C libraries and other
     * architectures (2.2.5 x86_64, 2.17 aarch64/ppc64le, 2.27 riscv64). */
    static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.27", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
        void *p = dlvsym(RTLD_NEXT, "dlsym", versions[i]);
        if (p) {
            distmem_real_dlsym = p;
            return;
        }
    }
    fprintf(stderr,
            "distmem-cap: cannot find the C library's dlsym (tried dlvsym(RTLD_NEXT, \"dlsym\", GLIBC_2.34 "
            "and older)); this C library is not supported. Unset LD_PRELOAD=...libdistmem_cap.so to run "
            "without the cap.\n");
    abort();
}

void dm_ensure_real_dlsym(void) { pthread_once(&real_dlsym_once, find_real_dlsym); }

static inline void *real_dlsym(void *handle, const char *symbol) {
    return ((dm_dlsym_fn)distmem_real_dlsym)(handle, symbol);
}

/* ---- slots: which wrapper answers which name ------------------------------------------------ */

static _Atomic(void *) reals[DM_SLOT_COUNT];
static _Atomic(void *) cuda_lib;

int dm_is_wrapper(void *fn) {
    for (int i = 0; i < DM_SLOT_COUNT; i++)
        if (dm_slots[i].wrapper == fn) return 1;
    return 0;
}

void dm_set_real(int slot, void *fn) {
    if (!fn || dm_is_wrapper(fn)) return;
    void *expected = NULL;
    atomic_compare_exchange_strong(&reals[slot], &expected, fn);
}

int dm_slot_for_export(const char *name) {
    if (name[0] != 'c' || name[1] != 'u') return -1;
    for (int i = 0; i < DM_SLOT_COUNT; i++)
        if (strcmp(dm_slots[i].exported, name) == 0) return i;
    return -1;
}

int dm_slot_for_procaddr(const char *name, int version, cuuint64_t flags) {
    if (name[0] != 'c' || name[1] != 'u') return -1;
    if (strcmp(name, "cuGetProcAddress") == 0)
        return version >= 12000 ? DM_GET_PROC_ADDRESS_V2 : DM_GET_PROC_ADDRESS;
    int want_ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    int match = -1;
    for (int i = DM_GET_PROC_ADDRESS_V2 + 1; i < DM_SLOT_COUNT; i++) {
        if (strcmp(dm_slots[i].base, name) != 0) continue;
        /* Below 3020 cuMemAlloc & co. are the 32-bit legacy functions: a different signature. */
        if (version < dm_slots[i].min_version) return -1;
        if (dm_slots[i].per_thread == want_ptsz) return i;
        match = i;
    }
    return match >= 0 ? match : dm_slot_for_export(name);
}

/* A handle on the library the driver functions came from, held for the life of the process. */
static void *cuda_handle(void) {
    void *h = atomic_load(&cuda_lib);
    if (h) return h;
    for (int i = 0; i < DM_SLOT_COUNT && !h; i++) {
        void *p = atomic_load(&reals[i]);
        Dl_info info;
        if (p && dladdr(p, &info) && info.dli_fname) h = dlopen(info.dli_fname, RTLD_NOLOAD | RTLD_LAZY);
    }
    if (!h) h = dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY);
    if (!h) return NULL;
    void *expected = NULL;
    if (!atomic_compare_exchange_strong(&cuda_lib, &expected, h)) {
        dlclose(h);
        h = expected;
    }
    return h;
}

static void *lookup_driver(const char *exported, const char *base, int per_thread) {
    dm_ensure_real_dlsym();
    void *p = NULL;
    void *h = cuda_handle();
    if (h) p = real_dlsym(h, exported);
    if (!p || dm_is_wrapper(p)) p = real_dlsym(RTLD_NEXT, exported); /* next after this library */
    if (p && !dm_is_wrapper(p)) return p;
    /* Last: ask the driver itself, the way the runtime does. */
    cuGetProcAddress_v2_fn v2 = atomic_load(&reals[DM_GET_PROC_ADDRESS_V2]);
    cuGetProcAddress_fn v1 = atomic_load(&reals[DM_GET_PROC_ADDRESS]);
    cuuint64_t flags = per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
    p = NULL;
    int status = 0;
    if (v2 && v2(base, &p, 12000, flags, &status) != CUDA_SUCCESS) p = NULL;
    if (!p && v1 && v1(base, &p, 12000, flags) != CUDA_SUCCESS) p = NULL;
    return (p && !dm_is_wrapper(p)) ? p : NULL;
}

void *dm_real(int slot) {
    void *p = atomic_load_explicit(&reals[slot], memory_order_acquire);
    if (p) return p;
    p = lookup_driver(dm_slots[slot].exported, dm_slots[slot].base, dm_slots[slot].per_thread);
    if (!p) {
        if (dm_verbose)
            fprintf(stderr, "distmem-cap: the driver's %s is not loaded; is libcuda.so.1 reachable?\n",
                    dm_slots[slot].exported);
        return NULL;
    }
    dm_set_real(slot, p);
    return atomic_load(&reals[slot]);
}

void *dm_driver_symbol(const char *name) { return lookup_driver(name, name, 0); }

/* ---- dlsym ------------------------------------------------------------------------------------ */

/* Returns the wrapper to hand out for (handle, symbol), or NULL to let the C library answer. */
DM_HIDDEN void *distmem_dlsym_hook(void *handle, const char *symbol) {
    dm_ensure_real_dlsym();
    if (handle == RTLD_NEXT || !symbol || symbol[0] != 'c' || symbol[1] != 'u') return NULL;
    int slot = dm_slot_for_export(symbol);
    if (slot < 0) return NULL;
    void *p = real_dlsym(handle, symbol);
    if (!p) return NULL; /* the C library answers again, setting dlerror() for the caller */
    if (dm_is_wrapper(p))
        (void)dm_real(slot); /* found our own export (RTLD_DEFAULT): make sure the driver's is known */
    else
        dm_set_real(slot, p);
    atomic_fetch_add_explicit(&dm_dlsym_lookups, 1, memory_order_relaxed);
    return dm_slots[slot].wrapper;
}

#if !defined(__x86_64__) || defined(DISTMEM_CAP_C_DLSYM)
/* Elsewhere than x86-64 the pass-through relies on the compiler's sibling call (-O2) to keep the
 * caller's return address for RTLD_NEXT; tests/native checks that it does. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("O2", "optimize-sibling-calls", "omit-frame-pointer")))
#endif
DM_EXPORT void *dlsym(void *__restrict handle, const char *__restrict symbol) {
    void *r = distmem_dlsym_hook(handle, symbol);
    if (r) return r;
    return ((dm_dlsym_fn)distmem_real_dlsym)(handle, symbol); /* the sibling call */
}
#endif
