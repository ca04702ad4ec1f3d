/* Where the GPU-wide budget's table lives and how it is made, checked and locked.
 *
 * Per user by default: DISTMEM_CAP_SHM_DIR (default /dev/shm)/distmem-cap-u<uid>/, 0700, owned by
 * the user; with DISTMEM_CAP_SHM_GROUP=<gid>, distmem-cap-g<gid>/, group <gid>, 02770. A folder or
 * table is made under a temporary name with its final mode, group and (for a table) complete
 * header, then put in place without replacing anything (renameat2 RENAME_NOREPLACE, linkat), so
 * nobody sees one half made; whatever is found under the final names is checked (never followed
 * through a link; owner or group, mode, size, magic, version, UUID) before it is used, and a failed
 * check is an error, never a silent "no budget".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "table.h"

char dm_shm_dir[256] = "/dev/shm";
long dm_shm_group = -1;

/* Records why the table cannot be used (with the remedy) and returns -1. */
int dm_table_fail(dm_gpu_table_t *t, const char *fmt, ...) {
    char buf[sizeof t->why];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    memcpy(t->why, buf, sizeof buf);
    return -1;
}
#define WHY(...) dm_table_fail(t, __VA_ARGS__)

/* ---- the table's folder ------------------------------------------------------------------------ */

static int in_group(gid_t g) {
    if (getegid() == g) return 1;
    gid_t list[256];
    int n = getgroups(256, list);
    for (int i = 0; i < n; i++)
        if (list[i] == g) return 1;
    return 0;
}

static int check_dir(dm_gpu_table_t *t, int fd, const char *path) {
    struct stat st;
    if (fstat(fd, &st) != 0) return WHY("cannot stat %s: %s", path, strerror(errno));
    unsigned mode = st.st_mode & 07777;
    if (dm_shm_group < 0) {
        if (st.st_uid != geteuid())
            return WHY("%s belongs to uid %u, not to this user (uid %u): another user made it. Remove it, or set "
                       "DISTMEM_CAP_SHM_DIR to a folder only you can write (e.g. $XDG_RUNTIME_DIR)",
                       path, (unsigned)st.st_uid, (unsigned)geteuid());
        if (mode & 077)
            return WHY("%s has mode %04o: other users could change the table in it; remove it (it is made 0700)",
                       path, mode);
    } else {
        if (st.st_gid != (gid_t)dm_shm_group || (mode & 07) || (mode & 070) != 070)
            return WHY("%s has group %u and mode %04o, not group %ld and mode 2770 (DISTMEM_CAP_SHM_GROUP); remove it",
                       path, (unsigned)st.st_gid, mode, dm_shm_group);
    }
    return 0;
}

/* A folder made under a temporary name with its final mode and group, then renamed into place
 * without replacing anything: no process sees it half made. */
static void make_dir(int basefd, const char *name) {
    char tmp[128];
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    snprintf(tmp, sizeof tmp, ".%s.%d.%lx.tmp", name, (int)getpid(), (unsigned long)ts.tv_nsec);
    if (mkdirat(basefd, tmp, 0700) != 0) return;
    int fd = openat(basefd, tmp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int ok = fd >= 0;
    if (ok && dm_shm_group >= 0) ok = fchown(fd, (uid_t)-1, (gid_t)dm_shm_group) == 0 && fchmod(fd, 02770) == 0;
    else if (ok) ok = fchmod(fd, 0700) == 0;
    if (fd >= 0) close(fd);
    if (ok && syscall(SYS_renameat2, basefd, tmp, basefd, name, 1 /* RENAME_NOREPLACE */) == 0) return;
    int e = errno;
    unlinkat(basefd, tmp, AT_REMOVEDIR);
    if (ok && (e == EINVAL || e == ENOSYS) && mkdirat(basefd, name, 0700) == 0) { /* no renameat2 here */
        fd = openat(basefd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0) {
            if (dm_shm_group >= 0 && fchown(fd, (uid_t)-1, (gid_t)dm_shm_group) == 0) (void)fchmod(fd, 02770);
            else (void)fchmod(fd, 0700);
            close(fd);
        }
    }
}

int dm_table_open_dir(dm_gpu_table_t *t) {
    if (dm_shm_group >= 0 && !in_group((gid_t)dm_shm_group))
        return WHY("DISTMEM_CAP_SHM_GROUP=%ld names a group this process (uid %u) is not a member of", dm_shm_group,
                   (unsigned)geteuid());
    int basefd = open(dm_shm_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (basefd < 0) return WHY("cannot open DISTMEM_CAP_SHM_DIR=%s: %s", dm_shm_dir, strerror(errno));
    struct stat st;
    if (fstat(basefd, &st) != 0 || ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX))) {
        close(basefd);
        return WHY("%s is writable by every user and not sticky: anyone could replace the table's folder in it; "
                   "use /dev/shm or a folder only you can write", dm_shm_dir);
    }
    char name[48], path[400];
    if (dm_shm_group >= 0) snprintf(name, sizeof name, "distmem-cap-g%ld", dm_shm_group);
    else snprintf(name, sizeof name, "distmem-cap-u%u", (unsigned)geteuid());
    snprintf(path, sizeof path, "%s/%s", dm_shm_dir, name);
    for (int attempt = 0; attempt < 8; attempt++) {
        int fd = openat(basefd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0) {
            close(basefd);
            if (check_dir(t, fd, path) != 0) {
                close(fd);
                return -1;
            }
            t->dirfd = fd;
            return 0;
        }
        if (errno == ENOENT) {
            make_dir(basefd, name);
            continue;
        }
        int e = errno;
        close(basefd);
        if (e == ELOOP || e == ENOTDIR)
            return WHY("%s is not a folder (a link or a file someone else may have planted); remove it", path);
        return WHY("cannot open %s: %s", path, strerror(e));
    }
    close(basefd);
    return WHY("%s kept disappearing while it was being made", path);
}

/* ---- the table file ---------------------------------------------------------------------------- */

int dm_lock_byte(int fd, short type, off_t at) {
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = at, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

int dm_lock_held_elsewhere(int fd, off_t at) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = at, .l_len = 1};
    return fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
}

int dm_table_create(dm_gpu_table_t *t, const char *uuid) {
    char tmp[128];
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    snprintf(tmp, sizeof tmp, ".%s.%d.%lx.tmp", t->name, (int)getpid(), (unsigned long)ts.tv_nsec);
    mode_t mode = dm_shm_group >= 0 ? 0660 : 0600;
    int fd = openat(t->dirfd, tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0) return WHY("cannot create a table in the folder of DISTMEM_CAP_SHM_DIR=%s: %s", dm_shm_dir, strerror(errno));
    dm_shm_t head;
    memset(&head, 0, sizeof head);
    head.magic = DM_SHM_MAGIC;
    head.version = DM_SHM_VERSION;
    head.size = sizeof(dm_shm_t);
    head.slots = DM_SHM_SLOTS;
    head.slot_size = sizeof(dm_shm_slot_t);
    snprintf(head.uuid, sizeof head.uuid, "%s", uuid);
    int ok = fchmod(fd, mode) == 0 && (dm_shm_group < 0 || fchown(fd, (uid_t)-1, (gid_t)dm_shm_group) == 0) &&
             ftruncate(fd, sizeof(dm_shm_t)) == 0 &&
             pwrite(fd, &head, offsetof(dm_shm_t, slot), 0) == (ssize_t)offsetof(dm_shm_t, slot);
    int linked = ok ? linkat(t->dirfd, tmp, t->dirfd, t->name, 0) : -1;
    int e = errno;
    unlinkat(t->dirfd, tmp, 0);
    if (linked == 0) return fd;
    close(fd);
    if (ok && e == EEXIST) return -2;
    return WHY("cannot create the table %s/distmem-cap-*/%s: %s", dm_shm_dir, t->name, strerror(e));
}

int dm_table_check(dm_gpu_table_t *t, int fd, const char *uuid, dm_shm_t **out) {
    char path[480];
    if (dm_shm_group >= 0) snprintf(path, sizeof path, "%s/distmem-cap-g%ld/%s", dm_shm_dir, dm_shm_group, t->name);
    else snprintf(path, sizeof path, "%s/distmem-cap-u%u/%s", dm_shm_dir, (unsigned)geteuid(), t->name);
    struct stat st;
    if (fstat(fd, &st) != 0) return WHY("cannot stat %s: %s", path, strerror(errno));
    unsigned mode = st.st_mode & 07777;
    if (!S_ISREG(st.st_mode)) return WHY("%s is not a regular file; remove it", path);
    if (dm_shm_group < 0 && (st.st_uid != geteuid() || (mode & 077)))
        return WHY("%s has owner uid %u and mode %04o, not uid %u and 0600; remove it", path, (unsigned)st.st_uid,
                   mode, (unsigned)geteuid());
    if (dm_shm_group >= 0 && (st.st_gid != (gid_t)dm_shm_group || (mode & 07)))
        return WHY("%s has group %u and mode %04o, not group %ld and 0660; remove it", path, (unsigned)st.st_gid, mode,
                   dm_shm_group);
    if (st.st_size != (off_t)sizeof(dm_shm_t))
        return WHY("%s is %lld bytes, not the %zu of a distmem table (a table is complete before it gets this "
                   "name); remove it", path, (long long)st.st_size, sizeof(dm_shm_t));
    dm_shm_t *m = mmap(NULL, sizeof(dm_shm_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return WHY("cannot map %s: %s", path, strerror(errno));
    if (m->magic != DM_SHM_MAGIC || m->version != DM_SHM_VERSION || m->size != sizeof(dm_shm_t) ||
        m->slots != DM_SHM_SLOTS || m->slot_size != sizeof(dm_shm_slot_t) ||
        strncmp(m->uuid, uuid, sizeof m->uuid) != 0) {
        munmap(m, sizeof *m);
        return WHY("%s does not hold a distmem table of format %u for GPU %s; remove it", path, DM_SHM_VERSION, uuid);
    }
    *out = m;
    return 0;
}

int dm_table_same_file(int dirfd, const char *name, int fd) {
    struct stat a, b;
    return fstatat(dirfd, name, &a, AT_SYMLINK_NOFOLLOW) == 0 && fstat(fd, &b) == 0 && a.st_dev == b.st_dev &&
           a.st_ino == b.st_ino;
}

