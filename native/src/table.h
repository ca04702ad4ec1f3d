/* The GPU-wide budget's table: its layout, where it lives and how it is made, checked and locked
 * (table.c). Reserving against it is shared.c's. Nothing here is exported. */
#ifndef DISTMEM_CAP_TABLE_H
#define DISTMEM_CAP_TABLE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "internal.h"

#define DM_SHM_MAGIC 0x32706364u /* "dcp2" */
#define DM_SHM_VERSION 2u
#define DM_SHM_SLOTS 512
#define DM_LOCK_INUSE 0 /* byte 0: read-locked by every user of the table */
#define DM_LOCK_SLOT(i) ((off_t)(i) + 1)

typedef struct dm_shm_slot {
    _Atomic uint64_t used; /* bytes held by the slot's owner; written only by the holder of its lock */
    _Atomic int32_t pid;   /* for messages and status only: never trusted */
    _Atomic uint32_t uid;
} dm_shm_slot_t;

typedef struct dm_shm {
    uint32_t magic;
    uint32_t version;
    uint64_t size;
    uint32_t slots;
    uint32_t slot_size;
    _Atomic uint32_t hwm; /* slots at or above this index have never been claimed */
    uint32_t pad0;
    char uuid[40];
    unsigned char pad[56];
    dm_shm_slot_t slot[DM_SHM_SLOTS];
} dm_shm_t;

_Static_assert(offsetof(dm_shm_t, slot) == 128, "table header is 128 bytes");
_Static_assert(sizeof(dm_shm_slot_t) == 16, "slots are 16 bytes");

/* One GPU's table as this process holds it. */
typedef struct dm_gpu_table {
    dm_shm_t *map;
    int fd;
    int dirfd;
    int slot;
    char name[64];
    char why[640]; /* what keeps the table from being used, with the remedy */
} dm_gpu_table_t;

/* Where tables live: DISTMEM_CAP_SHM_DIR, and DISTMEM_CAP_SHM_GROUP (-1: per user). */
DM_HIDDEN extern char dm_shm_dir[256];
DM_HIDDEN extern long dm_shm_group;

/* Each returns 0, or -1 with t->why set. */
DM_HIDDEN int dm_table_fail(dm_gpu_table_t *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
DM_HIDDEN int dm_table_open_dir(dm_gpu_table_t *t);                 /* sets t->dirfd */
DM_HIDDEN int dm_table_check(dm_gpu_table_t *t, int fd, const char *uuid, dm_shm_t **out);
/* The complete table linked in under t->name: its fd, -2 when another process linked one first. */
DM_HIDDEN int dm_table_create(dm_gpu_table_t *t, const char *uuid);
DM_HIDDEN int dm_table_same_file(int dirfd, const char *name, int fd); /* the name still names fd */

/* Open-file-description locks on one byte: 0 or -1 (held elsewhere); never waits. */
DM_HIDDEN int dm_lock_byte(int fd, short type, off_t at);
DM_HIDDEN int dm_lock_held_elsewhere(int fd, off_t at);

#endif /* DISTMEM_CAP_TABLE_H */
