/* The disk's floor for bench/fault.py: steps of positional reads issued with no Python.
 *
 * Usage: floor MODE N [direct|buffered] [GAP_US] < plan
 *   MODE threads: N persistent threads of blocking pread, a barrier after each step;
 *   MODE uring:   one io_uring (raw system calls), N reads in flight.
 *   GAP_US: the process sleeps this long before each step (a server's faults come after
 *   the rest of its step, not back to back); default 0.
 * plan (text): nfiles, then one path a line; nsteps, then per step: nreads and
 * nreads lines "file offset length". Prints one line per step: microseconds.
 * Build: gcc -O2 -pthread floor.c -o floor
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct { int fd; long long off, len; } rd_t;
static rd_t *R;
static long n_reads;
static char *bufs;
static long bufsz;
static int nthr;
static pthread_barrier_t bar;
static volatile long cur_n, next_i;
static volatile int quit;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void die(const char *what) { perror(what); exit(1); }

static void *worker(void *arg) {
    char *buf = bufs + (long)(intptr_t)arg * bufsz;
    for (;;) {
        pthread_barrier_wait(&bar);
        if (quit) return NULL;
        long i;
        while ((i = __atomic_fetch_add(&next_i, 1, __ATOMIC_RELAXED)) < cur_n)
            if (pread(R[i].fd, buf, R[i].len, R[i].off) < 0) die("pread");
        pthread_barrier_wait(&bar);
    }
}

struct ring {
    int fd;
    unsigned *sh, *st, *sm, *sa, *ch, *ct, *cm;
    struct io_uring_sqe *sqe;
    struct io_uring_cqe *cqe;
};

static void ring_open(struct ring *r, unsigned qd) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r->fd = syscall(__NR_io_uring_setup, qd, &p);
    if (r->fd < 0) die("io_uring_setup");
    size_t ssz = p.sq_off.array + p.sq_entries * 4, csz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (csz > ssz) ssz = csz;
    char *q = mmap(0, ssz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    r->sqe = mmap(0, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (q == MAP_FAILED || r->sqe == MAP_FAILED || !(p.features & IORING_FEAT_SINGLE_MMAP)) die("mmap ring");
    r->sh = (unsigned *)(q + p.sq_off.head); r->st = (unsigned *)(q + p.sq_off.tail);
    r->sm = (unsigned *)(q + p.sq_off.ring_mask); r->sa = (unsigned *)(q + p.sq_off.array);
    r->ch = (unsigned *)(q + p.cq_off.head); r->ct = (unsigned *)(q + p.cq_off.tail);
    r->cm = (unsigned *)(q + p.cq_off.ring_mask); r->cqe = (struct io_uring_cqe *)(q + p.cq_off.cqes);
}

static void ring_step(struct ring *r, rd_t *rd, long n, int qd) {
    long next = 0, done = 0;
    int inflight = 0;
    while (done < n) {
        unsigned tail = *r->st;
        while (inflight < qd && next < n) {
            unsigned idx = tail & *r->sm;
            struct io_uring_sqe *s = &r->sqe[idx];
            memset(s, 0, sizeof *s);
            s->opcode = IORING_OP_READ;
            s->fd = rd[next].fd;
            s->off = rd[next].off;
            s->addr = (uint64_t)(uintptr_t)(bufs + (next % qd) * bufsz); /* data is discarded */
            s->len = rd[next].len;
            r->sa[idx] = idx;
            tail++, next++, inflight++;
        }
        __atomic_store_n(r->st, tail, __ATOMIC_RELEASE);
        unsigned pend = tail - __atomic_load_n(r->sh, __ATOMIC_ACQUIRE);
        if (syscall(__NR_io_uring_enter, r->fd, pend, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0 && errno != EINTR)
            die("io_uring_enter");
        unsigned h = *r->ch, t = __atomic_load_n(r->ct, __ATOMIC_ACQUIRE);
        for (; h != t; h++, done++, inflight--)
            if (r->cqe[h & *r->cm].res < 0) { errno = -r->cqe[h & *r->cm].res; die("read"); }
        __atomic_store_n(r->ch, h, __ATOMIC_RELEASE);
    }
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: floor threads|uring N [direct|buffered] [gap_us: < 0 spins] < plan\n"); return 2; }
    int uring = !strcmp(argv[1], "uring"), n = atoi(argv[2]);
    int direct = argc < 4 || strcmp(argv[3], "buffered");
    long gap_us = argc < 5 ? 0 : atol(argv[4]);
    int nf, ns;
    if (scanf("%d", &nf) != 1) die("plan");
    int *fds = calloc(nf, sizeof(int));
    char path[4096];
    for (int i = 0; i < nf; i++) {
        if (scanf("%4095s", path) != 1) die("plan");
        fds[i] = open(path, O_RDONLY | (direct ? O_DIRECT : 0));
        if (fds[i] < 0) die(path);
    }
    if (scanf("%d", &ns) != 1) die("plan");
    long *start = calloc(ns + 1, sizeof(long)), cap = 1024;
    R = malloc(cap * sizeof(rd_t));
    long maxlen = 4096;
    for (int s = 0; s < ns; s++) {
        long k;
        if (scanf("%ld", &k) != 1) die("plan");
        start[s] = n_reads;
        for (long j = 0; j < k; j++, n_reads++) {
            int f;
            if (n_reads == cap) R = realloc(R, (cap *= 2) * sizeof(rd_t));
            if (scanf("%d %lld %lld", &f, &R[n_reads].off, &R[n_reads].len) != 3) die("plan");
            R[n_reads].fd = fds[f];
            if (R[n_reads].len > maxlen) maxlen = R[n_reads].len;
        }
    }
    start[ns] = n_reads;
    bufsz = (maxlen + 4095) / 4096 * 4096;
    if (posix_memalign((void **)&bufs, 4096, (size_t)bufsz * n)) die("alloc");
    memset(bufs, 0, (size_t)bufsz * n);
    struct ring r = {0};
    pthread_t *th = NULL;
    if (uring) ring_open(&r, n);
    else {
        nthr = n;
        pthread_barrier_init(&bar, NULL, n + 1);
        th = calloc(n, sizeof(pthread_t));
        for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, worker, (void *)(intptr_t)i);
    }
    for (int s = 0; s < ns; s++) {
        if (gap_us > 0) {
            struct timespec g = {gap_us / 1000000, (gap_us % 1000000) * 1000};
            nanosleep(&g, NULL);
        } else if (gap_us < 0) { /* busy for -gap_us: idle disk, busy CPU */
            double until = now() - (double)gap_us;
            while (now() < until) {
            }
        }
        double t0 = now();
        if (uring) ring_step(&r, R + start[s], start[s + 1] - start[s], n);
        else {
            /* offset the step's reads: workers index R from the step's start */
            rd_t *save = R;
            R = save + start[s];
            cur_n = start[s + 1] - start[s];
            next_i = 0;
            pthread_barrier_wait(&bar);
            pthread_barrier_wait(&bar);
            R = save;
        }
        printf("%.2f\n", now() - t0);
    }
    if (!uring) {
        quit = 1;
        pthread_barrier_wait(&bar);
        for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    }
    return 0;
}
