/*
 * slowsync.c: an LD_PRELOAD shim that makes every fsync() and fdatasync() of the process it is
 * loaded into take SLOWSYNC_US microseconds longer (default 3000), as a gateway's SD card or
 * eMMC would, where a sync costs milliseconds rather than this host's fraction of one. The
 * real call is made first; the delay follows it, so what reaches the disk is unchanged.
 * With SLOWSYNC_SERIAL=1 the syncs of the process are also made one at a time (a process-wide
 * lock held across the call and its delay), as a card without command queueing flushes one
 * request after the other: two syncs started together then end after twice the delay, not
 * once. With SLOWSYNC_SKIP=1 the real call is not made at all and the sync returns 0 at once
 * (plus SLOWSYNC_US, which then defaults to 0): the ceiling of any work on syncs, nothing
 * durable. Never for a run whose figures are reported as the daemons' own.
 *
 *   cc -shared -fPIC -O2 -o /tmp/slowsync.so crates/edge-bench/scripts/slowsync.c -ldl
 *   crates/edge-bench/scripts/env_build_dir.sh /tmp/slow uploader LD_PRELOAD=/tmp/slowsync.so
 *   crates/edge-bench/scripts/env_build_dir.sh /tmp/serial uploader LD_PRELOAD=/tmp/slowsync.so SLOWSYNC_SERIAL=1
 *   crates/edge-bench/scripts/env_build_dir.sh /tmp/nosync ingest LD_PRELOAD=/tmp/slowsync.so SLOWSYNC_SKIP=1
 *
 * For the benchmark's A/Bs only (ab.sh): never for a test, which must not depend on timing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

/* Whether the environment variable `name` is set to 1, read once into `*cache` (-1: unread). */
static int flag(const char *name, int *cache) {
    if (*cache < 0) {
        const char *v = getenv(name);
        *cache = v && v[0] == '1';
    }
    return *cache;
}

static int skip(void) {
    static int on = -1;
    return flag("SLOWSYNC_SKIP", &on);
}

static long delay_us(void) {
    static long us = -1;
    if (us < 0) {
        const char *v = getenv("SLOWSYNC_US");
        us = v ? atol(v) : (skip() ? 0 : 3000);
        if (us < 0) us = 0;
    }
    return us;
}

static pthread_mutex_t device = PTHREAD_MUTEX_INITIALIZER;

static int serial(void) {
    static int on = -1;
    return flag("SLOWSYNC_SERIAL", &on);
}

static void pause_after_sync(void) {
    long us = delay_us();
    if (us == 0) return;
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    int locked = serial() && pthread_mutex_lock(&device) == 0;
    int r = skip() ? 0 : real(fd);
    pause_after_sync();
    if (locked) pthread_mutex_unlock(&device);
    return r;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int locked = serial() && pthread_mutex_lock(&device) == 0;
    int r = skip() ? 0 : real(fd);
    pause_after_sync();
    if (locked) pthread_mutex_unlock(&device);
    return r;
}
