/* scatter_crc(envelopes, payload_offset, layers, block_ids, n_heads, run_bytes,
 *             record_bytes=None, key_tokens=0) -> int
 * Each block's payload, [L][2][n_heads][run_bytes], copied run by run to its slot in L
 * per-layer arrays laid out [n_slots][n_heads][2][run_bytes] (the K and V runs of a head
 * side by side: the layout of a paged KV cache such as vLLM's CPU one), with each
 * envelope's CRC-32C checked in the same pass; returns how many leading blocks are in
 * envelopes that matched their CRC. key_tokens B > 0: each K run, B rows of 2-byte
 * elements, is written as its transpose (vLLM's CPU "vec" layout: D rows of B tokens).
 */
#include "native.h"

PyDoc_STRVAR(scatter_crc_doc,
"scatter_crc(envelopes, payload_offset, layers, block_ids, n_heads, run_bytes,\n"
"            record_bytes=None, key_tokens=0, /) -> int\n\n"
"Copy the block payloads of envelopes, run by run, to their slots in per-layer arrays\n"
"while checking each envelope's CRC-32C in the same pass (a fused copy + CRC); returns\n"
"how many leading blocks are in envelopes that matched their CRC (the copy stops at the first envelope that does not, whose blocks may already\n"
"be partly written). A block's payload is [L][2][n_heads][run_bytes]; an envelope's first\n"
"payload is at `payload_offset`, its CRC (the last 4 bytes, LE) covers every byte before\n"
"it. record_bytes None: each envelope holds one block (bytes after its payload are only\n"
"checksummed). record_bytes >= 0: an envelope holds k >= 1 blocks, their payloads\n"
"`record_bytes` apart, so its length is payload_offset + k * payload + (k - 1) *\n"
"record_bytes + 4. `layers` are the L writable C-contiguous per-layer arrays\n"
"[n_slots][n_heads][2][run_bytes]; the i-th block of the envelopes, in order, goes to\n"
"slot block_ids[i] of each. key_tokens B > 0: each K run is B rows of 2-byte elements\n"
"and is written transposed (D rows of B), its CRC taken over the run as stored. Raises\n"
"ValueError for sizes or ids that do not fit.");

/* dst[c][r] = src[r][c] for a rows x cols array of 2-byte elements: 8x8 tiles through
 * SSE2 unpacks where both sides are multiples of 8 (x86-64's baseline), else element by
 * element. The source is a run just checksummed, so it is read from L1. */
static void transpose_u16(uint8_t *dst, const uint8_t *src, size_t rows, size_t cols) {
#if defined(KV_X86) && defined(__SSE2__)
    if (rows % 8 == 0 && cols % 8 == 0) {
        for (size_t i = 0; i < rows; i += 8)
            for (size_t j = 0; j < cols; j += 8) {
                const uint8_t *s = src + (i * cols + j) * 2;
                size_t sr = cols * 2;
                __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * sr));
                __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * sr));
                __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * sr));
                __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * sr));
                __m128i a4 = _mm_loadu_si128((const __m128i *)(s + 4 * sr));
                __m128i a5 = _mm_loadu_si128((const __m128i *)(s + 5 * sr));
                __m128i a6 = _mm_loadu_si128((const __m128i *)(s + 6 * sr));
                __m128i a7 = _mm_loadu_si128((const __m128i *)(s + 7 * sr));
                __m128i t0 = _mm_unpacklo_epi16(a0, a1), t1 = _mm_unpackhi_epi16(a0, a1);
                __m128i t2 = _mm_unpacklo_epi16(a2, a3), t3 = _mm_unpackhi_epi16(a2, a3);
                __m128i t4 = _mm_unpacklo_epi16(a4, a5), t5 = _mm_unpackhi_epi16(a4, a5);
                __m128i t6 = _mm_unpacklo_epi16(a6, a7), t7 = _mm_unpackhi_epi16(a6, a7);
                __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2);
                __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3);
                __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6);
                __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
                uint8_t *d = dst + (j * rows + i) * 2;
                size_t dr = rows * 2;
                _mm_storeu_si128((__m128i *)(d + 0 * dr), _mm_unpacklo_epi64(u0, u4));
                _mm_storeu_si128((__m128i *)(d + 1 * dr), _mm_unpackhi_epi64(u0, u4));
                _mm_storeu_si128((__m128i *)(d + 2 * dr), _mm_unpacklo_epi64(u1, u5));
                _mm_storeu_si128((__m128i *)(d + 3 * dr), _mm_unpackhi_epi64(u1, u5));
                _mm_storeu_si128((__m128i *)(d + 4 * dr), _mm_unpacklo_epi64(u2, u6));
                _mm_storeu_si128((__m128i *)(d + 5 * dr), _mm_unpackhi_epi64(u2, u6));
                _mm_storeu_si128((__m128i *)(d + 6 * dr), _mm_unpacklo_epi64(u3, u7));
                _mm_storeu_si128((__m128i *)(d + 7 * dr), _mm_unpackhi_epi64(u3, u7));
            }
        return;
    }
#endif
    for (size_t c = 0; c < cols; c++)
        for (size_t r = 0; r < rows; r++)
            memcpy(dst + (c * rows + r) * 2, src + (r * cols + c) * 2, 2);
}

/* The envelope walk both scatters share (declared in native.h). */
Py_ssize_t envelope_blocks(const char *name, PyObject *seq, Py_buffer *envs, Py_ssize_t *counts,
                           size_t off, size_t payload, Py_ssize_t rec, Py_ssize_t *got) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 0;
    for (; *got < n; (*got)++) {
        Py_ssize_t i = *got;
        if (get_contiguous(PySequence_Fast_GET_ITEM(seq, i), &envs[i]) < 0)
            return -1;
        size_t len = (size_t)envs[i].len;
        if (payload == 0 || len < off + payload + 4) {
            (*got)++;
            PyErr_Format(PyExc_ValueError,
                         "%s: envelope %zd has %zd bytes, fewer than its payload needs", name,
                         i, envs[i].len);
            return -1;
        }
        counts[i] = 1;
        if (rec >= 0) { /* len - off - 4 == k * payload + (k - 1) * rec */
            size_t stride = payload + (size_t)rec;
            size_t span = len - off - 4 + (size_t)rec;
            if (span % stride != 0) {
                (*got)++;
                PyErr_Format(PyExc_ValueError,
                             "%s: envelope %zd has %zd bytes, not a whole number of blocks",
                             name, i, envs[i].len);
                return -1;
            }
            counts[i] = (Py_ssize_t)(span / stride);
        }
        total += counts[i];
    }
    return total;
}

Py_ssize_t scatter_envelopes_run(crc_kernel_fn fn, Py_buffer *envs, const Py_ssize_t *counts,
                                 Py_ssize_t n, size_t off, size_t rec, size_t payload,
                                 block_scatter_fn scatter, const void *ctx) {
    Py_ssize_t done = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *env = (const uint8_t *)envs[i].buf;
        const uint8_t *end = env + envs[i].len - 4;
        uint32_t crc = fn(0xFFFFFFFFu, env, off);
        const uint8_t *src = env + off;
        for (Py_ssize_t j = 0; j < counts[i]; j++) {
            if (j > 0) {
                crc = fn(crc, src, rec);
                src += rec;
            }
            crc = scatter(ctx, crc, src, done + j);
            src += payload;
        }
        crc = ~fn(crc, src, (size_t)(end - src));
        uint32_t stored = (uint32_t)end[0] | (uint32_t)end[1] << 8 | (uint32_t)end[2] << 16 |
                          (uint32_t)end[3] << 24;
        if (crc != stored)
            break;
        done += counts[i];
    }
    return done;
}

/* One block's payload, [L][2][heads][run], run by run to its slot in each layer. */
typedef struct {
    crc_kernel_fn fn;
    crc_copy_fn copy;
    uint8_t **layers;
    Py_ssize_t n_layers;
    const Py_ssize_t *ids;
    size_t heads, run, key_tokens;
} layer_slots;

/* Where run r of a block (r = (layer * 2 + K/V) * heads + head) goes in its slot. */
static inline uint8_t *run_slot(const layer_slots *c, Py_ssize_t block, size_t r) {
    size_t slot = c->heads * 2 * c->run, h = r % c->heads, k = r / c->heads % 2;
    return c->layers[r / c->heads / 2] + (size_t)c->ids[block] * slot + (h * 2 + k) * c->run;
}

/* Each run lands in a page of its own in a layer array the forward has just swept out of
 * the caches, so the hardware's prefetchers, which stop at page ends, miss the first lines
 * of every run on both sides. The next run's source and destination are asked for while
 * this one is copied, so a load into cold caches (the engine's case) does not wait on
 * each run's first lines (BENCHMARKS.md, vllm). Prefetches never fault; both addresses
 * lie inside the block. */
#define PREFETCH_MAX ((size_t)16 * 1024) /* a long run's later pages are streamed anyway */
static inline void prefetch_run(uint8_t *dst, const uint8_t *src, size_t n) {
    for (size_t o = 0; o < n && o < PREFETCH_MAX; o += 64) {
        __builtin_prefetch(dst + o, 1, 3);
        __builtin_prefetch(src + o, 0, 3);
    }
}

static uint32_t scatter_block(const void *ctx, uint32_t crc, const uint8_t *src,
                              Py_ssize_t block) {
    const layer_slots *c = (const layer_slots *)ctx;
    size_t runs = (size_t)c->n_layers * 2 * c->heads;
    for (size_t r = 0; r < runs; r++) {
        uint8_t *to = run_slot(c, block, r);
        if (r + 1 < runs)
            prefetch_run(run_slot(c, block, r + 1), src + c->run, c->run);
        if (r / c->heads % 2 == 0 && c->key_tokens) {
            crc = c->fn(crc, src, c->run);
            transpose_u16(to, src, c->key_tokens, c->run / 2 / c->key_tokens);
        } else {
            crc = copy_crc(c->fn, c->copy, crc, to, src, c->run);
        }
        src += c->run;
    }
    return crc;
}

static PyObject *py_scatter_crc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("scatter_crc", nargs, 6, 8) < 0)
        return NULL;
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    Py_ssize_t heads = PyLong_AsSsize_t(args[4]);
    Py_ssize_t run = PyLong_AsSsize_t(args[5]);
    Py_ssize_t rec = -1; /* None: single-block envelopes */
    if (nargs >= 7 && args[6] != Py_None)
        rec = PyLong_AsSsize_t(args[6]);
    Py_ssize_t key_tokens = nargs == 8 ? PyLong_AsSsize_t(args[7]) : 0;
    if (PyErr_Occurred())
        return NULL;
    /* key_tokens > run / 2 first: 2 * key_tokens cannot overflow below it */
    if (key_tokens < 0 ||
        (key_tokens > 0 && (key_tokens > run / 2 || run % (2 * key_tokens) != 0))) {
        PyErr_SetString(PyExc_ValueError, "scatter_crc: key_tokens >= 0, and run_bytes a "
                                          "whole number of rows of key_tokens 2-byte elements");
        return NULL;
    }
    if (off < 0 || heads < 1 || run < 1 || (nargs >= 7 && args[6] != Py_None && rec < 0)) {
        PyErr_SetString(PyExc_ValueError, "scatter_crc: payload_offset >= 0, n_heads >= 1, "
                                          "run_bytes >= 1, record_bytes None or >= 0");
        return NULL;
    }
    PyObject *envs_seq = PySequence_Fast(args[0], "scatter_crc: envelopes is not a sequence");
    PyObject *layers_seq = NULL, *ids_seq = NULL, *result = NULL;
    Py_buffer *envs = NULL, *lays = NULL;
    uint8_t **bases = NULL;
    Py_ssize_t *ids = NULL, *counts = NULL;
    Py_ssize_t got_e = 0, got_l = 0;
    if (envs_seq == NULL)
        return NULL;
    layers_seq = PySequence_Fast(args[2], "scatter_crc: layers is not a sequence");
    ids_seq = layers_seq ? PySequence_Fast(args[3], "scatter_crc: block_ids is not a sequence")
                         : NULL;
    if (ids_seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(envs_seq);
    Py_ssize_t n_ids = PySequence_Fast_GET_SIZE(ids_seq);
    Py_ssize_t n_layers = PySequence_Fast_GET_SIZE(layers_seq);
    if ((rec < 0 && n_ids != n) || n_layers < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "scatter_crc: one block id per envelope and at least one layer");
        goto done;
    }
    envs = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    counts = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    lays = PyMem_Calloc((size_t)n_layers, sizeof(Py_buffer));
    bases = PyMem_Calloc((size_t)n_layers, sizeof(uint8_t *));
    ids = PyMem_Calloc((size_t)n_ids + 1, sizeof(Py_ssize_t));
    if (!envs || !counts || !lays || !bases || !ids) {
        PyErr_NoMemory();
        goto done;
    }
    /* sizes in size_t: the payload of one block and one slot */
    if ((size_t)heads > (size_t)PY_SSIZE_T_MAX / 4 / (size_t)run / (size_t)n_layers) {
        PyErr_SetString(PyExc_ValueError, "scatter_crc: sizes overflow");
        goto done;
    }
    size_t payload = (size_t)n_layers * 2 * (size_t)heads * (size_t)run;
    size_t block = (size_t)heads * 2 * (size_t)run;
    Py_ssize_t n_blocks = -1;
    for (; got_l < n_layers; got_l++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(layers_seq, got_l), &lays[got_l],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        Py_ssize_t len = lays[got_l].len;
        if ((size_t)len % block != 0 || (n_blocks >= 0 && (size_t)len / block != (size_t)n_blocks)) {
            got_l++;
            PyErr_SetString(PyExc_ValueError,
                            "scatter_crc: every layer must hold the same whole number of blocks");
            goto done;
        }
        n_blocks = (Py_ssize_t)((size_t)len / block);
        bases[got_l] = (uint8_t *)lays[got_l].buf;
    }
    for (Py_ssize_t i = 0; i < n_ids; i++) {
        ids[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(ids_seq, i));
        if (ids[i] == -1 && PyErr_Occurred())
            goto done;
        if (ids[i] < 0 || ids[i] >= n_blocks) {
            PyErr_Format(PyExc_ValueError, "scatter_crc: block id %zd is not in 0..%zd", ids[i],
                         n_blocks - 1);
            goto done;
        }
    }
    Py_ssize_t total =
        envelope_blocks("scatter_crc", envs_seq, envs, counts, (size_t)off, payload, rec, &got_e);
    if (total < 0)
        goto done;
    if (total != n_ids) {
        PyErr_Format(PyExc_ValueError,
                     "scatter_crc: the envelopes hold %zd blocks, %zd block ids given", total,
                     n_ids);
        goto done;
    }
    layer_slots ctx = {crc_run, crc_run_copy, bases, n_layers, ids,
                       (size_t)heads, (size_t)run, (size_t)key_tokens};
    Py_ssize_t ok;
    Py_BEGIN_ALLOW_THREADS
    ok = scatter_envelopes_run(crc_run, envs, counts, n, (size_t)off, rec < 0 ? 0 : (size_t)rec,
                               payload, scatter_block, &ctx);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(ok);
done:
    for (Py_ssize_t i = 0; i < got_e; i++)
        PyBuffer_Release(&envs[i]);
    for (Py_ssize_t i = 0; i < got_l; i++)
        PyBuffer_Release(&lays[i]);
    PyMem_Free(envs);
    PyMem_Free(counts);
    PyMem_Free(lays);
    PyMem_Free(bases);
    PyMem_Free(ids);
    Py_XDECREF(ids_seq);
    Py_XDECREF(layers_seq);
    Py_DECREF(envs_seq);
    return result;
}

PyMethodDef scatter_methods[] = {
    {"scatter_crc", (PyCFunction)(void (*)(void))py_scatter_crc, METH_FASTCALL,
     scatter_crc_doc},
    {NULL, NULL, 0, NULL},
};
