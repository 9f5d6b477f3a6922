/* csrc/rcio_status.h: what a batch of rowcache.io._rcio's Reader did, shared with Python.
 *
 * The status of a batch (read_runs, read_runs_join) and the fields of its result, a
 * struct sequence `_rcio.BatchResult` (rowcache.io.native.ReadStatus and its reading of
 * the fields; the module exports the statuses as READ_OK .. READ_BAD_ROW, and
 * tests/io/test_rcio_boundaries.py checks that the two agree).
 */
#ifndef ROWCACHE_RCIO_STATUS_H
#define ROWCACHE_RCIO_STATUS_H

enum {
    RC_READ_OK = 0,       /* every row read, every page checked, the records cut */
    RC_READ_FAILED = 1,   /* a read failed or was short (at, file, offset, got, want, code) */
    RC_READ_BAD_PAGE = 2, /* a page's CRC32C differs from the store's (at, file, offset, got, want, code) */
    RC_READ_NOT_OPEN = 3, /* file is not open: nothing read (the caller opens it, or raises) */
    RC_READ_BAD_ROW = 4,  /* rows[at] - its base is outside its table (row) */
};

/* The fields of a batch's result, in order (int64 each). */
enum {
    RC_B_STATUS, /* RC_READ_* */
    RC_B_READS,  /* read ops of the plan (RC_READ_FAILED: the reads that failed, in all) */
    RC_B_NBYTES, /* bytes of the plan's extents */
    RC_B_AT,     /* FAILED, BAD_PAGE: the extent; BAD_ROW: the row's index in rows */
    RC_B_FILE,   /* FAILED, BAD_PAGE, NOT_OPEN: the file's index in the layout */
    RC_B_OFFSET, /* FAILED: the extent's file offset; BAD_PAGE: the page's */
    RC_B_GOT,    /* FAILED: bytes read of the extent; BAD_PAGE: the page's CRC32C as read */
    RC_B_WANT,   /* FAILED: bytes it needed; BAD_PAGE: the CRC32C the store holds */
    RC_B_CODE,   /* FAILED: errno, or -1 short; BAD_PAGE: the bad pages, in all */
    RC_B_ROW,    /* BAD_ROW: the row (of its table) */
    RC_B_N
};

#endif
