/* An interposer of its own: layer() adds 10 to the next definition, found with dlsym(RTLD_NEXT).
 * If the preloaded cap resolved RTLD_NEXT relative to itself instead of to this library, the
 * lookup would return this very function and recurse until the stack overflows. */
#define _GNU_SOURCE
#include <dlfcn.h>

static __thread int depth;

int layer(void) {
    int (*next)(void) = (int (*)(void))dlsym(RTLD_NEXT, "layer");
    if (!next) return -1;
    if (++depth > 3) { depth = 0; return -100; } /* recursion: the lookup came back to us */
    int r = 10 + next();
    depth = 0;
    return r;
}
