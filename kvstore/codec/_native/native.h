/* What the files of kvstore.codec._native share: includes, the platform's CPU paths, the
 * helpers and the declarations each file exports to the others. One subject per file:
 *
 *   args.c         buffer and argument helpers
 *   crc_kernels.c  the CRC-32C kernels and the choice of one at import (crc_run)
 *   crc32c.c       crc32c(), crc32c_kernel(), crc32c_kernels(), crc32c_with()
 *   join.c         join_crc(): parts copied into one bytes object and checksummed in one
 *                  pass; the page advice of large fresh buffers
 *   scatter.c      scatter_crc(): each block's payload copied, run by run, to its slot in
 *                  per-layer arrays, each envelope's CRC-32C checked in the same pass;
 *                  the envelope walk both scatters share
 *   scatter_views.c scatter_crc_views(): the same into one strided 5-D array per block
 *   builder.c      BytesBuilder: one bytes object filled part by part
 *   fnv.c          fnv1a64(), fnv_chain(), fnv_chain_list(): FNV-1a 64 and the block hash
 *   ints.c         u64_list(): a list of hashes as little-endian u64 bytes
 *   f16.c          f16_finite()
 *   module.c       the module: every file's functions, and the one-time set-up
 *
 * Every function takes any C-contiguous buffer (bytes, bytearray, memoryview, mmap,
 * numpy) and releases the GIL for large inputs. The symbols the files share are hidden:
 * the extension exports PyInit__native only.
 */
#ifndef KV_NATIVE_H
#define KV_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>
#endif

/* The hardware CRC path needs 64-bit CRC32/MOVQ, so it is x86-64 only; i386 and every
 * other architecture use the portable tables. GCC/Clang function attributes let the
 * intrinsics compile without global -m flags; the runtime check picks the path.
 * -DKV_NATIVE_PORTABLE builds only the portable code (to test it on x86). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(KV_NATIVE_PORTABLE)
#define KV_X86 1
#include <immintrin.h>
#endif
#if defined(KV_X86) && defined(__x86_64__)
#define KV_X86_CRC 1
#define KV_CRC_TARGET __attribute__((target("sse4.2,pclmul")))
#define KV_WIDE256_TARGET __attribute__((target("avx2,vpclmulqdq,sse4.2,pclmul")))
#define KV_WIDE512_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2,pclmul")))
#endif

/* Inputs at least this large are processed with the GIL released: below it the
 * release/reacquire costs more than the work. FNV runs at ~1 byte per 4 cycles, so a
 * smaller buffer already takes long enough. */
#define KV_NOGIL_BYTES ((Py_ssize_t)64 * 1024)
#define KV_NOGIL_FNV_BYTES ((Py_ssize_t)8 * 1024)

/* Run the statement `work` with the GIL released when `big` holds (an input large enough
 * that releasing it costs less than the work), else with the GIL held. */
#define KV_RUN_NOGIL_IF(big, work)                                                         \
    do {                                                                                   \
        if (big) {                                                                         \
            Py_BEGIN_ALLOW_THREADS work;                                                   \
            Py_END_ALLOW_THREADS                                                           \
        } else {                                                                           \
            work;                                                                          \
        }                                                                                  \
    } while (0)

#if defined(__GNUC__)
#define KV_HIDDEN __attribute__((visibility("hidden")))
#else
#define KV_HIDDEN
#endif

/* --- args.c ------------------------------------------------------------------------ */

/* `obj`'s buffer, C-contiguous; the caller releases it. -1 with an exception set. */
KV_HIDDEN int get_contiguous(PyObject *obj, Py_buffer *view);
/* An int (or __index__ object) in 0..2**64-1; ValueError naming `what` otherwise. */
KV_HIDDEN int as_u64(PyObject *obj, const char *what, uint64_t *out);
/* TypeError unless lo <= nargs <= hi. */
KV_HIDDEN int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi);

/* Little-endian loads that compile to one unaligned move on LE hosts and stay correct on
 * big-endian ones. */
static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* --- crc_kernels.c ----------------------------------------------------------------- */

/* Every kernel works on the raw register (no pre/post inversion), so that partial results
 * over adjacent regions combine linearly; crc32c_value() adds the inversions. A copy
 * kernel also stores the bytes it reads to dst: one pass for a copy and its CRC. */
typedef uint32_t (*crc_kernel_fn)(uint32_t, const uint8_t *, size_t);
typedef uint32_t (*crc_copy_fn)(uint32_t, uint8_t *, const uint8_t *, size_t);
typedef struct {
    const char *name;
    crc_kernel_fn fn;
    crc_copy_fn copy; /* a fused copy + CRC, or NULL: copy_crc() then works in chunks */
    int usable;       /* set at import from the CPU's features */
} crc_kernel;

KV_HIDDEN extern crc_kernel crc_kernels[]; /* the kernels compiled in, best first */
KV_HIDDEN extern const int n_crc_kernels;
KV_HIDDEN extern crc_kernel_fn crc_run; /* the first usable kernel: the one crc32c() runs */
KV_HIDDEN extern crc_copy_fn crc_run_copy;
KV_HIDDEN extern const char *crc_run_name;
/* Build the tables and choose crc_run from the CPU's features (once, under the GIL). */
KV_HIDDEN void crc_init(void);

/* Copy n bytes to dst and continue the raw CRC over them: fused where the kernel has a
 * copy twin, else in chunks small enough that the CRC reads the copy back from L1/L2. */
#define COPY_CRC_CHUNK ((size_t)32 * 1024)
static inline uint32_t copy_crc(crc_kernel_fn fn, crc_copy_fn copy, uint32_t crc, uint8_t *dst,
                                const uint8_t *src, size_t n) {
    if (copy != NULL)
        return copy(crc, dst, src, n);
    while (n) {
        size_t m = n < COPY_CRC_CHUNK ? n : COPY_CRC_CHUNK;
        memcpy(dst, src, m);
        crc = fn(crc, dst, m);
        dst += m;
        src += m;
        n -= m;
    }
    return crc;
}

/* CRC-32C with the standard inversions, continuing `crc` (a previous final value). */
static inline uint32_t crc32c_value(crc_kernel_fn fn, uint32_t crc, const uint8_t *p, size_t n) {
    return ~fn(~crc, p, n);
}

/* --- crc32c.c ---------------------------------------------------------------------- */

/* The optional `crc` argument at args[1] (0 when absent), masked to 32 bits like the
 * crc32c package's "I" format; -1 with an exception set on a non-int. */
KV_HIDDEN int crc_arg(PyObject *const *args, Py_ssize_t nargs, uint32_t *crc);
/* Index of the usable kernel named `name`; -1 with ValueError/TypeError otherwise. */
KV_HIDDEN int crc_kernel_index(PyObject *name);
KV_HIDDEN extern PyMethodDef crc32c_methods[];

/* --- join.c ------------------------------------------------------------------------ */

/* Fault in the pages of [buf, buf + n) for writing with one call (advice only). */
KV_HIDDEN void populate_pages(void *buf, size_t n);
/* Read TLKV_MADVISE_HUGEPAGE (once, under the GIL). */
KV_HIDDEN void join_init(void);
KV_HIDDEN extern PyMethodDef join_methods[];

/* --- scatter.c, builder.c, fnv.c, f16.c -------------------------------------------- */

KV_HIDDEN extern PyMethodDef scatter_methods[];
KV_HIDDEN extern PyMethodDef scatter_views_methods[];
/* The envelopes of the sequence `seq` as buffers envs[0..*got) (the caller releases them),
 * each holding whole blocks of `payload` bytes from `off`: one block each (rec < 0) or
 * k >= 1 blocks `rec` bytes apart; counts[i] its blocks. Returns their total, or -1 with a
 * ValueError that starts with `name`. */
KV_HIDDEN Py_ssize_t envelope_blocks(const char *name, PyObject *seq, Py_buffer *envs,
                                     Py_ssize_t *counts, size_t off, size_t payload,
                                     Py_ssize_t rec, Py_ssize_t *got);
/* Copy one block's payload from `src` (the caller's block number `block`) and continue
 * the raw CRC over it: the part of a scatter that knows where blocks go. */
typedef uint32_t (*block_scatter_fn)(const void *ctx, uint32_t crc, const uint8_t *src,
                                     Py_ssize_t block);
/* Per envelope: the CRC of the bytes before the first payload, each block's payload
 * through `scatter` (fused copy + CRC) and the record before the next one, the bytes
 * after the last; compared with the trailer. Returns how many leading blocks are in
 * envelopes that matched (the walk stops at the first that does not). No GIL needed. */
KV_HIDDEN Py_ssize_t scatter_envelopes_run(crc_kernel_fn fn, Py_buffer *envs,
                                           const Py_ssize_t *counts, Py_ssize_t n, size_t off,
                                           size_t rec, size_t payload, block_scatter_fn scatter,
                                           const void *ctx);
/* Ready the BytesBuilder type and add it to `module`; -1 with an exception set. */
KV_HIDDEN int builder_add(PyObject *module);
KV_HIDDEN extern PyMethodDef fnv_methods[];
KV_HIDDEN extern PyMethodDef ints_methods[];
/* Choose the f16 kernel from the CPU's features (once, under the GIL). */
KV_HIDDEN void f16_init(void);
KV_HIDDEN extern PyMethodDef f16_methods[];

#endif /* KV_NATIVE_H */
