/* rowcache.kernels._quantize (csrc/quantize.c): the store's FP8 rule on the CPU, written
 * straight into shard pages. One file: the module and its kernel.
 *
 * quantize_pages: per-row absmax E4M3 quantization of a block of rows (bf16 given as its
 *   uint16 bits, or float32), the rule of rowcache.kernels.reference.quantize_fp8_reference:
 *     scale = amax(|x|) / 448 (float32 division; 1.0 where it is 0: an all-zero row, or one
 *             so small the division underflows, amax <= 448 * 2^-150, whose codes are then
 *             signed zeros, never the NaN codes of x / 0)
 *     code  = satfinite_e4m3_rne(x / scale)        (float32 division, not x * (1/scale))
 *   Each record (dim codes, then the float32 scale, little-endian) goes to its place in the
 *   page layout of the store (rows_per_page records per page_bytes page), so the builder
 *   needs no further copy. Bit-exact with the reference for finite inputs: the divisions
 *   are IEEE float32 (SSE, subnormals kept: Python leaves MXCSR's FTZ/DAZ off, as NumPy
 *   needs), and the E4M3 rounding is done on the float's bits. Rows holding a NaN or an
 *   Inf are counted, not quantized: the caller refuses them or uses the reference.
 *   The GIL is released for the whole call, so threads over row blocks run in parallel.
 * Checked bit for bit against the reference by tests/kernels/test_quantize.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* All ones where c is true, else 0: selects without branches, so the loops vectorize. */
static inline uint32_t mask(int c) { return (uint32_t)0 - (uint32_t)c; }

/* satfinite E4M3 (fn) code of a float32, round to nearest even: normal codes round the
 * float's mantissa to 3 bits on its bits; subnormal codes (|q| < 2^-6) are rne(|q| * 512),
 * exact through an add of 2^23; magnitudes above 448 (Inf included) give 448, a NaN gives
 * the NaN code, as the reference (never reached: rows holding a NaN are skipped, and no
 * scale is 0, so x / scale is never 0/0). */
static inline uint8_t e4m3(float q) {
    const uint32_t b = f2u(q);
    const uint32_t sign = (b >> 24) & 0x80u;
    const uint32_t a0 = b & 0x7FFFFFFFu;
    const uint32_t a = a0 < 0x43E00000u ? a0 : 0x43E00000u; /* clip to 448 = 0x43E00000 */
    const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    const float s = (u2f(a) * 512.0f + 8388608.0f) - 8388608.0f; /* a whole number, 0..8 */
    const uint32_t sub = (uint32_t)(int32_t)s;
    const uint32_t m = mask(a >= 0x3C800000u); /* 2^-6: the smallest normal E4M3 */
    const uint32_t n = mask(a0 > 0x7F800000u);
    const uint32_t code = (((normal & m) | (sub & ~m)) & ~n) | (0x7Fu & n);
    return (uint8_t)(sign | code);
}

/* One row: returns 1 when it holds a NaN or an Inf (nothing written), else 0. */
__attribute__((target_clones("avx2", "default"))) static int row_bf16(const uint16_t *x,
                                                                      Py_ssize_t dim,
                                                                      uint8_t *rec) {
    uint32_t m = 0;
    for (Py_ssize_t j = 0; j < dim; j++) {
        const uint32_t v = x[j] & 0x7FFFu;
        m = v > m ? v : m;
    }
    if (m >= 0x7F80u) return 1;
    const float amax = u2f(m << 16);
    const float q = amax / 448.0f;
    const float scale = q == 0.0f ? 1.0f : q;
    for (Py_ssize_t j = 0; j < dim; j++) {
        rec[j] = e4m3(u2f((uint32_t)x[j] << 16) / scale);
    }
    memcpy(rec + dim, &scale, 4);
    return 0;
}

__attribute__((target_clones("avx2", "default"))) static int row_f32(const uint32_t *x,
                                                                     Py_ssize_t dim,
                                                                     uint8_t *rec) {
    uint32_t m = 0;
    for (Py_ssize_t j = 0; j < dim; j++) {
        const uint32_t v = x[j] & 0x7FFFFFFFu;
        m = v > m ? v : m;
    }
    if (m >= 0x7F800000u) return 1;
    const float amax = u2f(m);
    const float q = amax / 448.0f;
    const float scale = q == 0.0f ? 1.0f : q;
    for (Py_ssize_t j = 0; j < dim; j++) {
        rec[j] = e4m3(u2f(x[j]) / scale);
    }
    memcpy(rec + dim, &scale, 4);
    return 0;
}

/* quantize_pages(x, itemsize, rows, dim, out, first, rows_per_page, page_bytes) -> int
 *   x: C-contiguous rows (uint16 bf16 bits when itemsize is 2, float32 when 4), rows x dim
 *   out: the page buffer; x's row i is record (first + i) of it
 * Returns the number of rows skipped for holding a NaN or an Inf. */
static PyObject *quantize_pages(PyObject *self, PyObject *args) {
    PyObject *o_x, *o_out;
    Py_ssize_t itemsize, rows, dim, first, rpp, page_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnnnOnnn", &o_x, &itemsize, &rows, &dim, &o_out, &first, &rpp,
                          &page_bytes)) {
        return NULL;
    }
    if ((itemsize != 2 && itemsize != 4) || rows < 0 || dim < 1 || first < 0 || rpp < 1 ||
        page_bytes < 1 || dim > PY_SSIZE_T_MAX - 4) {
        PyErr_SetString(PyExc_ValueError, "quantize_pages: bad itemsize, rows, dim, first or rpp");
        return NULL;
    }
    /* every product and sum below is checked by division first: none can wrap around */
    if (first > PY_SSIZE_T_MAX - rows || (rows && dim > PY_SSIZE_T_MAX / itemsize / rows)) {
        PyErr_SetString(PyExc_ValueError, "quantize_pages: rows, dim or first too large");
        return NULL;
    }
    const Py_ssize_t rec = dim + 4;
    if (rpp > page_bytes / rec) {
        PyErr_SetString(PyExc_ValueError, "quantize_pages: rows_per_page records exceed a page");
        return NULL;
    }
    Py_buffer bx, bo;
    if (PyObject_GetBuffer(o_x, &bx, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(o_out, &bo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&bx);
        return NULL;
    }
    const Py_ssize_t last = first + rows; /* one past the last record written */
    /* the byte past the last record, or -1 where it would not fit in a Py_ssize_t */
    const Py_ssize_t pages = rows ? (last - 1) / rpp : 0;
    const Py_ssize_t need = !rows ? 0
                            : pages > (PY_SSIZE_T_MAX - page_bytes) / page_bytes
                                ? -1
                                : pages * page_bytes + ((last - 1) % rpp + 1) * rec;
    if (need < 0 || bx.len < rows * dim * itemsize || bo.len < need) {
        PyBuffer_Release(&bx);
        PyBuffer_Release(&bo);
        PyErr_SetString(PyExc_ValueError, "quantize_pages: x or out is smaller than the rows given");
        return NULL;
    }
    Py_ssize_t bad = 0;
    uint8_t *out = (uint8_t *)bo.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < rows; i++) {
        const Py_ssize_t r = first + i;
        uint8_t *dst = out + (r / rpp) * page_bytes + (r % rpp) * rec;
        if (itemsize == 2) {
            bad += row_bf16((const uint16_t *)bx.buf + i * dim, dim, dst);
        } else {
            bad += row_f32((const uint32_t *)bx.buf + i * dim, dim, dst);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bx);
    PyBuffer_Release(&bo);
    return PyLong_FromSsize_t(bad);
}

static PyMethodDef methods[] = {
    {"quantize_pages", quantize_pages, METH_VARARGS,
     "FP8 (E4M3, per-row absmax) records of a block of rows, into shard pages."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "rowcache.kernels._quantize", NULL, -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__quantize(void) { return PyModule_Create(&module); }
