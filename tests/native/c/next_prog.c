/* Prints layer() (11 when RTLD_NEXT works) and whether dlsym still answers ordinary lookups. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

int layer(void);

int main(void) {
    void *p = dlsym(RTLD_DEFAULT, "printf");
    void *missing = dlsym(RTLD_DEFAULT, "no_such_symbol_anywhere");
    const char *err = dlerror();
    printf("{\"op\":\"next\",\"layer\":%d,\"printf_found\":%s,\"missing_null\":%s,\"dlerror_set\":%s}\n", layer(),
           p ? "true" : "false", missing ? "false" : "true", err ? "true" : "false");
    return 0;
}
