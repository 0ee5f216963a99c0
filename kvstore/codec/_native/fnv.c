/* FNV-1a 64 and the chained block hash (spec section "Block hash"):
 *   fnv1a64(data, h=0xCBF29CE484222325) -> int
 *   fnv_chain(tokens, block_tokens, parent=0) -> bytes: the chain's u64 hashes (LE)
 *   fnv_chain_list(tokens, block_tokens, parent=0) -> bytes | None: the same from a list
 */
#include "native.h"

#define FNV_BASIS 0xCBF29CE484222325ULL
#define FNV_PRIME 0x100000001B3ULL

/* FNV-1a is one serial multiply chain (~4 cycles per byte); nothing to vectorize, so keep
 * the loop minimal and let the four-byte unroll hide the loop overhead. */
static inline uint64_t fnv_bytes(uint64_t h, const uint8_t *p, size_t n) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        h = (h ^ p[i]) * FNV_PRIME;
        h = (h ^ p[i + 1]) * FNV_PRIME;
        h = (h ^ p[i + 2]) * FNV_PRIME;
        h = (h ^ p[i + 3]) * FNV_PRIME;
    }
    for (; i < n; i++)
        h = (h ^ p[i]) * FNV_PRIME;
    return h;
}

/* Token ids are little-endian u32 in the buffer and H() hashes le_u32 bytes, so each
 * block is hashed straight from the buffer bytes: no decoding, no endianness issue. */
static void fnv_chain_run(const uint8_t *tok, size_t n_full, size_t block_bytes,
                          uint64_t parent, uint8_t *out) {
    for (size_t b = 0; b < n_full; b++) {
        uint64_t h = FNV_BASIS;
        for (int k = 0; k < 8; k++) /* le_u64(parent) */
            h = (h ^ ((parent >> (8 * k)) & 0xFF)) * FNV_PRIME;
        h = fnv_bytes(h, tok, block_bytes);
        tok += block_bytes;
        if (h == 0) /* 0 is reserved for "no hash" */
            h = 1;
        for (int k = 0; k < 8; k++)
            out[8 * b + (size_t)k] = (uint8_t)(h >> (8 * k));
        parent = h;
    }
}

PyDoc_STRVAR(fnv1a64_doc,
"fnv1a64(data, h=0xCBF29CE484222325, /) -> int\n\n"
"FNV-1a 64 of the bytes of a C-contiguous buffer, continuing from `h` (0..2**64-1).\n"
"No 0 -> 1 replacement (that belongs to the block hash).");

static PyObject *py_fnv1a64(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("fnv1a64", nargs, 1, 2) < 0)
        return NULL;
    uint64_t h = FNV_BASIS;
    if (nargs == 2 && as_u64(args[1], "h", &h) < 0)
        return NULL;
    Py_buffer view;
    if (get_contiguous(args[0], &view) < 0)
        return NULL;
    const uint8_t *p = (const uint8_t *)view.buf;
    size_t n = (size_t)view.len;
    KV_RUN_NOGIL_IF(view.len >= KV_NOGIL_FNV_BYTES, h = fnv_bytes(h, p, n));
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(fnv_chain_doc,
"fnv_chain(tokens, block_tokens, parent=0, /) -> bytes\n\n"
"Chained block hashes of the full blocks of `tokens` (a C-contiguous buffer of\n"
"little-endian u32 token ids; byte length a multiple of 4): h_i = H(h_{i-1}, block i),\n"
"h_{-1} = parent, H(p, toks) = fnv1a64(le_u64(p) || le_u32(toks...)) with 0 -> 1.\n"
"The partial tail is ignored. Returns the hashes as packed little-endian u64.\n"
"Raises ValueError if block_tokens < 1, the byte length is not a multiple of 4, or\n"
"parent does not fit u64.");

/* The (block_tokens, parent) arguments every chained-hash entry point takes: args[1], and
 * args[2] when given. 0 on success, -1 with an exception set. */
static int chain_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t *block_tokens,
                      uint64_t *parent) {
    /* NULL: clamp instead of raising, so a huge block_tokens just means no full block. */
    *block_tokens = PyNumber_AsSsize_t(args[1], NULL);
    if (*block_tokens == -1 && PyErr_Occurred())
        return -1;
    if (*block_tokens < 1) {
        PyErr_Format(PyExc_ValueError, "block_tokens must be >= 1, found %zd", *block_tokens);
        return -1;
    }
    *parent = 0;
    return (nargs == 3 && as_u64(args[2], "parent", parent) < 0) ? -1 : 0;
}

static PyObject *py_fnv_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("fnv_chain", nargs, 2, 3) < 0)
        return NULL;
    Py_ssize_t block_tokens;
    uint64_t parent;
    if (chain_args(args, nargs, &block_tokens, &parent) < 0)
        return NULL;

    Py_buffer view;
    if (get_contiguous(args[0], &view) < 0)
        return NULL;
    PyObject *result = NULL;
    if (view.len % 4) {
        PyErr_Format(PyExc_ValueError,
                     "fnv_chain: tokens must be u32 (byte length a multiple of 4), found %zd bytes",
                     view.len);
        goto done;
    }
    Py_ssize_t n_full = (view.len / 4) / block_tokens;
    if (n_full > PY_SSIZE_T_MAX / 8) { /* unreachable in practice; keeps 8*n_full exact */
        PyErr_NoMemory();
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, 8 * n_full);
    if (result == NULL)
        goto done;
    /* The fresh bytes object is private until returned, so filling it without the GIL
     * is safe. */
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    const uint8_t *tok = (const uint8_t *)view.buf;
    size_t block_bytes = (size_t)block_tokens * 4; /* n_full >= 1 implies this fits */
    KV_RUN_NOGIL_IF(view.len >= KV_NOGIL_FNV_BYTES,
                    fnv_chain_run(tok, (size_t)n_full, block_bytes, parent, out));
done:
    PyBuffer_Release(&view);
    return result;
}

/* Token ids arrive as Python lists. numpy's asarray(list) infers a dtype first (a pass
 * over every object), builds int64, and the range check and u32 cast are two more passes:
 * 77% of chain_hashes on a 131,072-token list. Here one pass reads each exact int and
 * hashes its little-endian bytes as it goes (reading the next ints overlaps the FNV
 * multiply chain, which is the bound). Anything else (a bool, a numpy scalar, a float, an
 * id outside u32) makes it return None and the caller takes its general path, which
 * raises the one error message for a bad id: no second copy of that rule here. */

/* The u32 value of an exact int in 0..2**32-1, or -1. */
static inline int64_t token_u32(PyObject *item) {
    if (!PyLong_CheckExact(item))
        return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    return (overflow || v < 0 || v > 0xFFFFFFFFll) ? -1 : (int64_t)v;
}

PyDoc_STRVAR(fnv_chain_list_doc,
"fnv_chain_list(tokens, block_tokens, parent=0, /) -> bytes | None\n\n"
"fnv_chain of a list or tuple of ints, read directly (no u32 buffer first). None when an\n"
"item (of the full blocks or the partial tail) is not an exact int in 0..2**32-1: the\n"
"caller then validates the input itself. Raises TypeError for anything but a list or\n"
"tuple, ValueError as fnv_chain for block_tokens and parent.");

static PyObject *py_fnv_chain_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("fnv_chain_list", nargs, 2, 3) < 0)
        return NULL;
    PyObject *seq = args[0];
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "fnv_chain_list: expected a list or tuple, found %.100s",
                     Py_TYPE(seq)->tp_name);
        return NULL;
    }
    Py_ssize_t block_tokens;
    uint64_t parent;
    if (chain_args(args, nargs, &block_tokens, &parent) < 0)
        return NULL;
    /* No Python code runs below (exact ints only), so the sequence cannot change. */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n_full = n / block_tokens;
    PyObject *result = PyBytes_FromStringAndSize(NULL, 8 * n_full);
    if (result == NULL)
        return NULL;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    Py_ssize_t i = 0;
    for (Py_ssize_t b = 0; b < n_full; b++) {
        uint64_t h = FNV_BASIS;
        for (int k = 0; k < 8; k++) /* le_u64(parent) */
            h = (h ^ ((parent >> (8 * k)) & 0xFF)) * FNV_PRIME;
        for (Py_ssize_t end = i + block_tokens; i < end; i++) {
            int64_t t = token_u32(items[i]);
            if (t < 0)
                goto refuse;
            h = (h ^ ((uint64_t)t & 0xFF)) * FNV_PRIME;
            h = (h ^ (((uint64_t)t >> 8) & 0xFF)) * FNV_PRIME;
            h = (h ^ (((uint64_t)t >> 16) & 0xFF)) * FNV_PRIME;
            h = (h ^ ((uint64_t)t >> 24)) * FNV_PRIME;
        }
        if (h == 0) /* 0 is reserved for "no hash" */
            h = 1;
        for (int k = 0; k < 8; k++)
            out[8 * b + k] = (uint8_t)(h >> (8 * k));
        parent = h;
    }
    for (; i < n; i++) /* the partial tail is not hashed, but it must be valid too */
        if (token_u32(items[i]) < 0)
            goto refuse;
    return result;
refuse:
    Py_DECREF(result);
    Py_RETURN_NONE;
}

PyMethodDef fnv_methods[] = {
    {"fnv1a64", (PyCFunction)(void (*)(void))py_fnv1a64, METH_FASTCALL, fnv1a64_doc},
    {"fnv_chain", (PyCFunction)(void (*)(void))py_fnv_chain, METH_FASTCALL, fnv_chain_doc},
    {"fnv_chain_list", (PyCFunction)(void (*)(void))py_fnv_chain_list, METH_FASTCALL,
     fnv_chain_list_doc},
    {NULL, NULL, 0, NULL},
};
