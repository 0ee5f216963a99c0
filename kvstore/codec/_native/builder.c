/* BytesBuilder(capacity=0): write(data), write_crc(data, crc=0), write_at(offset, data),
 * finish() -> bytes: fills one new bytes object (copies without the GIL, pages populated,
 * no join).
 */
#include "native.h"

/* BytesBuilder: fills one new bytes object by appends (and patches of what was written),
 * then hands it over with finish(), trimmed to what was written: a received stream becomes
 * one `bytes` with one copy per part and no join. The object is private to the builder
 * until finish() (its only reference), so parts are copied into it without the GIL, and it
 * grows and shrinks in place (_PyBytes_Resize; glibc's realloc of a large block remaps its
 * pages instead of copying them). The pages a large part lands on are populated with one
 * madvise before the copy (populate_pages), and are not advised onto huge pages as
 * join_crc's output is: a fetched envelope is typically built after the process has been
 * idle, and on a VM with free-page reporting (free memory handed back to the host after
 * ~2 s) a huge page must then be backed again by the host, which costs more than the 4 KiB
 * faults it saves (BENCHMARKS.md, "Measurements behind design choices"). One thread at a
 * time: a call while another thread's copy runs raises RuntimeError. */
typedef struct {
    PyObject_HEAD
    PyObject *bytes; /* NULL once finished */
    Py_ssize_t size; /* bytes written */
    int busy;        /* a copy runs without the GIL */
} BytesBuilder;

#define BUILDER_NOGIL_MIN (64 * 1024)

static int builder_ready(BytesBuilder *b) {
    if (b->bytes == NULL) {
        PyErr_SetString(PyExc_ValueError, "BytesBuilder: already finished");
        return -1;
    }
    if (b->busy) {
        PyErr_SetString(PyExc_RuntimeError, "BytesBuilder: in use by another thread");
        return -1;
    }
    return 0;
}

static PyObject *builder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_ssize_t capacity = 0;
    static char *kwlist[] = {"capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:BytesBuilder", kwlist, &capacity))
        return NULL;
    if (capacity < 0) {
        PyErr_SetString(PyExc_ValueError, "BytesBuilder: capacity must be >= 0");
        return NULL;
    }
    BytesBuilder *b = (BytesBuilder *)type->tp_alloc(type, 0);
    if (b == NULL)
        return NULL;
    b->bytes = PyBytes_FromStringAndSize(NULL, capacity);
    if (b->bytes == NULL) {
        Py_DECREF(b);
        return NULL;
    }
    return (PyObject *)b;
}

static void builder_dealloc(BytesBuilder *b) {
    Py_XDECREF(b->bytes);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

/* Room for `more` bytes past size: doubles the capacity (at least), in place. */
static int builder_reserve(BytesBuilder *b, Py_ssize_t more) {
    Py_ssize_t cap = PyBytes_GET_SIZE(b->bytes);
    if (more <= cap - b->size)
        return 0;
    if (more > PY_SSIZE_T_MAX - b->size) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t need = b->size + more;
    Py_ssize_t grown = cap <= PY_SSIZE_T_MAX / 2 ? cap * 2 : PY_SSIZE_T_MAX;
    if (grown < need)
        grown = need;
    if (_PyBytes_Resize(&b->bytes, grown) < 0)
        return -1; /* b->bytes is NULL: the builder is finished */
    return 0;
}

/* Copy `data` into the bytes object at `offset` (already within its capacity); with `crc`,
 * continue the CRC-32C in *crc over the bytes in the same pass. */
static void builder_copy(BytesBuilder *b, Py_ssize_t offset, Py_buffer *view, uint32_t *crc) {
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(b->bytes) + offset;
    const uint8_t *src = (const uint8_t *)view->buf;
    size_t n = (size_t)view->len;
    if (n == 0)
        return;
    int nogil = view->len >= BUILDER_NOGIL_MIN;
    PyThreadState *state = NULL;
    if (nogil) {
        b->busy = 1;
        state = PyEval_SaveThread();
        populate_pages(dst, n);
    }
    if (crc != NULL)
        *crc = ~copy_crc(crc_run, crc_run_copy, ~*crc, dst, src, n);
    else
        memcpy(dst, src, n);
    if (nogil) {
        PyEval_RestoreThread(state);
        b->busy = 0;
    }
}

PyDoc_STRVAR(builder_write_doc,
"write(data, /) -> int\n\n"
"Append a C-contiguous buffer; returns the size written so far.");

static PyObject *builder_write(BytesBuilder *b, PyObject *data) {
    if (builder_ready(b) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    PyObject *result = NULL;
    if (builder_reserve(b, view.len) == 0) {
        builder_copy(b, b->size, &view, NULL);
        b->size += view.len;
        result = PyLong_FromSsize_t(b->size);
    }
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(builder_write_crc_doc,
"write_crc(data, crc=0, /) -> int\n\n"
"Append a C-contiguous buffer and return its CRC-32C continuing `crc` (as crc32c(data,\n"
"crc) would), copied and checksummed in one pass.");

static PyObject *builder_write_crc(BytesBuilder *b, PyObject *const *args, Py_ssize_t nargs) {
    uint32_t crc;
    if (check_nargs("write_crc", nargs, 1, 2) < 0 || builder_ready(b) < 0 ||
        crc_arg(args, nargs, &crc) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    PyObject *result = NULL;
    if (builder_reserve(b, view.len) == 0) {
        builder_copy(b, b->size, &view, &crc);
        b->size += view.len;
        result = PyLong_FromUnsignedLong(crc);
    }
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(builder_write_at_doc,
"write_at(offset, data, /) -> None\n\n"
"Overwrite bytes already written, from offset (offset + len(data) <= len(self)).");

static PyObject *builder_write_at(BytesBuilder *b, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("write_at", nargs, 2, 2) < 0 || builder_ready(b) < 0)
        return NULL;
    Py_ssize_t offset = PyLong_AsSsize_t(args[0]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (offset < 0 || view.len > b->size - offset) {
        PyErr_Format(PyExc_ValueError,
                     "BytesBuilder.write_at: %zd bytes at offset %zd are not within the %zd "
                     "written", view.len, offset, b->size);
        PyBuffer_Release(&view);
        return NULL;
    }
    builder_copy(b, offset, &view, NULL);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(builder_finish_doc,
"finish() -> bytes\n\n"
"The bytes written, as the builder's own bytes object (no copy); the builder is spent.");

static PyObject *builder_finish(BytesBuilder *b, PyObject *unused) {
    (void)unused;
    if (builder_ready(b) < 0)
        return NULL;
    PyObject *out = b->bytes;
    b->bytes = NULL;
    if (_PyBytes_Resize(&out, b->size) < 0)
        return NULL;
    return out;
}

static Py_ssize_t builder_len(BytesBuilder *b) { return b->size; }

static PyMethodDef builder_methods[] = {
    {"write", (PyCFunction)builder_write, METH_O, builder_write_doc},
    {"write_crc", (PyCFunction)(void (*)(void))builder_write_crc, METH_FASTCALL,
     builder_write_crc_doc},
    {"write_at", (PyCFunction)(void (*)(void))builder_write_at, METH_FASTCALL,
     builder_write_at_doc},
    {"finish", (PyCFunction)builder_finish, METH_NOARGS, builder_finish_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods builder_as_sequence = {.sq_length = (lenfunc)builder_len};

PyDoc_STRVAR(builder_doc,
"BytesBuilder(capacity=0)\n\n"
"Fills one new bytes object by appends (write) and patches (write_at), then returns it\n"
"with finish(), trimmed to what was written, without a copy. Large parts are copied with\n"
"the GIL released; one thread at a time.");

static PyTypeObject BytesBuilderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore.codec._native.BytesBuilder",
    .tp_basicsize = sizeof(BytesBuilder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = builder_doc,
    .tp_new = builder_new,
    .tp_dealloc = (destructor)builder_dealloc,
    .tp_methods = builder_methods,
    .tp_as_sequence = &builder_as_sequence,
};

int builder_add(PyObject *module) {
    if (PyType_Ready(&BytesBuilderType) < 0)
        return -1;
    Py_INCREF(&BytesBuilderType);
    if (PyModule_AddObject(module, "BytesBuilder", (PyObject *)&BytesBuilderType) < 0) {
        Py_DECREF(&BytesBuilderType);
        return -1;
    }
    return 0;
}
