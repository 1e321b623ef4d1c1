/*
 * direct_writes.c: what a store's commit costs in CPU when its bytes go through the page cache
 * against when its whole blocks go past it with O_DIRECT, as the ingest's store writes them
 * (crates/edge-ingest/src/store/direct.rs). Appends TOTAL_MIB of commits, each PER entries of
 * a 100-byte header and an ENTRY-byte payload, to one file, with the store's 16 MiB
 * fallocate(FALLOC_FL_KEEP_SIZE) reservation ahead of the writes and one fdatasync per commit:
 *
 *   buffered: one pwritev of the commit, fdatasync, posix_fadvise(DONTNEED) of the committed
 *             pages (what the store did before);
 *   direct:   the commit copied into one 4 KiB-aligned 1 MiB buffer after the bytes the previous
 *             commit left in its last block, its whole blocks written with O_DIRECT, its partial
 *             last block with an ordinary pwrite, fdatasync.
 *
 * Prints the MB/s, the process's CPU-seconds per GiB (getrusage) and the whole machine's
 * (user + nice + system + irq + softirq from /proc/stat, which also counts the kernel's
 * writeback and completion work done outside the process); run it on an otherwise idle
 * machine, in the file system the store would use:
 *
 *   cc -O2 -o /tmp/direct_writes crates/edge-bench/scripts/direct_writes.c
 *   for per in 25 100; do for mode in buffered direct; do
 *       /tmp/direct_writes $mode 1024 $per 10240 /var/tmp/direct_writes.tmp; done; done
 *
 * For BENCHMARKS.md's reading of the store only: never for a test, which must not depend on
 * timing.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 4096L
#define CAPACITY (1L << 20)
#define RESERVE_STEP (16L << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static double cpu_self(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

/* Busy ticks of the whole machine: user, nice, system, irq, softirq (not idle, iowait, steal). */
static long long machine_busy(void) {
    long long v[8] = {0};
    FILE *f = fopen("/proc/stat", "r");
    if (!f || fscanf(f, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                     &v[6], &v[7]) != 8) {
        perror("/proc/stat");
        exit(1);
    }
    fclose(f);
    return v[0] + v[1] + v[2] + v[5] + v[6];
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void pwrite_all(int fd, const char *p, size_t n, off_t at, const char *what) {
    while (n > 0) {
        ssize_t w = pwrite(fd, p, n, at);
        if (w <= 0) die(what);
        p += w;
        n -= (size_t)w;
        at += w;
    }
}

int main(int argc, char **argv) {
    if (argc != 6 || (strcmp(argv[1], "buffered") && strcmp(argv[1], "direct"))) {
        fprintf(stderr, "usage: %s buffered|direct TOTAL_MIB PER ENTRY FILE\n", argv[0]);
        return 2;
    }
    int direct = !strcmp(argv[1], "direct");
    long total = atol(argv[2]) << 20;
    int per = atoi(argv[3]);
    long entry = atol(argv[4]);
    const char *path = argv[5];
    if (total <= 0 || per <= 0 || entry <= 0) {
        fprintf(stderr, "TOTAL_MIB, PER and ENTRY must be positive\n");
        return 2;
    }
    long commit = per * (entry + 100);

    unlink(path);
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0644);
    if (fd < 0) die("open");
    int dfd = direct ? open(path, O_WRONLY | O_DIRECT) : -1;
    if (direct && dfd < 0) die("open O_DIRECT");

    char header[100], *payload = malloc(entry), *buf = NULL;
    struct iovec *iov = malloc(sizeof(struct iovec) * 2 * per);
    if (!payload || !iov || posix_memalign((void **)&buf, BLOCK, CAPACITY)) die("malloc");
    memset(header, 1, sizeof header);
    memset(payload, 7, entry);

    long off = 0, reserved = 0;
    double t0 = now(), c0 = cpu_self();
    long long m0 = machine_busy();
    while (off < total) {
        if (off + commit > reserved) {
            long to = off + commit + RESERVE_STEP;
            if (fallocate(fd, FALLOC_FL_KEEP_SIZE, reserved, to - reserved)) die("fallocate");
            reserved = to;
        }
        if (!direct) {
            for (int i = 0; i < per; i++) {
                iov[2 * i] = (struct iovec){header, sizeof header};
                iov[2 * i + 1] = (struct iovec){payload, (size_t)entry};
            }
            ssize_t w = pwritev(fd, iov, 2 * per, off);
            if (w != commit) die("pwritev (or a short write)");
            if (fdatasync(fd)) die("fdatasync");
            long from = off - off % BLOCK;
            posix_fadvise(fd, from, commit + (off - from), POSIX_FADV_DONTNEED);
        } else {
            long block_start = off - off % BLOCK, pos = block_start;
            long fill = off - block_start; /* the previous commit's partial block, kept in buf */
            for (int i = 0; i < per; i++) {
                const char *parts[2] = {header, payload};
                long lens[2] = {sizeof header, entry};
                for (int k = 0; k < 2; k++) {
                    const char *p = parts[k];
                    long rest = lens[k];
                    while (rest > 0) {
                        long n = rest < CAPACITY - fill ? rest : CAPACITY - fill;
                        memcpy(buf + fill, p, n);
                        fill += n;
                        p += n;
                        rest -= n;
                        if (fill == CAPACITY) {
                            pwrite_all(dfd, buf, CAPACITY, pos, "pwrite O_DIRECT");
                            pos += CAPACITY;
                            fill = 0;
                        }
                    }
                }
            }
            long whole = fill - fill % BLOCK;
            if (whole > 0) pwrite_all(dfd, buf, whole, pos, "pwrite O_DIRECT");
            if (fill > whole) {
                pwrite_all(fd, buf + whole, fill - whole, pos + whole, "pwrite tail");
                memmove(buf, buf + whole, fill - whole);
            }
            if (fdatasync(fd)) die("fdatasync");
        }
        off += commit;
    }
    double secs = now() - t0, cpu = cpu_self() - c0;
    double machine = (machine_busy() - m0) / (double)sysconf(_SC_CLK_TCK);
    double gib = off / (double)(1L << 30);
    printf("%-8s %5ld-byte commits: %6.0f MB/s, process %.3f CPU-s/GiB, machine %.3f CPU-s/GiB\n", argv[1], commit,
           off / secs / 1e6, cpu / gib, machine / gib);
    close(fd);
    if (dfd >= 0) close(dfd);
    unlink(path);
    return 0;
}
