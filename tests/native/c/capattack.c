/* The other local user of tests/native/test_cap_security.py: it does to every GPU-budget table it
 * can reach what an attacker on a shared node would. It links nothing of the cap and runs as a
 * different Unix user from the victims.
 *
 *   capattack reach DIR                 list the files under DIR it can open for writing
 *   capattack hold DIR READY SECONDS    hold every reachable table's lock(s), touch READY, sleep
 *   capattack fill|zero|poison DIR      rewrite every reachable table's slots
 *   capattack truncate DIR              cut every reachable table to 0 bytes
 *
 * "Every reachable table" is every regular file under DIR (recursively) that opens O_RDWR. Two
 * layouts are known: format 1 (the table of distmem before its per-user tables: a process-shared
 * pthread mutex at offset 16 and 512 slots of {pid, pad, start, used} at offset 104) and, for any
 * other file, only the layout-free attacks (byte-range locks over the whole file, truncation).
 * Prints one JSON line: {"op": ..., "reached": N, "paths": [...]}.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define V1_MAGIC 0x64636170u
#define V1_MUTEX 16
#define V1_SLOTS 104
#define V1_NSLOTS 512
#define V1_SLOT_SIZE 24
#define V1_SIZE (V1_SLOTS + V1_NSLOTS * V1_SLOT_SIZE)

#define MAXFILES 64
static char paths[MAXFILES][512];
static int fds[MAXFILES];
static int nfiles;

static void walk(const char *dir, int depth) {
    DIR *d = opendir(dir);
    if (!d || depth > 4) {
        if (d) closedir(d);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d)) && nfiles < MAXFILES) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[512];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(p, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            walk(p, depth + 1);
        } else if (S_ISREG(st.st_mode)) {
            int fd = open(p, O_RDWR | O_CLOEXEC);
            if (fd < 0) continue;
            snprintf(paths[nfiles], sizeof paths[nfiles], "%s", p);
            fds[nfiles++] = fd;
        }
    }
    closedir(d);
}

static void report(const char *op) {
    printf("{\"op\":\"%s\",\"reached\":%d,\"paths\":[", op, nfiles);
    for (int i = 0; i < nfiles; i++) printf("%s\"%s\"", i ? "," : "", paths[i]);
    printf("]}\n");
    fflush(stdout);
}

static unsigned char *map_v1(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < V1_SIZE) return NULL;
    unsigned char *m = mmap(NULL, V1_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return NULL;
    if (*(uint32_t *)m != V1_MAGIC) {
        munmap(m, V1_SIZE);
        return NULL;
    }
    return m;
}

static void set_slot(unsigned char *m, int i, int32_t pid, uint64_t start, uint64_t used) {
    unsigned char *s = m + V1_SLOTS + (size_t)i * V1_SLOT_SIZE;
    memcpy(s, &pid, 4);
    memcpy(s + 8, &start, 8);
    memcpy(s + 16, &used, 8);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: capattack reach|hold|fill|zero|poison|truncate DIR ...\n");
        return 2;
    }
    const char *op = argv[1];
    walk(argv[2], 0);
    if (!strcmp(op, "reach")) {
        report(op);
        return 0;
    }
    if (!strcmp(op, "hold")) {
        if (argc < 5) return 2;
        for (int i = 0; i < nfiles; i++) {
            /* every byte, to the end of any file: blocks every byte-range lock the victims take */
            struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
            (void)fcntl(fds[i], F_OFD_SETLK, &fl);
            (void)flock(fds[i], LOCK_EX | LOCK_NB);
            unsigned char *m = map_v1(fds[i]);
            if (m) pthread_mutex_lock((pthread_mutex_t *)(m + V1_MUTEX)); /* held until we exit */
        }
        report(op);
        FILE *f = fopen(argv[3], "w");
        if (f) fclose(f);
        sleep((unsigned)atoi(argv[4]));
        return 0;
    }
    if (!strcmp(op, "truncate")) {
        for (int i = 0; i < nfiles; i++) (void)ftruncate(fds[i], 0);
        report(op);
        return 0;
    }
    for (int i = 0; i < nfiles; i++) {
        unsigned char *m = map_v1(fds[i]);
        if (!m) {
            /* unknown layout: scribble over it, the attack that needs no layout */
            struct stat st;
            if (fstat(fds[i], &st) == 0 && st.st_size > 0) {
                unsigned char *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[i], 0);
                if (p != MAP_FAILED) {
                    memset(p, !strcmp(op, "zero") ? 0 : 0xff, (size_t)st.st_size);
                    munmap(p, (size_t)st.st_size);
                }
            }
            continue;
        }
        for (int s = 0; s < V1_NSLOTS; s++) {
            int32_t pid;
            memcpy(&pid, m + V1_SLOTS + (size_t)s * V1_SLOT_SIZE, 4);
            if (!strcmp(op, "fill") && pid == 0) set_slot(m, s, 1, 0, 0); /* pid 1, start 0: "always alive" */
            if (!strcmp(op, "zero") && pid != 0) memset(m + V1_SLOTS + (size_t)s * V1_SLOT_SIZE + 16, 0, 8);
        }
        if (!strcmp(op, "poison")) {
            for (int s = 0; s < V1_NSLOTS; s++) {
                int32_t pid;
                memcpy(&pid, m + V1_SLOTS + (size_t)s * V1_SLOT_SIZE, 4);
                if (pid == 0) {
                    set_slot(m, s, 1, 0, UINT64_MAX / 2);
                    break;
                }
            }
        }
        munmap(m, V1_SIZE);
    }
    report(op);
    return 0;
}
