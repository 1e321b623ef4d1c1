/*
 * slowsync.c: an LD_PRELOAD shim that makes every fsync() and fdatasync() of the process it is
 * loaded into take SLOWSYNC_US microseconds longer (default 3000), as a gateway's SD card or
 * eMMC would, where a sync costs milliseconds rather than this host's fraction of one. The
 * real call is made first; the delay follows it, so what reaches the disk is unchanged.
 *
 *   cc -shared -fPIC -O2 -o /tmp/slowsync.so crates/edge-bench/scripts/slowsync.c -ldl
 *   crates/edge-bench/scripts/env_build_dir.sh /tmp/slow uploader LD_PRELOAD=/tmp/slowsync.so
 *
 * For the benchmark's A/Bs only (ab.sh): never for a test, which must not depend on timing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

static long delay_us(void) {
    static long us = -1;
    if (us < 0) {
        const char *v = getenv("SLOWSYNC_US");
        us = v ? atol(v) : 3000;
        if (us < 0) us = 0;
    }
    return us;
}

static void pause_after_sync(void) {
    long us = delay_us();
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    int r = real(fd);
    pause_after_sync();
    return r;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int r = real(fd);
    pause_after_sync();
    return r;
}
