/*
 * powercut.c: an LD_PRELOAD shim that keeps a "durable image" of one directory: what a power
 * cut would leave of it if the disk kept exactly the writes that were fsynced and nothing else.
 *
 * Loaded into the real edge-uploader by tests/system/power_cut.rs. Configuration (environment):
 *   POWERCUT_DIR    the directory watched (absolute, no trailing slash): the spool's directory
 *   POWERCUT_IMAGE  where the durable image is kept (absolute, created by the test)
 *   POWERCUT_DIRSYNCS  optional: a file to which the path of every directory fsynced anywhere
 *                   is appended, one per line (whether created directories' names were synced
 *                   is checked from it; the image models one flat directory only)
 *
 * What is modelled (the POSIX contract, nothing more generous):
 *   - A regular file directly in POWERCUT_DIR has durable *content* only as of its last
 *     fsync()/fdatasync(): at that call, the shim copies the whole file as it is then into
 *     <image>/ino/<inode> (through a temporary file and rename, so the image itself is never
 *     torn by a SIGKILL during the copy). Writes, truncations and mmap stores that no fsync
 *     followed are never copied: they are lost at a power cut. Nothing is read from write()
 *     calls, so every way of writing (write, pwrite, writev, mmap, ftruncate) is covered.
 *   - A *name* in POWERCUT_DIR is durable only as of the last fsync() of the directory itself:
 *     then the shim records the directory's current list of (name, inode) for regular files in
 *     <image>/dir. Creations, renames and unlinks that no directory fsync followed are lost.
 *   - The test assembles the post-cut directory from <image>/dir: each durable name gets the
 *     durable content of its inode, or an empty file when that inode was never fsynced.
 *
 * Not modelled: a disk that keeps *more* than was fsynced (any subset of later writes, torn
 * sectors). Keeping exactly the synced state is the harshest outcome for durability of
 * acknowledged data, which is what the test is about; torn pages are SQLite's own business
 * (its WAL frames carry checksums) and are covered by the corruption tests of the spool.
 *
 * The copy happens *before* the real fsync is called: if the process is killed during the
 * copy, the fsync had not returned, so nobody relied on it, and the image keeps the previous
 * version.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int (*real_fsync)(int);
static int (*real_fdatasync)(int);

static void resolve(void) {
    if (!real_fsync) real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    if (!real_fdatasync) real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
}

/* Aborts loudly: a shim that silently fails to record would make the test pass for nothing. */
static void die(const char *what, const char *path) {
    fprintf(stderr, "powercut shim: %s %s: %s\n", what, path ? path : "", strerror(errno));
    abort();
}

static int write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Copies the current content of `fd`'s file (a regular file of inode `ino`) into the image. */
static void save_content(int fd, const char *image, ino_t ino) {
    char tmp[PATH_MAX], dst[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s/ino/%llu.tmp", image, (unsigned long long)ino);
    snprintf(dst, sizeof dst, "%s/ino/%llu", image, (unsigned long long)ino);
    /* Read through a fresh descriptor: the caller's may be write-only. */
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
    int in = open(self, O_RDONLY | O_CLOEXEC);
    if (in < 0) die("reopen for reading", self);
    int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) die("open", tmp);
    static char buf[1 << 16];
    off_t off = 0;
    for (;;) {
        ssize_t n = pread(in, buf, sizeof buf, off);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("pread from a synced file for", dst);
        }
        if (n == 0) break;
        if (write_all(out, buf, (size_t)n) < 0) die("write", tmp);
        off += n;
    }
    close(in);
    if (close(out) < 0) die("close", tmp);
    if (rename(tmp, dst) < 0) die("rename", dst);
}

/* Records the directory's regular files as (inode, name) lines. */
static void save_dir(const char *dir, const char *image) {
    char tmp[PATH_MAX], dst[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s/dir.tmp", image);
    snprintf(dst, sizeof dst, "%s/dir", image);
    FILE *out = fopen(tmp, "we");
    if (!out) die("fopen", tmp);
    DIR *d = opendir(dir);
    if (!d) die("opendir", dir);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.' && (e->d_name[1] == 0 || (e->d_name[1] == '.' && e->d_name[2] == 0))) continue;
        struct stat st;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue; /* raced with an unlink */
        if (!S_ISREG(st.st_mode)) continue;
        fprintf(out, "%llu %s\n", (unsigned long long)st.st_ino, e->d_name);
    }
    closedir(d);
    if (fclose(out) != 0) die("fclose", tmp);
    if (rename(tmp, dst) < 0) die("rename", dst);
}

/* Appends a synced directory's path to POWERCUT_DIRSYNCS, when set. */
static void log_dirsync(const char *path) {
    const char *log = getenv("POWERCUT_DIRSYNCS");
    if (!log) return;
    int out = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (out < 0) die("open", log);
    char line[PATH_MAX + 1];
    int n = snprintf(line, sizeof line, "%s\n", path);
    if (n < 0 || (size_t)n >= sizeof line || write_all(out, line, (size_t)n) < 0) die("write", log);
    close(out);
}

/* Called before every fsync/fdatasync: records what that call makes durable, if it concerns
 * the watched directory. */
static void before_sync(int fd) {
    int saved_errno = errno;
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    struct stat st;
    if (n < 0 || fstat(fd, &st) < 0) {
        errno = saved_errno;
        return;
    }
    path[n] = 0;
    const char *dir = getenv("POWERCUT_DIR");
    const char *image = getenv("POWERCUT_IMAGE");
    size_t dl = dir ? strlen(dir) : 0;
    pthread_mutex_lock(&lock);
    if (S_ISDIR(st.st_mode)) log_dirsync(path);
    if (dir && image) {
        if (S_ISDIR(st.st_mode) && strcmp(path, dir) == 0) {
            save_dir(dir, image);
        } else if (S_ISREG(st.st_mode) && strncmp(path, dir, dl) == 0 && path[dl] == '/' && !strchr(path + dl + 1, '/')) {
            save_content(fd, image, st.st_ino);
        }
    }
    pthread_mutex_unlock(&lock);
    errno = saved_errno;
}

int fsync(int fd) {
    resolve();
    before_sync(fd);
    return real_fsync(fd);
}

int fdatasync(int fd) {
    resolve();
    before_sync(fd);
    return real_fdatasync(fd);
}
