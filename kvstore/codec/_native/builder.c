/* BytesBuilder(capacity=0): write(data), write_crc(data, crc=0), write_at(offset, data),
 * view(n), advance(n), finish() -> bytes: fills one new bytes object (copies without the
 * GIL, pages populated, no join; or filled in place through a writable view).
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
    Py_ssize_t exports; /* writable views handed out and not yet released */
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

/* A call that may move or hand over the bytes object (growing it, finish) while a view of
 * it is held would leave that view pointing at freed memory: refused, as bytearray does. */
static int builder_unexported(BytesBuilder *b) {
    if (b->exports > 0) {
        PyErr_SetString(PyExc_BufferError,
                        "BytesBuilder: a view of it is still held (release it first)");
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
    if (builder_unexported(b) < 0)
        return -1;
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
    if (builder_ready(b) < 0 || builder_unexported(b) < 0)
        return NULL;
    PyObject *out = b->bytes;
    b->bytes = NULL;
    if (_PyBytes_Resize(&out, b->size) < 0)
        return NULL;
    return out;
}

PyDoc_STRVAR(builder_view_doc,
"view(n, /) -> memoryview\n\n"
"A writable view of the n bytes after those written (room made for them first, its pages\n"
"populated), to be filled in place (e.g. by a socket's recv_into) and then counted with\n"
"advance(). While any view is held, a write that must grow the object and finish() raise\n"
"BufferError.");

static PyObject *builder_view(BytesBuilder *b, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "BytesBuilder.view: n must be >= 0");
        return NULL;
    }
    if (builder_ready(b) < 0 || builder_reserve(b, n) < 0)
        return NULL;
    if (n >= BUILDER_NOGIL_MIN) { /* its pages faulted in with one call, not one per page */
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(b->bytes) + b->size;
        b->busy = 1;
        PyThreadState *state = PyEval_SaveThread();
        populate_pages(dst, (size_t)n);
        PyEval_RestoreThread(state);
        b->busy = 0;
    }
    PyObject *whole = PyMemoryView_FromObject((PyObject *)b);
    if (whole == NULL)
        return NULL;
    PyObject *part = PySequence_GetSlice(whole, b->size, b->size + n);
    Py_DECREF(whole);
    return part;
}

PyDoc_STRVAR(builder_advance_doc,
"advance(n, /) -> int\n\n"
"Count the n bytes after those written as written (the caller filled them through\n"
"view()); returns the size written so far.");

static PyObject *builder_advance(BytesBuilder *b, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (builder_ready(b) < 0)
        return NULL;
    if (n < 0 || n > PyBytes_GET_SIZE(b->bytes) - b->size) {
        PyErr_Format(PyExc_ValueError,
                     "BytesBuilder.advance: %zd bytes are not within the %zd of room after "
                     "the %zd written", n, PyBytes_GET_SIZE(b->bytes) - b->size, b->size);
        return NULL;
    }
    b->size += n;
    return PyLong_FromSsize_t(b->size);
}

/* The buffer protocol: the whole bytes object (written or not), writable; each export
 * counted until released. */
static int builder_getbuffer(BytesBuilder *b, Py_buffer *view, int flags) {
    if (b->bytes == NULL) {
        PyErr_SetString(PyExc_BufferError, "BytesBuilder: already finished");
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)b, PyBytes_AS_STRING(b->bytes),
                          PyBytes_GET_SIZE(b->bytes), 0, flags) < 0)
        return -1;
    b->exports++;
    return 0;
}

static void builder_releasebuffer(BytesBuilder *b, Py_buffer *view) {
    (void)view;
    b->exports--;
}

static PyBufferProcs builder_as_buffer = {
    .bf_getbuffer = (getbufferproc)builder_getbuffer,
    .bf_releasebuffer = (releasebufferproc)builder_releasebuffer,
};

static Py_ssize_t builder_len(BytesBuilder *b) { return b->size; }

static PyMethodDef builder_methods[] = {
    {"write", (PyCFunction)builder_write, METH_O, builder_write_doc},
    {"write_crc", (PyCFunction)(void (*)(void))builder_write_crc, METH_FASTCALL,
     builder_write_crc_doc},
    {"write_at", (PyCFunction)(void (*)(void))builder_write_at, METH_FASTCALL,
     builder_write_at_doc},
    {"view", (PyCFunction)builder_view, METH_O, builder_view_doc},
    {"advance", (PyCFunction)builder_advance, METH_O, builder_advance_doc},
    {"finish", (PyCFunction)builder_finish, METH_NOARGS, builder_finish_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods builder_as_sequence = {.sq_length = (lenfunc)builder_len};

PyDoc_STRVAR(builder_doc,
"BytesBuilder(capacity=0)\n\n"
"Fills one new bytes object by appends (write), patches (write_at) or in place through\n"
"a writable view (view, advance), then returns it with finish(), trimmed to what was\n"
"written, without a copy. Large parts are copied with the GIL released; one thread at a\n"
"time.");

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
    .tp_as_buffer = &builder_as_buffer,
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
