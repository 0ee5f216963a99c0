/* The module kvstore.codec._native: the functions of every file (see native.h) and the
 * one-time set-up of their kernels. */
#include "native.h"

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "kvstore.codec._native",
    "Compiled kernels: CRC-32C (and join+CRC, and a copy of block payloads to their slots\n"
    "with their CRC), FNV-1a 64, the chained block hash (also from a list), a list of\n"
    "hashes as u64 bytes, f16 finiteness, and a builder of one bytes object.", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    /* Once per process: init runs under the GIL, and a later init (another interpreter)
     * must not rewrite tables that a GIL-free kernel may be reading. */
    static int ready;
    if (!ready) {
        crc_init();
        f16_init();
        join_init();
        ready = 1;
    }
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    PyMethodDef *tables[] = {crc32c_methods, join_methods, scatter_methods,
                             scatter_views_methods, fnv_methods, ints_methods,
                             f16_methods};
    for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++)
        if (PyModule_AddFunctions(module, tables[i]) < 0) {
            Py_DECREF(module);
            return NULL;
        }
    if (builder_add(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
