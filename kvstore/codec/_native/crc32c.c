/* The CRC-32C functions of the module:
 *   crc32c(data, crc=0) -> int: CRC-32C (Castagnoli, init and final XOR 0xFFFFFFFF),
 *     continuing `crc` exactly like the `crc32c` PyPI package (the value is taken mod
 *     2**32), by the kernel chosen at import (crc_kernels.c);
 *   crc32c_kernel() -> str names it; crc32c_kernels() -> list[str] lists the kernels
 *     compiled in and usable on this CPU, best first; crc32c_with(name, data, crc=0)
 *     runs one of them (for tests).
 */
#include "native.h"

PyDoc_STRVAR(crc32c_doc,
"crc32c(data, crc=0, /) -> int\n\n"
"CRC-32C (Castagnoli) of the bytes of a C-contiguous buffer, continuing `crc` like the\n"
"`crc32c` package: crc32c(b, crc32c(a)) == crc32c(a + b). `crc` is taken mod 2**32.\n"
"Raises BufferError for a non-contiguous buffer.");

int crc_arg(PyObject *const *args, Py_ssize_t nargs, uint32_t *crc) {
    *crc = 0;
    if (nargs < 2)
        return 0;
    unsigned long v = PyLong_AsUnsignedLongMask(args[1]);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    *crc = (uint32_t)v;
    return 0;
}

/* crc32c(data, crc) with a given kernel; `name` only labels argument errors. */
static PyObject *crc32c_call(crc_kernel_fn fn, const char *name, PyObject *const *args,
                             Py_ssize_t nargs) {
    uint32_t crc;
    if (check_nargs(name, nargs, 1, 2) < 0 || crc_arg(args, nargs, &crc) < 0)
        return NULL;
    Py_buffer view;
    if (get_contiguous(args[0], &view) < 0)
        return NULL;
    const uint8_t *p = (const uint8_t *)view.buf;
    size_t n = (size_t)view.len;
    KV_RUN_NOGIL_IF(view.len >= KV_NOGIL_BYTES, crc = crc32c_value(fn, crc, p, n));
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return crc32c_call(crc_run, "crc32c", args, nargs);
}

int crc_kernel_index(PyObject *name) {
    const char *s = PyUnicode_AsUTF8(name);
    if (s == NULL)
        return -1;
    for (int i = 0; i < n_crc_kernels; i++)
        if (crc_kernels[i].usable && strcmp(crc_kernels[i].name, s) == 0)
            return i;
    PyErr_Format(PyExc_ValueError, "no usable CRC-32C kernel named %R", name);
    return -1;
}

PyDoc_STRVAR(crc32c_kernel_doc,
"crc32c_kernel() -> str\n\n"
"Name of the kernel crc32c() runs, chosen at import from the CPU's features.");

static PyObject *py_crc32c_kernel(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(crc_run_name);
}

PyDoc_STRVAR(crc32c_kernels_doc,
"crc32c_kernels() -> list[str]\n\n"
"Names of the CRC-32C kernels compiled in that this CPU can run, best first.");

static PyObject *py_crc32c_kernels(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *names = PyList_New(0);
    for (int i = 0; names != NULL && i < n_crc_kernels; i++) {
        if (!crc_kernels[i].usable)
            continue;
        PyObject *name = PyUnicode_FromString(crc_kernels[i].name);
        if (name == NULL || PyList_Append(names, name) < 0)
            Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

PyDoc_STRVAR(crc32c_with_doc,
"crc32c_with(kernel, data, crc=0, /) -> int\n\n"
"crc32c(data, crc) computed by the named kernel (one of crc32c_kernels()).\n"
"Raises ValueError for a kernel that is not compiled in or that this CPU cannot run.");

static PyObject *py_crc32c_with(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "crc32c_with() needs a kernel name");
        return NULL;
    }
    int k = crc_kernel_index(args[0]);
    return k < 0 ? NULL : crc32c_call(crc_kernels[k].fn, "crc32c_with", args + 1, nargs - 1);
}

PyMethodDef crc32c_methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_FASTCALL, crc32c_doc},
    {"crc32c_kernel", py_crc32c_kernel, METH_NOARGS, crc32c_kernel_doc},
    {"crc32c_kernels", py_crc32c_kernels, METH_NOARGS, crc32c_kernels_doc},
    {"crc32c_with", (PyCFunction)(void (*)(void))py_crc32c_with, METH_FASTCALL, crc32c_with_doc},
    {NULL, NULL, 0, NULL},
};
