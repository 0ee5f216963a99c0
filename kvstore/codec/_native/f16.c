/* f16_finite(data) -> bool: no IEEE binary16 Inf or NaN in the buffer. */
#include "native.h"

/* An IEEE binary16 is Inf/NaN iff its exponent field (0x7C00) is all ones. Per 16-bit
 * lane, (x & 0x7C00) + 0x0400 reaches 0x8000 exactly in that case and otherwise stays
 * <= 0x7C00, so the add never carries into the next lane: OR the sums together and test
 * the lane sign bits once per chunk. Chunks give an early exit on bad data without a
 * branch per word. Values are read in native byte order, as numpy stores them. */
#define F16_EXP4 0x7C007C007C007C00ULL
#define F16_ONE4 0x0400040004000400ULL
#define F16_SIGN4 0x8000800080008000ULL
#define F16_CHUNK 4096 /* bytes between early-exit checks */

static int f16_finite_swar(const uint8_t *p, size_t n) {
    while (n >= 8) {
        size_t m = n < F16_CHUNK ? n & ~(size_t)7 : F16_CHUNK;
        uint64_t acc = 0;
        for (size_t i = 0; i < m; i += 8) {
            uint64_t w;
            memcpy(&w, p + i, 8);
            acc |= (w & F16_EXP4) + F16_ONE4;
        }
        if (acc & F16_SIGN4)
            return 0;
        p += m;
        n -= m;
    }
    for (size_t i = 0; i + 2 <= n; i += 2) {
        uint16_t v;
        memcpy(&v, p + i, 2);
        if ((v & 0x7C00u) == 0x7C00u)
            return 0;
    }
    return 1;
}

#ifdef KV_X86
static int f16_avx2_ok;

/* Nonzero 16-bit lanes where the exponent field is all ones. */
__attribute__((target("avx2"))) static inline __m256i f16_bad_lanes(const __m256i *q) {
    const __m256i exp = _mm256_set1_epi16(0x7C00);
    return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_loadu_si256(q), exp), exp);
}

/* Same test 32 bytes at a time, four independent accumulators so the loads are not
 * serialized behind one OR chain. */
__attribute__((target("avx2"))) static int f16_finite_avx2(const uint8_t *p, size_t n) {
    while (n >= 128) {
        size_t m = n < F16_CHUNK ? n & ~(size_t)127 : F16_CHUNK;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = 0; i < m; i += 128) {
            const __m256i *q = (const __m256i *)(const void *)(p + i);
            a0 = _mm256_or_si256(a0, f16_bad_lanes(q));
            a1 = _mm256_or_si256(a1, f16_bad_lanes(q + 1));
            a2 = _mm256_or_si256(a2, f16_bad_lanes(q + 2));
            a3 = _mm256_or_si256(a3, f16_bad_lanes(q + 3));
        }
        __m256i a = _mm256_or_si256(_mm256_or_si256(a0, a1), _mm256_or_si256(a2, a3));
        if (!_mm256_testz_si256(a, a))
            return 0;
        p += m;
        n -= m;
    }
    return f16_finite_swar(p, n);
}
#endif

static int f16_finite_run(const uint8_t *p, size_t n) {
#ifdef KV_X86
    if (f16_avx2_ok)
        return f16_finite_avx2(p, n);
#endif
    return f16_finite_swar(p, n);
}

PyDoc_STRVAR(f16_finite_doc,
"f16_finite(data, /) -> bool\n\n"
"True iff no IEEE binary16 value in the C-contiguous buffer (native byte order, byte\n"
"length a multiple of 2) is Inf or NaN. Raises ValueError for an odd byte length.");

static PyObject *py_f16_finite(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("f16_finite", nargs, 1, 1) < 0)
        return NULL;
    Py_buffer view;
    if (get_contiguous(args[0], &view) < 0)
        return NULL;
    if (view.len % 2) {
        PyErr_Format(PyExc_ValueError,
                     "f16_finite: byte length must be a multiple of 2, found %zd", view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)view.buf;
    size_t n = (size_t)view.len;
    int ok;
    KV_RUN_NOGIL_IF(view.len >= KV_NOGIL_BYTES, ok = f16_finite_run(p, n));
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

void f16_init(void) {
#ifdef KV_X86
    __builtin_cpu_init();
    f16_avx2_ok = __builtin_cpu_supports("avx2");
#endif
}

PyMethodDef f16_methods[] = {
    {"f16_finite", (PyCFunction)(void (*)(void))py_f16_finite, METH_FASTCALL, f16_finite_doc},
    {NULL, NULL, 0, NULL},
};
