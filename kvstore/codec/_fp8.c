/* FP8 E4M3FN quantization kernel for format v2 (see kvstore/numerics.py for the rule).
 *
 * e4m3_quantize(x, codes, scales, filled) -> bool
 *   x:      C-contiguous float32 buffer of S*filled values (S slabs, `filled` each)
 *   codes:  writable uint8 buffer of S*E bytes (E = elements per slab, E >= filled);
 *           bytes past `filled` in each slab are left as they are (the caller zeroes them)
 *   scales: writable float32 buffer of S values
 * Returns False (and writes nothing meaningful) if any value is NaN or infinite.
 *
 * Per slab: amax = max|x|, scale = amax / 448 in f32 (1.0 when amax == 0), and each code
 * is E4M3FN(x / scale) rounded to nearest even -- bit-identical to
 * (x / scale).astype(ml_dtypes.float8_e4m3fn). The conversion is branch-free so the
 * compiler vectorizes it:
 *   normal range (|y| >= 2^-6): round the f32 bit pattern to 3 mantissa bits (RNE) and
 *     rebias the exponent from 127 to 7 (subtract 120 << 3); overflow saturates to the
 *     NaN pattern 0x7F like ml_dtypes;
 *   subnormal range: |y| + 2^14 has an ulp of 2^-9, the E4M3 subnormal step, so the FPU's
 *     own round-to-nearest-even does the rounding and the low bits are the code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint8_t f32_to_e4m3(float y) {
    uint32_t u;
    memcpy(&u, &y, 4);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t normal = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    normal = normal - 960u;
    normal = normal > 0x7Fu ? 0x7Fu : normal;
    float t = fabsf(y) + 16384.0f;
    uint32_t tb;
    memcpy(&tb, &t, 4);
    uint32_t sub = tb - 0x46800000u;
    uint32_t code = a < 0x3C800000u ? sub : normal;
    return (uint8_t)(code | sign);
}

static PyObject *e4m3_quantize(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer x, codes, scales;
    Py_ssize_t filled;
    if (!PyArg_ParseTuple(args, "y*w*w*n", &x, &codes, &scales, &filled))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n_slabs = scales.len / 4;
    if (filled < 0 || scales.len % 4 || x.len != n_slabs * filled * 4 ||
        (n_slabs && codes.len % n_slabs) || (n_slabs && codes.len / n_slabs < filled)) {
        PyErr_SetString(PyExc_ValueError, "e4m3_quantize: inconsistent buffer sizes");
        goto done;
    }
    Py_ssize_t elems = n_slabs ? codes.len / n_slabs : 0;
    int finite = 1;
    Py_BEGIN_ALLOW_THREADS
    const float *xs = (const float *)x.buf;
    uint8_t *out = (uint8_t *)codes.buf;
    float *sc = (float *)scales.buf;
    for (Py_ssize_t s = 0; s < n_slabs && finite; s++) {
        const float *row = xs + s * filled;
        float amax = 0.0f;
        uint32_t bad = 0;
        for (Py_ssize_t i = 0; i < filled; i++) {
            uint32_t u;
            memcpy(&u, &row[i], 4);
            bad |= (u & 0x7F800000u) == 0x7F800000u; /* Inf or NaN */
            float v = fabsf(row[i]);
            amax = v > amax ? v : amax;
        }
        if (bad) {
            finite = 0;
            break;
        }
        float scale = amax == 0.0f ? 1.0f : amax / 448.0f;
        sc[s] = scale;
        uint8_t *dst = out + s * elems;
        for (Py_ssize_t i = 0; i < filled; i++)
            dst[i] = f32_to_e4m3(row[i] / scale);
    }
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(finite);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    return result;
}

static PyMethodDef methods[] = {
    {"e4m3_quantize", e4m3_quantize, METH_VARARGS,
     "e4m3_quantize(x, codes, scales, filled) -> bool: the v2 writer rule per slab."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore.codec._fp8", "FP8 E4M3FN quantization kernel.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fp8(void) { return PyModule_Create(&module); }
