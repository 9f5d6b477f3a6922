/* The disk's floor for a sequence of read batches: a native reader with no Python in the loop.
 *
 * bench/serve.py compiles this with gcc into a temporary directory at run time and hands it
 * the pages its cached run faulted, step by step. Each step's pages are read as one batch
 * (all of them in flight up to the queue depth, a barrier at the end of the step, as the
 * row cache's fault of that step must finish before the step can run), and the time of
 * every step is printed. Two engines:
 *   threads N : N threads of blocking pread (a persistent pool, two barriers per step);
 *   uring QD  : one io_uring through raw system calls (no liburing), QD reads in flight.
 *
 * usage: _floor MODE N JOBS READ_BYTES DIRECT FILE...
 *   JOBS is a binary file: int64 steps, then for each step int64 count followed by count
 *   pairs of int64 (file index, byte offset); offsets are page-aligned when DIRECT is 1.
 * output (stdout): one line per step, the step's nanoseconds; then "total_ns N".
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

static int *fds;
static int64_t nsteps, *counts, *starts, *jobs; /* jobs: pairs (file, offset) */
static long read_bytes;

static void die(const char *what) {
    fprintf(stderr, "_floor: %s: %s\n", what, strerror(errno));
    exit(2);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void *page_buffer(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 4096, n ? n : 4096)) die("posix_memalign");
    return p;
}

/* ---- threads of blocking pread ------------------------------------------------------- */
static pthread_barrier_t bar;
static int64_t cur_step, next_job;
static int stop_workers;

static void *worker(void *arg) {
    (void)arg;
    char *buf = page_buffer(read_bytes);
    for (;;) {
        pthread_barrier_wait(&bar); /* step start */
        if (__atomic_load_n(&stop_workers, __ATOMIC_ACQUIRE)) break;
        int64_t s = cur_step, n = counts[s];
        for (;;) {
            int64_t k = __atomic_fetch_add(&next_job, 1, __ATOMIC_RELAXED);
            if (k >= n) break;
            const int64_t *j = jobs + 2 * (starts[s] + k);
            if (pread(fds[j[0]], buf, read_bytes, j[1]) < 0) die("pread");
        }
        pthread_barrier_wait(&bar); /* step end */
    }
    free(buf);
    return NULL;
}

static void run_threads(int nthreads, int64_t *out) {
    pthread_t *ts = calloc(nthreads, sizeof *ts);
    pthread_barrier_init(&bar, NULL, nthreads + 1);
    for (int i = 0; i < nthreads; i++) pthread_create(&ts[i], NULL, worker, NULL);
    for (int64_t s = 0; s < nsteps; s++) {
        cur_step = s;
        next_job = 0;
        int64_t t0 = now_ns();
        pthread_barrier_wait(&bar);
        pthread_barrier_wait(&bar);
        out[s] = now_ns() - t0;
    }
    __atomic_store_n(&stop_workers, 1, __ATOMIC_RELEASE);
    pthread_barrier_wait(&bar);
    for (int i = 0; i < nthreads; i++) pthread_join(ts[i], NULL);
    free(ts);
}

/* ---- io_uring through raw system calls ------------------------------------------------ */
struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
};

static void ring_init(struct ring *r, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0) die("io_uring_setup");
    size_t sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    char *sq = mmap(0, sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                    IORING_OFF_SQ_RING);
    char *cq = mmap(0, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                    IORING_OFF_CQ_RING);
    r->sqes = mmap(0, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (sq == MAP_FAILED || cq == MAP_FAILED || r->sqes == MAP_FAILED) die("mmap io_uring");
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
}

static void run_uring(int qd, int64_t *out) {
    struct ring r;
    ring_init(&r, (unsigned)qd);
    char *bufs = page_buffer((size_t)qd * read_bytes);
    int *free_slots = malloc(qd * sizeof(int));
    for (int64_t s = 0; s < nsteps; s++) {
        int64_t n = counts[s], issued = 0, done = 0;
        int nfree = qd;
        for (int i = 0; i < qd; i++) free_slots[i] = i;
        int64_t t0 = now_ns();
        while (done < n) {
            unsigned tail = *r.sq_tail, added = 0;
            while (issued < n && nfree > 0) {
                const int64_t *j = jobs + 2 * (starts[s] + issued);
                int slot = free_slots[--nfree];
                unsigned idx = (tail + added) & *r.sq_mask;
                struct io_uring_sqe *e = &r.sqes[idx];
                memset(e, 0, sizeof *e);
                e->opcode = IORING_OP_READ;
                e->fd = fds[j[0]];
                e->off = (uint64_t)j[1];
                e->addr = (uint64_t)(uintptr_t)(bufs + (size_t)slot * read_bytes);
                e->len = (unsigned)read_bytes;
                e->user_data = (uint64_t)slot;
                r.sq_array[idx] = idx;
                added++;
                issued++;
            }
            if (added) __atomic_store_n(r.sq_tail, tail + added, __ATOMIC_RELEASE);
            if (syscall(__NR_io_uring_enter, r.fd, added, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0)
                die("io_uring_enter");
            unsigned head = *r.cq_head;
            while (head != __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE)) {
                struct io_uring_cqe *c = &r.cqes[head & *r.cq_mask];
                if (c->res < 0) {
                    errno = -c->res;
                    die("io_uring read");
                }
                free_slots[nfree++] = (int)c->user_data;
                head++;
                done++;
            }
            __atomic_store_n(r.cq_head, head, __ATOMIC_RELEASE);
        }
        out[s] = now_ns() - t0;
    }
    free(free_slots);
    free(bufs);
    close(r.fd);
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s threads|uring N JOBS READ_BYTES DIRECT FILE...\n", argv[0]);
        return 1;
    }
    const char *mode = argv[1];
    int n = atoi(argv[2]);
    read_bytes = atol(argv[4]);
    int direct = atoi(argv[5]);
    if (n < 1 || read_bytes < 1) {
        fprintf(stderr, "_floor: N and READ_BYTES must be >= 1\n");
        return 1;
    }
    int nfiles = argc - 6;
    fds = malloc(nfiles * sizeof(int));
    for (int i = 0; i < nfiles; i++) {
        fds[i] = open(argv[6 + i], O_RDONLY | (direct ? O_DIRECT : 0));
        if (fds[i] < 0) die(argv[6 + i]);
    }
    FILE *f = fopen(argv[3], "rb");
    if (!f) die(argv[3]);
    if (fread(&nsteps, 8, 1, f) != 1 || nsteps < 0) die("jobs header");
    counts = malloc((nsteps + 1) * 8);
    starts = malloc((nsteps + 1) * 8);
    size_t cap = 1024, used = 0;
    jobs = malloc(cap * 16);
    for (int64_t s = 0; s < nsteps; s++) {
        if (fread(&counts[s], 8, 1, f) != 1 || counts[s] < 0) die("jobs count");
        starts[s] = (int64_t)used;
        while (used + counts[s] > cap) {
            cap *= 2;
            jobs = realloc(jobs, cap * 16);
        }
        if ((int64_t)fread(jobs + 2 * used, 16, counts[s], f) != counts[s]) die("jobs body");
        for (int64_t k = 0; k < counts[s]; k++)
            if (jobs[2 * (used + k)] < 0 || jobs[2 * (used + k)] >= nfiles) {
                fprintf(stderr, "_floor: job file index out of range\n");
                return 1;
            }
        used += counts[s];
    }
    fclose(f);
    int64_t *out = calloc(nsteps + 1, 8);
    if (!strcmp(mode, "threads"))
        run_threads(n, out);
    else if (!strcmp(mode, "uring"))
        run_uring(n, out);
    else {
        fprintf(stderr, "_floor: mode %s: allowed threads, uring\n", mode);
        return 1;
    }
    int64_t total = 0;
    for (int64_t s = 0; s < nsteps; s++) {
        printf("%lld\n", (long long)out[s]);
        total += out[s];
    }
    printf("total_ns %lld\n", (long long)total);
    return 0;
}
