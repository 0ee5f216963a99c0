/* A list of hashes as the u64 array a query's body carries:
 *   u64_list(items) -> bytes | None: exact ints in 0..2**64-1 as little-endian u64
 */
#include "native.h"

/* A client's has-blocks or prefix call gets its hashes as a Python list. numpy's
 * array(list, dtype="<u8") does not tell a bool, a float or a numeric string from a hash,
 * so Python code would check every item's type first: two passes over the objects. Here
 * one pass reads each exact int and stores its bytes. Anything else (a bool, a numpy
 * scalar, a hex string, a negative or too large int) makes it return None and the caller
 * takes its general path, which accepts the other hash forms and raises the one error
 * message for a bad hash: no second copy of that rule here. */

/* The value of an exact int in 0..2**64-1 into *out; 0, or -1 (no exception set). */
static inline int exact_u64(PyObject *item, uint64_t *out) {
    if (!PyLong_CheckExact(item))
        return -1;
#if ULONG_MAX == UINT64_MAX
    unsigned long v = PyLong_AsUnsignedLong(item); /* reads the digits directly */
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
#else
    unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
#endif
        PyErr_Clear(); /* OverflowError: negative, or more than 64 bits */
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

PyDoc_STRVAR(u64_list_doc,
"u64_list(items, /) -> bytes | None\n\n"
"The items of a list or tuple as little-endian u64 bytes, when every one is an exact int\n"
"in 0..2**64-1; None otherwise (the caller then converts and validates them itself).\n"
"Raises TypeError for anything but a list or tuple.");

static PyObject *py_u64_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("u64_list", nargs, 1, 1) < 0)
        return NULL;
    PyObject *seq = args[0];
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "u64_list: expected a list or tuple, found %.100s",
                     Py_TYPE(seq)->tp_name);
        return NULL;
    }
    /* No Python code runs below (exact ints only), so the sequence cannot change. */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (result == NULL)
        return NULL;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        if (exact_u64(items[i], &v) < 0) {
            Py_DECREF(result);
            Py_RETURN_NONE;
        }
        for (int k = 0; k < 8; k++) /* one store on little-endian hosts */
            out[8 * i + k] = (uint8_t)(v >> (8 * k));
    }
    return result;
}

PyMethodDef ints_methods[] = {
    {"u64_list", (PyCFunction)(void (*)(void))py_u64_list, METH_FASTCALL, u64_list_doc},
    {NULL, NULL, 0, NULL},
};
