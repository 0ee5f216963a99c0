/* join_crc(parts, kernel=None) -> bytes: the parts (contiguous or strided buffers)
 * concatenated + their CRC-32C (LE u32), copied and checksummed in one pass (the envelope
 * writer's last step); join_crc_into(parts, out, kernel=None) writes the same bytes into a
 * caller's buffer (an engine's kept one). A large output is advised onto transparent huge pages, as numpy
 * does for its arrays (TLKV_MADVISE_HUGEPAGE=0 in the environment turns that off), and
 * the pages a large copy lands on are populated with one call (populate_pages, which
 * BytesBuilder uses too).
 */
#include "native.h"

#define JOIN_MAX_DIMS 64

/* Runs shorter than this are copied one after another and checksummed together, up to
 * COPY_CRC_CHUNK bytes at a time, while the copy is still in L1/L2: a fused copy + CRC
 * call per run costs more than the run itself when the run is a row of an engine's
 * transposed page (256 bytes for a head of 128 f16). */
#define STRIDED_SHORT_RUN ((Py_ssize_t)4096)

/* n bytes (fewer than STRIDED_SHORT_RUN) from src to dst: inline 16-byte moves where n is
 * a whole number of them (no call per run), else memcpy. */
static inline void copy_short(uint8_t *dst, const uint8_t *src, size_t n) {
#if defined(KV_X86) && defined(__SSE2__)
    if (n % 16 == 0) {
        for (size_t i = 0; i < n; i += 16)
            _mm_storeu_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* A tile of short runs whose last two dimensions are transposed (the outer one has the
 * smaller stride: an engine's page [B][H][D] seen as [H][B][D]) is copied in the source's
 * order, reading memory forward, and written to its C-order place in dst; then the tile,
 * at most this many bytes, is checksummed while in L1/L2. */
#define TRANSPOSED_TILE_MAX ((Py_ssize_t)256 * 1024)

/* Whether the last two of `nd` dimensions form a transposed tile (see above) of `run`-byte
 * runs. */
static int transposed_tile(const Py_buffer *v, int nd, Py_ssize_t run) {
    if (nd < 2)
        return 0;
    Py_ssize_t sa = v->strides[nd - 2], sb = v->strides[nd - 1];
    Py_ssize_t na = v->shape[nd - 2], nb = v->shape[nd - 1];
    return sa > 0 && sb > sa && na > 1 && nb > 1 && na * nb * run <= TRANSPOSED_TILE_MAX;
}

/* A strided buffer in C order: its trailing dimensions that are contiguous form one run,
 * the leading ones are walked with an odometer. Short runs are copied back to back and
 * checksummed a chunk (or a transposed tile) at a time; longer ones each in one fused
 * copy + CRC. Advances *dst. */
static uint32_t copy_crc_strided(crc_kernel_fn fn, crc_copy_fn copy, uint32_t crc,
                                 uint8_t **dst, const Py_buffer *v) {
    int nd = v->ndim;
    Py_ssize_t run = v->itemsize;
    while (nd > 0 && v->strides[nd - 1] == run) {
        run *= v->shape[nd - 1];
        nd--;
    }
    int short_runs = run < STRIDED_SHORT_RUN;
    int tiles = short_runs && transposed_tile(v, nd, run);
    int walk = tiles ? nd - 2 : nd; /* the dimensions the odometer walks */
    Py_ssize_t idx[JOIN_MAX_DIMS] = {0};
    const uint8_t *base = (const uint8_t *)v->buf;
    uint8_t *pending = *dst; /* short runs copied, not yet checksummed: [pending, *dst) */
    for (;;) {
        const uint8_t *p = base;
        for (int k = 0; k < walk; k++)
            p += idx[k] * v->strides[k];
        if (tiles) {
            Py_ssize_t na = v->shape[nd - 2], nb = v->shape[nd - 1];
            Py_ssize_t sa = v->strides[nd - 2], sb = v->strides[nd - 1];
            for (Py_ssize_t j = 0; j < nb; j++)
                for (Py_ssize_t i = 0; i < na; i++)
                    copy_short(*dst + (i * nb + j) * run, p + j * sb + i * sa, (size_t)run);
            crc = fn(crc, *dst, (size_t)(na * nb * run));
            *dst += na * nb * run;
            pending = *dst;
        } else if (short_runs) {
            copy_short(*dst, p, (size_t)run);
            *dst += run;
            if ((size_t)(*dst - pending) >= COPY_CRC_CHUNK) {
                crc = fn(crc, pending, (size_t)(*dst - pending));
                pending = *dst;
            }
        } else {
            crc = copy_crc(fn, copy, crc, *dst, p, (size_t)run);
            *dst += run;
        }
        int k = walk - 1;
        while (k >= 0 && ++idx[k] == v->shape[k])
            idx[k--] = 0;
        if (k < 0)
            break;
    }
    if (short_runs && *dst > pending)
        crc = fn(crc, pending, (size_t)(*dst - pending));
    return crc;
}

/* Ask for transparent huge pages on the untouched interior of a large fresh output buffer
 * before it is first written: with THP in "madvise" mode (the common default) a bytes
 * object gets 4 KiB pages, and faulting in 65,536 of them for 256 MiB costs more than the
 * copy (numpy advises its own large arrays the same way, and NUMPY_MADVISE_HUGEPAGE=0
 * turns that off; TLKV_MADVISE_HUGEPAGE=0 does the same here: with THP defrag "madvise",
 * a fault may wait for the kernel to compact memory, a rare stall). Advice only: errors
 * are ignored. */
#define KV_HUGE_PAGE ((uintptr_t)2 * 1024 * 1024)
static int advise_huge = 1; /* set at import from TLKV_MADVISE_HUGEPAGE */
static void advise_huge_pages(void *buf, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (!advise_huge || n < 2 * KV_HUGE_PAGE)
        return;
    uintptr_t lo = ((uintptr_t)buf + KV_HUGE_PAGE - 1) & ~(KV_HUGE_PAGE - 1);
    uintptr_t hi = ((uintptr_t)buf + n) & ~(KV_HUGE_PAGE - 1);
    if (hi > lo)
        (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)buf;
    (void)n;
#endif
}

/* Fault in the pages of [buf, buf + n) for writing with one call (MADV_POPULATE_WRITE,
 * Linux 5.14) instead of one page fault per 4 KiB page taken by the copy that follows.
 * Advice only: a kernel without it answers EINVAL once, and the copy faults them in. */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
static int populate_ok = 1;
void populate_pages(void *buf, size_t n) {
#if defined(__linux__)
    if (!populate_ok)
        return;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)buf + page - 1) & ~(page - 1);
    uintptr_t hi = ((uintptr_t)buf + n) & ~(page - 1);
    if (hi > lo && madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE) != 0 && errno == EINVAL)
        populate_ok = 0;
#else
    (void)buf;
    (void)n;
#endif
}

void join_init(void) {
    const char *huge = getenv("TLKV_MADVISE_HUGEPAGE");
    advise_huge = !(huge != NULL && strcmp(huge, "0") == 0);
}

/* The kernel named by the optional argument (one of crc32c_kernels()), or the one
 * crc32c() runs. 0, or -1 with an exception set. */
static int join_kernel(PyObject *name, crc_kernel_fn *fn, crc_copy_fn *copy) {
    *fn = crc_run;
    *copy = crc_run_copy;
    if (name == NULL || name == Py_None)
        return 0;
    int k = crc_kernel_index(name);
    if (k < 0)
        return -1;
    *fn = crc_kernels[k].fn;
    *copy = crc_kernels[k].copy;
    return 0;
}

/* The parts' buffers (strided, read-only), their count and their total size. The caller
 * releases views[0 .. *got) and frees views, whether this fails or not. */
static int join_views(const char *name, PyObject *seq, Py_buffer **views_out,
                      Py_ssize_t *got, Py_ssize_t *total) {
    Py_ssize_t n_parts = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(n_parts ? (size_t)n_parts : 1, sizeof(Py_buffer));
    *views_out = views;
    *got = 0;
    *total = 0;
    if (views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (; *got < n_parts; (*got)++) {
        Py_buffer *v = &views[*got];
        /* Strided exporters (numpy views of an engine's layout) are read in C order. */
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, *got), v, PyBUF_STRIDED_RO) < 0)
            return -1;
        if (v->ndim > JOIN_MAX_DIMS) {
            (*got)++;
            PyErr_Format(PyExc_BufferError, "%s: more than 64 dimensions", name);
            return -1;
        }
        if (v->len > PY_SSIZE_T_MAX - 4 - *total) {
            (*got)++;
            PyErr_NoMemory();
            return -1;
        }
        *total += v->len;
    }
    return 0;
}

/* Copy the parts into dst and write their CRC-32C after them (total + 4 bytes). Runs
 * without the GIL: touches no Python object. */
static void join_fill(crc_kernel_fn fn, crc_copy_fn copy, const Py_buffer *views,
                      Py_ssize_t n_parts, uint8_t *dst) {
    uint32_t crc = 0xFFFFFFFFu;
    for (Py_ssize_t i = 0; i < n_parts; i++) {
        if (views[i].len == 0)
            continue;
        if (views[i].strides == NULL || PyBuffer_IsContiguous(&views[i], 'C')) {
            crc = copy_crc(fn, copy, crc, dst, (const uint8_t *)views[i].buf,
                           (size_t)views[i].len);
            dst += views[i].len;
        } else {
            crc = copy_crc_strided(fn, copy, crc, &dst, &views[i]);
        }
    }
    crc = ~crc;
    for (int k = 0; k < 4; k++)
        dst[k] = (uint8_t)(crc >> (8 * k));
}

/* The lowest and one past the highest address a (possibly strided) buffer reads. */
static void view_extent(const Py_buffer *v, uintptr_t *lo, uintptr_t *hi) {
    uintptr_t base = (uintptr_t)v->buf;
    if (v->strides == NULL || v->ndim == 0) {
        *lo = base;
        *hi = base + (uintptr_t)v->len;
        return;
    }
    Py_ssize_t low = 0, high = v->itemsize;
    for (int k = 0; k < v->ndim; k++) {
        Py_ssize_t reach = (v->shape[k] - 1) * v->strides[k];
        if (reach < 0)
            low += reach;
        else
            high += reach;
    }
    *lo = base + (uintptr_t)low;
    *hi = base + (uintptr_t)high;
}

PyDoc_STRVAR(join_crc_doc,
"join_crc(parts, kernel=None, /) -> bytes\n\n"
"The concatenation of a sequence of buffers (C-contiguous, or strided: read in C order)\n"
"followed by its CRC-32C as 4 little-endian bytes, copied and checksummed in one pass\n"
"(by the named kernel, one of crc32c_kernels(), or the one crc32c() runs).");

static PyObject *py_join_crc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("join_crc", nargs, 1, 2) < 0)
        return NULL;
    crc_kernel_fn fn;
    crc_copy_fn copy;
    if (join_kernel(nargs == 2 ? args[1] : NULL, &fn, &copy) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "join_crc: expected a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_buffer *views = NULL;
    Py_ssize_t got = 0, total = 0;
    PyObject *result = NULL;
    if (join_views("join_crc", seq, &views, &got, &total) < 0)
        goto done;
    result = PyBytes_FromStringAndSize(NULL, total + 4);
    if (result == NULL)
        goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    advise_huge_pages(out, (size_t)total + 4);
    /* The fresh bytes object is private until returned: filling it without the GIL is safe. */
    Py_BEGIN_ALLOW_THREADS
    join_fill(fn, copy, views, got, out);
    Py_END_ALLOW_THREADS
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(join_crc_into_doc,
"join_crc_into(parts, out, kernel=None, /) -> int\n\n"
"join_crc's bytes written into the writable C-contiguous buffer out, from its start: the\n"
"number of bytes written (the parts' total + 4). ValueError, nothing written, when out\n"
"is too small or a part's memory overlaps out's. out is filled without the GIL, as\n"
"numpy's copies are: another thread must not use it meanwhile.");

static PyObject *py_join_crc_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("join_crc_into", nargs, 2, 3) < 0)
        return NULL;
    crc_kernel_fn fn;
    crc_copy_fn copy;
    if (join_kernel(nargs == 3 ? args[2] : NULL, &fn, &copy) < 0)
        return NULL;
    Py_buffer out;
    if (PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "join_crc_into: expected a sequence of buffers");
    if (seq == NULL) {
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_buffer *views = NULL;
    Py_ssize_t got = 0, total = 0;
    PyObject *result = NULL;
    if (join_views("join_crc_into", seq, &views, &got, &total) < 0)
        goto done;
    if (out.len < total + 4) {
        PyErr_Format(PyExc_ValueError, "join_crc_into: out holds %zd bytes, the parts and "
                     "their CRC %zd", out.len, total + 4);
        goto done;
    }
    uintptr_t out_lo = (uintptr_t)out.buf, out_hi = out_lo + (uintptr_t)(total + 4);
    for (Py_ssize_t i = 0; i < got; i++) {
        uintptr_t lo, hi;
        if (views[i].len == 0)
            continue;
        view_extent(&views[i], &lo, &hi);
        if (lo < out_hi && out_lo < hi) {
            PyErr_Format(PyExc_ValueError, "join_crc_into: part %zd overlaps out", i);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    join_fill(fn, copy, views, got, (uint8_t *)out.buf);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(total + 4);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(seq);
    PyBuffer_Release(&out);
    return result;
}

PyMethodDef join_methods[] = {
    {"join_crc", (PyCFunction)(void (*)(void))py_join_crc, METH_FASTCALL, join_crc_doc},
    {"join_crc_into", (PyCFunction)(void (*)(void))py_join_crc_into, METH_FASTCALL,
     join_crc_into_doc},
    {NULL, NULL, 0, NULL},
};
