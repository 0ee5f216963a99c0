/* An operating-system call the store uses and Python's os module does not offer.
 *
 * start_writeback(fd) -> bool
 *   Linux sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE): ask the kernel to start
 *   writing every dirty page of the file that is not already being written. It does not
 *   wait for the writes, guarantees nothing about durability (fdatasync still does that)
 *   and releases the GIL. False where the call does not exist; OSError if it fails.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>

PyDoc_STRVAR(start_writeback_doc,
"start_writeback(fd, /) -> bool\n\n"
"Start writing the file's dirty pages (Linux sync_file_range SYNC_FILE_RANGE_WRITE);\n"
"does not wait and is not a sync. False where the call does not exist.");

static PyObject *py_start_writeback(PyObject *self, PyObject *arg) {
    (void)self;
    int fd = PyObject_AsFileDescriptor(arg);
    if (fd < 0)
        return NULL;
#if defined(__linux__) && defined(SYNC_FILE_RANGE_WRITE)
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef syscalls_methods[] = {
    {"start_writeback", py_start_writeback, METH_O, start_writeback_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef syscalls_module = {
    PyModuleDef_HEAD_INIT, "kvstore.fileio._syscalls",
    "sync_file_range: start writeback without waiting (write-behind of the store, archive outputs).", -1,
    syscalls_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__syscalls(void) { return PyModule_Create(&syscalls_module); }
