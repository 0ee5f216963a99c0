/* Buffer and argument helpers of every function of the module. */
#include "native.h"

/* PyBUF_SIMPLE already refuses non-contiguous exporters (numpy, memoryview raise); the
 * explicit check also covers a careless third-party exporter, since the kernels read
 * view->len bytes linearly. On success the caller owns `view` and must release it. */
int get_contiguous(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_BufferError, "buffer is not C-contiguous");
        return -1;
    }
    return 0;
}

/* An int (or __index__ object) in 0..2**64-1; ValueError otherwise, matching the
 * "must fit u64" checks of the pure-Python code. */
int as_u64(PyObject *obj, const char *what, uint64_t *out) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(idx);
    Py_DECREF(idx);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must fit u64 (0..2**64-1)", what);
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi) {
    if (nargs < lo || nargs > hi) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd positional arguments (%zd given)",
                     name, lo, hi, nargs);
        return -1;
    }
    return 0;
}
