/* scatter_crc_views(envelopes, payload_offset, blocks, record_bytes=None) -> int
 * Each block's payload, [L][2][H][B][D] of 2-byte elements, copied into its own writable
 * 5-D array of that shape with any strides whose last axis is contiguous (an engine's page
 * seen through a transposed view: SGLang's host pool pages and flat pages), each
 * envelope's CRC-32C checked in the same pass; returns how many leading blocks are in
 * envelopes that matched their CRC.
 */
#include "native.h"

PyDoc_STRVAR(scatter_crc_views_doc,
"scatter_crc_views(envelopes, payload_offset, blocks, record_bytes=None, /) -> int\n\n"
"Copy the block payloads of envelopes into `blocks` while checking each envelope's\n"
"CRC-32C in the same pass; returns how many leading blocks are in envelopes that matched\n"
"their CRC (the copy stops at the first envelope that does not, whose blocks may already\n"
"be partly written). A block's payload is [L][2][H][B][D] of 2-byte elements; `blocks`\n"
"holds one writable buffer per block of the envelopes, in order, each of that shape and\n"
"itemsize 2 with any strides whose last axis is contiguous (a numpy view of a page).\n"
"An envelope's first payload is at `payload_offset`, its CRC (the last 4 bytes, LE)\n"
"covers every byte before it. record_bytes None: each envelope holds one block (bytes\n"
"after its payload are only checksummed); record_bytes >= 0: an envelope holds k >= 1\n"
"blocks, their payloads `record_bytes` apart. Raises ValueError for shapes or sizes\n"
"that do not fit.");

/* One block of a strided destination: its first element and its strides in bytes. */
typedef struct {
    uint8_t *base;
    Py_ssize_t s_layer, s_kv, s_head, s_token;
} block_dst;

/* `rows` rows of `row` bytes from `src` (back to back) to `dst`, `stride` bytes apart.
 * Rows of whole 16-byte vectors at 16-byte aligned places go through streaming stores:
 * the pages a load fills are far larger than the cache and are not read back by this
 * CPU soon, so the stores skip reading each line in first. Else memcpy per row. */
static void copy_rows(uint8_t *dst, Py_ssize_t stride, const uint8_t *src, size_t row,
                      size_t rows) {
#if defined(KV_X86) && defined(__SSE2__)
    if (row % 16 == 0 && ((uintptr_t)dst | (uintptr_t)stride) % 16 == 0) {
        for (size_t t = 0; t < rows; t++) {
            __m128i *to = (__m128i *)(dst + (Py_ssize_t)t * stride);
            const __m128i *from = (const __m128i *)(src + t * row);
            for (size_t v = 0; v < row / 16; v++)
                _mm_stream_si128(to + v, _mm_loadu_si128(from + v));
        }
        return;
    }
#endif
    for (size_t t = 0; t < rows; t++)
        memcpy(dst + (Py_ssize_t)t * stride, src + t * row, row);
}

/* One block's payload, [L][2][H][B][row], into its strided destination: each (layer,
 * K/V, head) run of B rows checksummed, then its rows copied while still in L1 (one fused
 * copy + CRC when the rows lie back to back). */
typedef struct {
    crc_kernel_fn fn;
    crc_copy_fn copy;
    const block_dst *dsts;
    size_t layers, heads, tokens, row;
} view_slots;

static uint32_t scatter_view_block(const void *ctx, uint32_t crc, const uint8_t *src,
                                   Py_ssize_t block) {
    const view_slots *c = (const view_slots *)ctx;
    const block_dst *d = &c->dsts[block];
    size_t unit = c->tokens * c->row;
    int rows_joined = d->s_token == (Py_ssize_t)c->row;
    for (size_t l = 0; l < c->layers; l++)
        for (size_t k = 0; k < 2; k++)
            for (size_t h = 0; h < c->heads; h++) {
                uint8_t *to = d->base + (Py_ssize_t)l * d->s_layer + (Py_ssize_t)k * d->s_kv +
                              (Py_ssize_t)h * d->s_head;
                if (rows_joined) {
                    crc = copy_crc(c->fn, c->copy, crc, to, src, unit);
                } else {
                    crc = c->fn(crc, src, unit);
                    copy_rows(to, d->s_token, src, c->row, c->tokens);
                }
                src += unit;
            }
    return crc;
}

/* The shape every block must have (taken from the first) and its byte strides. */
static int block_view(Py_buffer *view, Py_ssize_t index, const Py_ssize_t *shape,
                      block_dst *out) {
    if (view->ndim != 5 || view->itemsize != 2 || view->shape == NULL ||
        view->strides == NULL || view->strides[4] != 2 || view->readonly) {
        PyErr_Format(PyExc_ValueError,
                     "scatter_crc_views: block %zd is not a writable 5-D array of 2-byte "
                     "elements whose last axis is contiguous", index);
        return -1;
    }
    if (shape != NULL)
        for (int a = 0; a < 5; a++)
            if (view->shape[a] != shape[a]) {
                PyErr_Format(PyExc_ValueError,
                             "scatter_crc_views: block %zd's shape differs from block 0's",
                             index);
                return -1;
            }
    if (view->shape[1] != 2) {
        PyErr_SetString(PyExc_ValueError, "scatter_crc_views: blocks are [L][2][H][B][D]");
        return -1;
    }
    out->base = (uint8_t *)view->buf;
    out->s_layer = view->strides[0];
    out->s_kv = view->strides[1];
    out->s_head = view->strides[2];
    out->s_token = view->strides[3];
    return 0;
}

static PyObject *py_scatter_crc_views(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("scatter_crc_views", nargs, 3, 4) < 0)
        return NULL;
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    Py_ssize_t rec = -1; /* None: single-block envelopes */
    if (nargs == 4 && args[3] != Py_None)
        rec = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (off < 0 || (nargs == 4 && args[3] != Py_None && rec < 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "scatter_crc_views: payload_offset >= 0, record_bytes None or >= 0");
        return NULL;
    }
    PyObject *envs_seq = PySequence_Fast(args[0], "scatter_crc_views: envelopes is not a sequence");
    PyObject *blocks_seq = NULL, *result = NULL;
    Py_buffer *envs = NULL, *views = NULL;
    block_dst *dsts = NULL;
    Py_ssize_t *counts = NULL;
    Py_ssize_t got_e = 0, got_b = 0;
    if (envs_seq == NULL)
        return NULL;
    blocks_seq = PySequence_Fast(args[2], "scatter_crc_views: blocks is not a sequence");
    if (blocks_seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(envs_seq);
    Py_ssize_t n_blocks = PySequence_Fast_GET_SIZE(blocks_seq);
    if (rec < 0 && n_blocks != n) {
        PyErr_SetString(PyExc_ValueError, "scatter_crc_views: one block per envelope");
        goto done;
    }
    envs = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    counts = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    views = PyMem_Calloc((size_t)n_blocks + 1, sizeof(Py_buffer));
    dsts = PyMem_Calloc((size_t)n_blocks + 1, sizeof(block_dst));
    if (!envs || !counts || !views || !dsts) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got_b < n_blocks; got_b++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(blocks_seq, got_b), &views[got_b],
                               PyBUF_WRITABLE | PyBUF_STRIDES) < 0)
            goto done;
        if (block_view(&views[got_b], got_b, got_b ? views[0].shape : NULL, &dsts[got_b]) < 0) {
            got_b++;
            goto done;
        }
    }
    size_t payload = 0, layers = 0, heads = 0, tokens = 0, row = 0;
    if (n_blocks > 0) { /* the product is a buffer's size in bytes: it does not overflow */
        layers = (size_t)views[0].shape[0];
        heads = (size_t)views[0].shape[2];
        tokens = (size_t)views[0].shape[3];
        row = (size_t)views[0].shape[4] * 2;
        payload = layers * 2 * heads * tokens * row;
    }
    if (n_blocks > 0 && payload == 0) {
        PyErr_SetString(PyExc_ValueError, "scatter_crc_views: blocks of no elements");
        goto done;
    }
    Py_ssize_t total = envelope_blocks("scatter_crc_views", envs_seq, envs, counts, (size_t)off,
                                       payload, rec, &got_e);
    if (total < 0)
        goto done;
    if (total != n_blocks) {
        PyErr_Format(PyExc_ValueError,
                     "scatter_crc_views: the envelopes hold %zd blocks, %zd blocks given",
                     total, n_blocks);
        goto done;
    }
    view_slots ctx = {crc_run, crc_run_copy, dsts, layers, heads, tokens, row};
    Py_ssize_t ok;
    Py_BEGIN_ALLOW_THREADS
    ok = scatter_envelopes_run(crc_run, envs, counts, n, (size_t)off, rec < 0 ? 0 : (size_t)rec,
                               payload, scatter_view_block, &ctx);
#if defined(KV_X86) && defined(__SSE2__)
    _mm_sfence(); /* the streaming stores are ordered before the caller's next ones */
#endif
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(ok);
done:
    for (Py_ssize_t i = 0; i < got_e; i++)
        PyBuffer_Release(&envs[i]);
    for (Py_ssize_t i = 0; i < got_b; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(envs);
    PyMem_Free(counts);
    PyMem_Free(views);
    PyMem_Free(dsts);
    Py_XDECREF(blocks_seq);
    Py_DECREF(envs_seq);
    return result;
}

PyMethodDef scatter_views_methods[] = {
    {"scatter_crc_views", (PyCFunction)(void (*)(void))py_scatter_crc_views, METH_FASTCALL,
     scatter_crc_views_doc},
    {NULL, NULL, 0, NULL},
};
