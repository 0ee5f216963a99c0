/* Small, hot kernels for kvstore: CRC-32C, FNV-1a and the chained block hash, and the
 * f16 finiteness check. Every function takes any C-contiguous buffer (bytes, bytearray,
 * memoryview, mmap, numpy) and releases the GIL for large inputs.
 *
 * crc32c(data, crc=0) -> int
 *   CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, init and final XOR 0xFFFFFFFF),
 *   continuing `crc` exactly like the `crc32c` PyPI package (the value is taken mod 2**32).
 *   One kernel is chosen at import by CPU features (crc32c_kernel() names it):
 *   "vpclmulqdq-avx512": VPCLMULQDQ folding of 256 bytes per step in four 512-bit
 *     accumulators (x86-64 with AVX-512);
 *   "vpclmulqdq-avx2": the fusion loop below with two 256-bit VPCLMULQDQ accumulators
 *     beside three CRC32-instruction streams (x86-64 with AVX2 and VPCLMULQDQ);
 *   "sse4.2-pclmul": a "fusion" loop that runs PCLMULQDQ folding of one region and three
 *     CRC32-instruction streams over three more regions at the same time, then joins the
 *     four partial CRCs with carry-less "shift by L bytes" multiplications;
 *   "slicing-by-8": portable tables, everywhere else.
 * crc32c_kernel() -> str; crc32c_kernels() -> list[str] (compiled in and usable on this
 * CPU, best first); crc32c_with(name, data, crc=0) -> int runs one of them (for tests).
 * join_crc(parts, kernel=None) -> bytes   the parts (contiguous or strided buffers)
 *   concatenated + their CRC-32C (LE u32), copied and checksummed in one pass (the envelope
 *   writer's last step); a large output is advised onto transparent huge pages, as numpy
 *   does for its arrays (TLKV_MADVISE_HUGEPAGE=0 in the environment turns that off)
 * scatter_crc(envelopes, payload_offset, layers, block_ids, n_heads, run_bytes,
 *             record_bytes=None) -> int
 *   envelopes' block payloads copied into a paged cache with each envelope's CRC-32C
 *   checked in the same pass (fused copy + CRC); how many leading blocks matched
 * fnv1a64(data, h=0xCBF29CE484222325) -> int
 * fnv_chain(tokens, block_tokens, parent=0) -> bytes    (spec section "Block hash")
 * fnv_chain_list(tokens, block_tokens, parent=0) -> bytes | None   the same from a list
 * f16_finite(data) -> bool
 * BytesBuilder(capacity=0): write(data), write_at(offset, data), finish() -> bytes   fills
 *   one new bytes object (copies without the GIL, pages populated, no join; see below)
 *
 * Polynomial notation used below ("reflected"): a 32-bit value v stands for the polynomial
 * sum(v_i * x^(31-i)) over GF(2), so bit 0 is the x^31 coefficient; a 64-bit value w stands
 * for sum(w_i * x^(63-i)). In this notation _mm_crc32_u64(0, w) == w(x) * x^32 mod P and
 * the carry-less product of two 32-bit values a, b read as a 64-bit value is a*b*x.
 */
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

/* ------------------------------------------------------------------------------------ */
/* Buffer and argument helpers                                                           */
/* ------------------------------------------------------------------------------------ */

/* PyBUF_SIMPLE already refuses non-contiguous exporters (numpy, memoryview raise); the
 * explicit check also covers a careless third-party exporter, since the kernels read
 * view->len bytes linearly. On success the caller owns `view` and must release it. */
static int get_contiguous(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_BufferError, "buffer is not C-contiguous");
        return -1;
    }
    return 0;
}

/* An int (or __index__ object) in 0..2**64-1; ValueError otherwise, matching the
 * "must fit u64" checks of the pure-Python code. */
static int as_u64(PyObject *obj, const char *what, uint64_t *out) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(idx);
    Py_DECREF(idx);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must fit u64 (0..2**64-1)", what);
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi) {
    if (nargs < lo || nargs > hi) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd positional arguments (%zd given)",
                     name, lo, hi, nargs);
        return -1;
    }
    return 0;
}

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

/* ------------------------------------------------------------------------------------ */
/* CRC-32C                                                                               */
/* ------------------------------------------------------------------------------------ */

#define CRC32C_POLY 0x82F63B78u /* reflected 0x1EDC6F41 */

/* All CRC kernels below work on the raw register (no pre/post inversion) so that partial
 * results over adjacent regions can be combined linearly; crc32c() does the inversions. */

static uint32_t crc_table[8][256]; /* slicing-by-8; crc_table[0] is the bytewise table */

static void crc_sw_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = crc_table[t - 1][i];
            crc_table[t][i] = (c >> 8) ^ crc_table[0][c & 0xFF];
        }
}

/* Portable slicing-by-8: eight independent table lookups per 8-byte word. */
static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t w = load_le64(p) ^ crc;
        crc = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^
              crc_table[5][(w >> 16) & 0xFF] ^ crc_table[4][(w >> 24) & 0xFF] ^
              crc_table[3][(w >> 32) & 0xFF] ^ crc_table[2][(w >> 40) & 0xFF] ^
              crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc;
}

#ifdef KV_X86_CRC
/* Fusion layout, one "iteration" = FUS_BLOCK bytes split over four regions of the input:
 *   [vector region: it * FUS_V*16 bytes][stream 0: L][stream 1: L][stream 2: L],
 *   L = it * FUS_X*8.
 * FUS_V 16-byte accumulators are folded forward with PCLMULQDQ while FUS_S CRC32-
 * instruction streams (FUS_X words each per iteration) run alongside, so the two kinds of
 * unit work in parallel where the CPU can overlap them. v4/s3/x3 is the published
 * balance for Intel cores with ~1 CRC32 and ~1 PCLMULQDQ per cycle (corsix/fast-crc32:
 * ~25 GB/s on Cascade Lake, vs ~15 for either unit alone). On the AMD Zen 1 build
 * machine both instructions are ~2-3 cycles each and do not overlap, so every mix
 * measured (pure folding v4/v8, v4-v8 with s1-s3 and x1-x4, plus slicing-by-8 streams)
 * lands at the same ~10 GB/s ceiling; this one keeps the Intel/Zen 2+ gain for free. */
#define FUS_V 4
#define FUS_S 3
#define FUS_X 3
#define FUS_BLOCK (FUS_V * 16 + FUS_S * FUS_X * 8) /* 136 bytes */
#define FUS_IT_MAX 2048 /* iterations per fused pass (~272 KiB): bounds the table below */
/* Below this the fixed cost of joining the streams (~a dozen carry-less products)
 * outweighs the gain over a single CRC32 stream (measured crossover ~256 bytes). */
#define FUS_MIN_BYTES 256

/* a * b mod P for reflected 32-bit polynomials (shift-and-add; only used at init to
 * build the constants of the hardware path). */
static uint32_t gf2_mulmodp(uint32_t a, uint32_t b) {
    uint32_t prod = 0;
    for (uint32_t m = 0x80000000u; m != 0; m >>= 1) { /* m walks x^0, x^1, ... of a */
        if (a & m)
            prod ^= b;
        b = (b & 1) ? (b >> 1) ^ CRC32C_POLY : b >> 1; /* b *= x */
    }
    return prod;
}

/* x^n mod P by square-and-multiply. */
static uint32_t gf2_xpow(uint64_t n) {
    uint32_t result = 0x80000000u; /* x^0 */
    uint32_t base = 0x40000000u;   /* x^1 */
    while (n) {
        if (n & 1)
            result = gf2_mulmodp(result, base);
        base = gf2_mulmodp(base, base);
        n >>= 1;
    }
    return result;
}

static uint32_t fus_shift[FUS_IT_MAX + 1]; /* x^(8*L - 33) mod P, L = it*FUS_X*8 */
static uint64_t k_loop_lo, k_loop_hi;      /* fold 16 bytes forward by FUS_V*16 bytes */
static uint64_t k_16_lo, k_16_hi;          /* fold 16 bytes forward by 16 bytes */
/* The wide kernels' fold distances, as {k_lo, k_hi} pairs (see crc_hw_init). */
static uint64_t k_wide[6][2];
enum { KW_256, KW_64, KW_48, KW_32, KW_16, KW_COUNT };

/* Folding a 16-byte accumulator A = lo*x^64 + hi (lo = first 8 bytes) forward by D bytes:
 * clmul(lo, k_lo) = lo*k_lo*x^33 and clmul(hi, k_hi) = hi*k_hi*x^33, so
 * k_lo = x^(8D+31) and k_hi = x^(8D-33) give A*x^(8D) (mod P) in 96 bits. */
static void crc_hw_init(void) {
    k_loop_lo = gf2_xpow(8 * FUS_V * 16 + 31);
    k_loop_hi = gf2_xpow(8 * FUS_V * 16 - 33);
    k_16_lo = gf2_xpow(8 * 16 + 31);
    k_16_hi = gf2_xpow(8 * 16 - 33);
    static const unsigned wide_dist[KW_COUNT] = {256, 64, 48, 32, 16};
    for (int i = 0; i < KW_COUNT; i++) {
        k_wide[i][0] = gf2_xpow(8 * wide_dist[i] + 31);
        k_wide[i][1] = gf2_xpow(8 * wide_dist[i] - 33);
    }
    /* Each step multiplies by x^(8 * FUS_X*8), one iteration's worth of one stream. */
    uint32_t step = gf2_xpow(8 * FUS_X * 8);
    fus_shift[0] = 0; /* unused */
    fus_shift[1] = gf2_xpow(8 * FUS_X * 8 - 33);
    for (int it = 2; it <= FUS_IT_MAX; it++)
        fus_shift[it] = gf2_mulmodp(fus_shift[it - 1], step);
}

KV_CRC_TARGET static inline __m128i fold16(__m128i acc, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(acc, k, 0x00), _mm_clmulepi64_si128(acc, k, 0x11));
}

/* crc * x^(8L) mod P given k = x^(8L-33): the product is crc*k*x (64-bit) and the CRC32
 * instruction multiplies by x^32 while reducing. */
KV_CRC_TARGET static inline uint32_t crc_shift(uint32_t crc, uint32_t k) {
    __m128i prod =
        _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)crc), _mm_cvtsi32_si128((int)k), 0x00);
    return (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(prod));
}

/* One CRC32 stream: for short inputs and the tail after the fused passes. */
KV_CRC_TARGET static uint32_t crc_hw_serial(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        c = _mm_crc32_u64(c, load_le64(p));
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--)
        c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}

/* One fused pass over it*FUS_BLOCK bytes (1 <= it <= FUS_IT_MAX), see FUS_V above. */
KV_CRC_TARGET static uint32_t crc_hw_fused(uint32_t crc, const uint8_t *p, size_t it) {
    const size_t L = it * FUS_X * 8;
    const uint8_t *sp = p + it * FUS_V * 16;
    const __m128i k_loop = _mm_set_epi64x((long long)k_loop_hi, (long long)k_loop_lo);
    const __m128i k_16 = _mm_set_epi64x((long long)k_16_hi, (long long)k_16_lo);
    __m128i acc[FUS_V];
    uint64_t c[FUS_S];

    /* The running CRC enters as an XOR into the first 4 message bytes: for the raw
     * register that is the same as having processed everything before. */
    for (int j = 0; j < FUS_V; j++)
        acc[j] = _mm_loadu_si128((const __m128i *)(const void *)(p + 16 * j));
    acc[0] = _mm_xor_si128(acc[0], _mm_cvtsi32_si128((int)crc));
    for (int s = 0; s < FUS_S; s++)
        c[s] = 0;
    for (int x = 0; x < FUS_X; x++)
        for (int s = 0; s < FUS_S; s++)
            c[s] = _mm_crc32_u64(c[s], load_le64(sp + s * L + 8 * x));
    p += FUS_V * 16;
    sp += FUS_X * 8;

    for (size_t i = 1; i < it; i++) {
        for (int j = 0; j < FUS_V; j++)
            acc[j] = _mm_xor_si128(fold16(acc[j], k_loop),
                                   _mm_loadu_si128((const __m128i *)(const void *)(p + 16 * j)));
        for (int x = 0; x < FUS_X; x++)
            for (int s = 0; s < FUS_S; s++)
                c[s] = _mm_crc32_u64(c[s], load_le64(sp + s * L + 8 * x));
        p += FUS_V * 16;
        sp += FUS_X * 8;
    }

    /* Collapse the accumulators (each 16 bytes after the previous) into the last one,
     * then reduce those 16 bytes with the CRC32 instruction itself. */
    for (int j = 1; j < FUS_V; j++)
        acc[j] = _mm_xor_si128(acc[j], fold16(acc[j - 1], k_16));
    uint64_t v = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(acc[FUS_V - 1]));
    __m128i high = _mm_unpackhi_epi64(acc[FUS_V - 1], acc[FUS_V - 1]);
    v = _mm_crc32_u64(v, (uint64_t)_mm_cvtsi128_si64(high));

    /* Horner over the streams: every region is followed by exactly the later streams. */
    uint32_t r = (uint32_t)v;
    const uint32_t k = fus_shift[it];
    for (int s = 0; s < FUS_S; s++)
        r = crc_shift(r, k) ^ (uint32_t)c[s];
    return r;
}

KV_CRC_TARGET static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    if (n >= FUS_MIN_BYTES) {
        while (n >= FUS_BLOCK) {
            size_t it = n / FUS_BLOCK;
            if (it > FUS_IT_MAX)
                it = FUS_IT_MAX;
            crc = crc_hw_fused(crc, p, it);
            p += it * FUS_BLOCK;
            n -= it * FUS_BLOCK;
        }
    }
    return crc_hw_serial(crc, p, n);
}

/* The 512-bit kernel folds 256 bytes per step (16 independent 16-byte lanes, each moved
 * forward by 256 bytes with the same two carry-less products as fold16), then folds the
 * lanes onto the last one, then the remaining 64-byte chunks, and reduces the final 16
 * bytes with the CRC32 instruction, as crc_hw_fused does. Inputs below WIDE_MIN_BYTES
 * take crc_hw in both VPCLMULQDQ kernels: the set-up and the lane reduction cost about
 * as much as folding a few hundred bytes. */
#define WIDE_MIN_BYTES 1024

static inline __m128i wide_pair(int i) {
    return _mm_set_epi64x((long long)k_wide[i][1], (long long)k_wide[i][0]);
}

KV_WIDE512_TARGET static inline __m512i fold512(__m512i acc, __m512i k, __m512i data) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00),
                                     _mm512_clmulepi64_epi128(acc, k, 0x11), data, 0x96);
}

KV_WIDE512_TARGET static uint32_t crc_wide512(uint32_t crc, const uint8_t *p, size_t n) {
    if (n < WIDE_MIN_BYTES)
        return crc_hw(crc, p, n);
    const __m512i k256 = _mm512_broadcast_i32x4(wide_pair(KW_256));
    const __m512i k64 = _mm512_broadcast_i32x4(wide_pair(KW_64));
    __m512i z0 = _mm512_loadu_si512((const void *)p);
    __m512i z1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i z2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i z3 = _mm512_loadu_si512((const void *)(p + 192));
    z0 = _mm512_xor_si512(z0, _mm512_maskz_set1_epi32(1, (int)crc)); /* as in crc_hw_fused */
    p += 256;
    n -= 256;
    while (n >= 256) {
        z0 = fold512(z0, k256, _mm512_loadu_si512((const void *)p));
        z1 = fold512(z1, k256, _mm512_loadu_si512((const void *)(p + 64)));
        z2 = fold512(z2, k256, _mm512_loadu_si512((const void *)(p + 128)));
        z3 = fold512(z3, k256, _mm512_loadu_si512((const void *)(p + 192)));
        p += 256;
        n -= 256;
    }
    z1 = fold512(z0, k64, z1); /* each accumulator covers the 64 bytes after the last */
    z2 = fold512(z1, k64, z2);
    z3 = fold512(z2, k64, z3);
    while (n >= 64) {
        z3 = fold512(z3, k64, _mm512_loadu_si512((const void *)p));
        p += 64;
        n -= 64;
    }
    /* Lanes 0..2 of z3 are 48, 32 and 16 bytes before lane 3: fold each onto it. */
    const __m512i k_lanes = _mm512_inserti32x4(
        _mm512_inserti32x4(_mm512_castsi128_si512(wide_pair(KW_48)), wide_pair(KW_32), 1),
        wide_pair(KW_16), 2);
    __m512i t = _mm512_xor_si512(_mm512_clmulepi64_epi128(z3, k_lanes, 0x00),
                                 _mm512_clmulepi64_epi128(z3, k_lanes, 0x11));
    t = _mm512_mask_mov_epi64(t, 0xC0, z3); /* lane 3 itself, unfolded */
    __m128i a = _mm_xor_si128(
        _mm_xor_si128(_mm512_castsi512_si128(t), _mm512_extracti32x4_epi32(t, 1)),
        _mm_xor_si128(_mm512_extracti32x4_epi32(t, 2), _mm512_extracti32x4_epi32(t, 3)));
    uint64_t v = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    v = _mm_crc32_u64(v, (uint64_t)_mm_extract_epi64(a, 1));
    return crc_hw_serial((uint32_t)v, p, n);
}

KV_WIDE256_TARGET static inline __m256i fold256(__m256i acc, __m256i k, __m256i data) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(acc, k, 0x00),
                                             _mm256_clmulepi64_epi128(acc, k, 0x11)),
                            data);
}

/* The fusion loop of crc_hw_fused with 256-bit accumulators, for CPUs with VPCLMULQDQ
 * but not AVX-512 (Zen 3, Alder Lake): FY_V of them fold one region while FUS_S
 * CRC32-instruction streams run over three more, and the same Horner step joins them.
 * Measured on the AVX-512 build VM (2 MiB, best of 20, nine rounds): pure 256-bit
 * folding with eight accumulators 29.2-29.3 GB/s, the SSE fusion loop 30.9, this loop
 * 44.6-44.7 with FY_V = 2 (3: 43.4, 4: 42.6, 6: 40.0): folding and CRC32 units busy at
 * once. (Adding the streams to the 512-bit kernel gave 58 -> 63-64 GB/s: not kept.) */
#define FY_V 2
#define FY_BLOCK (FY_V * 32 + FUS_S * FUS_X * 8) /* 136 bytes */

KV_WIDE256_TARGET static uint32_t crc_avx2_fused(uint32_t crc, const uint8_t *p, size_t it) {
    const size_t L = it * FUS_X * 8;
    const uint8_t *sp = p + it * FY_V * 32;
    const __m256i k_loop = _mm256_broadcastsi128_si256(wide_pair(KW_64));
    __m256i acc[FY_V];
    uint64_t c[FUS_S];
    for (int j = 0; j < FY_V; j++)
        acc[j] = _mm256_loadu_si256((const __m256i *)(const void *)(p + 32 * j));
    acc[0] = _mm256_xor_si256(acc[0], _mm256_setr_epi32((int)crc, 0, 0, 0, 0, 0, 0, 0));
    for (int s = 0; s < FUS_S; s++)
        c[s] = 0;
    for (int x = 0; x < FUS_X; x++)
        for (int s = 0; s < FUS_S; s++)
            c[s] = _mm_crc32_u64(c[s], load_le64(sp + s * L + 8 * x));
    p += FY_V * 32;
    sp += FUS_X * 8;
    for (size_t i = 1; i < it; i++) {
        for (int j = 0; j < FY_V; j++)
            acc[j] = fold256(acc[j], k_loop,
                             _mm256_loadu_si256((const __m256i *)(const void *)(p + 32 * j)));
        for (int x = 0; x < FUS_X; x++)
            for (int s = 0; s < FUS_S; s++)
                c[s] = _mm_crc32_u64(c[s], load_le64(sp + s * L + 8 * x));
        p += FY_V * 32;
        sp += FUS_X * 8;
    }
    const __m256i k32 = _mm256_broadcastsi128_si256(wide_pair(KW_32));
    for (int j = 1; j < FY_V; j++)
        acc[j] = fold256(acc[j - 1], k32, acc[j]);
    __m256i z = acc[FY_V - 1];
    __m128i a = _mm_xor_si128(fold16(_mm256_castsi256_si128(z), wide_pair(KW_16)),
                              _mm256_extracti128_si256(z, 1));
    uint64_t v = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    v = _mm_crc32_u64(v, (uint64_t)_mm_extract_epi64(a, 1));
    uint32_t r = (uint32_t)v; /* the vector region, then Horner over the streams */
    const uint32_t k = fus_shift[it];
    for (int s = 0; s < FUS_S; s++)
        r = crc_shift(r, k) ^ (uint32_t)c[s];
    return r;
}

KV_WIDE256_TARGET static uint32_t crc_avx2(uint32_t crc, const uint8_t *p, size_t n) {
    if (n < WIDE_MIN_BYTES)
        return crc_hw(crc, p, n);
    while (n >= FY_BLOCK) {
        size_t it = n / FY_BLOCK;
        if (it > FUS_IT_MAX)
            it = FUS_IT_MAX;
        crc = crc_avx2_fused(crc, p, it);
        p += it * FY_BLOCK;
        n -= it * FY_BLOCK;
    }
    return crc_hw_serial(crc, p, n);
}

/* crc_wide512 that also stores every 64 bytes it loads to dst: one pass over the data
 * for a copy and its CRC (the envelope writer's join). */
KV_WIDE512_TARGET static uint32_t crc_wide512_copy(uint32_t crc, uint8_t *dst,
                                                   const uint8_t *p, size_t n) {
    if (n < WIDE_MIN_BYTES) {
        memcpy(dst, p, n);
        return crc_hw(crc, p, n);
    }
    const __m512i k256 = _mm512_broadcast_i32x4(wide_pair(KW_256));
    const __m512i k64 = _mm512_broadcast_i32x4(wide_pair(KW_64));
    __m512i z0 = _mm512_loadu_si512((const void *)p);
    __m512i z1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i z2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i z3 = _mm512_loadu_si512((const void *)(p + 192));
    _mm512_storeu_si512((void *)dst, z0);
    _mm512_storeu_si512((void *)(dst + 64), z1);
    _mm512_storeu_si512((void *)(dst + 128), z2);
    _mm512_storeu_si512((void *)(dst + 192), z3);
    z0 = _mm512_xor_si512(z0, _mm512_maskz_set1_epi32(1, (int)crc));
    p += 256;
    dst += 256;
    n -= 256;
    while (n >= 256) {
        __m512i d0 = _mm512_loadu_si512((const void *)p);
        __m512i d1 = _mm512_loadu_si512((const void *)(p + 64));
        __m512i d2 = _mm512_loadu_si512((const void *)(p + 128));
        __m512i d3 = _mm512_loadu_si512((const void *)(p + 192));
        _mm512_storeu_si512((void *)dst, d0);
        _mm512_storeu_si512((void *)(dst + 64), d1);
        _mm512_storeu_si512((void *)(dst + 128), d2);
        _mm512_storeu_si512((void *)(dst + 192), d3);
        z0 = fold512(z0, k256, d0);
        z1 = fold512(z1, k256, d1);
        z2 = fold512(z2, k256, d2);
        z3 = fold512(z3, k256, d3);
        p += 256;
        dst += 256;
        n -= 256;
    }
    z1 = fold512(z0, k64, z1);
    z2 = fold512(z1, k64, z2);
    z3 = fold512(z2, k64, z3);
    while (n >= 64) {
        __m512i d = _mm512_loadu_si512((const void *)p);
        _mm512_storeu_si512((void *)dst, d);
        z3 = fold512(z3, k64, d);
        p += 64;
        dst += 64;
        n -= 64;
    }
    const __m512i k_lanes = _mm512_inserti32x4(
        _mm512_inserti32x4(_mm512_castsi128_si512(wide_pair(KW_48)), wide_pair(KW_32), 1),
        wide_pair(KW_16), 2);
    __m512i t = _mm512_xor_si512(_mm512_clmulepi64_epi128(z3, k_lanes, 0x00),
                                 _mm512_clmulepi64_epi128(z3, k_lanes, 0x11));
    t = _mm512_mask_mov_epi64(t, 0xC0, z3);
    __m128i a = _mm_xor_si128(
        _mm_xor_si128(_mm512_castsi512_si128(t), _mm512_extracti32x4_epi32(t, 1)),
        _mm_xor_si128(_mm512_extracti32x4_epi32(t, 2), _mm512_extracti32x4_epi32(t, 3)));
    uint64_t v = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    v = _mm_crc32_u64(v, (uint64_t)_mm_extract_epi64(a, 1));
    memcpy(dst, p, n);
    return crc_hw_serial((uint32_t)v, p, n);
}
#endif /* KV_X86_CRC */

/* Every kernel works on the raw register; crc32c_value() adds the inversions. The table
 * lists the kernels compiled in, best first; `usable` is set at import from the CPU's
 * features and the first usable one is the one crc32c() runs. */
typedef uint32_t (*crc_kernel_fn)(uint32_t, const uint8_t *, size_t);
typedef uint32_t (*crc_copy_fn)(uint32_t, uint8_t *, const uint8_t *, size_t);
static struct {
    const char *name;
    crc_kernel_fn fn;
    crc_copy_fn copy; /* a fused copy + CRC, or NULL: copy_crc() then works in chunks */
    int usable;
} crc_kernels[] = {
#ifdef KV_X86_CRC
    {"vpclmulqdq-avx512", crc_wide512, crc_wide512_copy, 0},
    {"vpclmulqdq-avx2", crc_avx2, NULL, 0},
    {"sse4.2-pclmul", crc_hw, NULL, 0},
#endif
    {"slicing-by-8", crc_sw, NULL, 1},
};
#define N_CRC_KERNELS ((int)(sizeof(crc_kernels) / sizeof(crc_kernels[0])))
static crc_kernel_fn crc_run = crc_sw;
static crc_copy_fn crc_run_copy = NULL;
static const char *crc_run_name = "slicing-by-8";

static void crc_select(void) {
#ifdef KV_X86_CRC
    __builtin_cpu_init();
    int base = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul");
    int vpclmul = base && __builtin_cpu_supports("vpclmulqdq");
    crc_kernels[0].usable = vpclmul && __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512vl");
    crc_kernels[1].usable = vpclmul && __builtin_cpu_supports("avx2");
    crc_kernels[2].usable = base;
    if (base)
        crc_hw_init();
#endif
    for (int i = 0; i < N_CRC_KERNELS; i++)
        if (crc_kernels[i].usable) {
            crc_run = crc_kernels[i].fn;
            crc_run_copy = crc_kernels[i].copy;
            crc_run_name = crc_kernels[i].name;
            break;
        }
}

/* Copy n bytes to dst and continue the raw CRC over them: fused where the kernel has a
 * twin, else in chunks small enough that the CRC reads the copy back from L1/L2. */
#define COPY_CRC_CHUNK ((size_t)32 * 1024)
#define JOIN_MAX_DIMS 64

static uint32_t copy_crc(crc_kernel_fn fn, crc_copy_fn copy, uint32_t crc, uint8_t *dst,
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
static uint32_t crc32c_value(crc_kernel_fn fn, uint32_t crc, const uint8_t *p, size_t n) {
    return ~fn(~crc, p, n);
}

PyDoc_STRVAR(crc32c_doc,
"crc32c(data, crc=0, /) -> int\n\n"
"CRC-32C (Castagnoli) of the bytes of a C-contiguous buffer, continuing `crc` like the\n"
"`crc32c` package: crc32c(b, crc32c(a)) == crc32c(a + b). `crc` is taken mod 2**32.\n"
"Raises BufferError for a non-contiguous buffer.");

/* crc32c(data, crc) with a given kernel; `name` only labels argument errors. */
/* The optional `crc` argument at args[1] (0 when absent), masked like the package's "I"
 * format so any int continues the same way; -1 with an exception set on a non-int. */
static int crc_arg(PyObject *const *args, Py_ssize_t nargs, uint32_t *crc) {
    *crc = 0;
    if (nargs < 2)
        return 0;
    unsigned long v = PyLong_AsUnsignedLongMask(args[1]);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    *crc = (uint32_t)v;
    return 0;
}

static PyObject *crc32c_call(crc_kernel_fn fn, const char *name, PyObject *const *args,
                             Py_ssize_t nargs) {
    uint32_t crc;
    if (check_nargs(name, nargs, 1, 2) < 0 || crc_arg(args, nargs, &crc) < 0)
        return NULL;
    Py_buffer view;
    if (get_contiguous(args[0], &view) < 0)
        return NULL;
    const uint8_t *p = (const uint8_t *)view.buf;
    size_t n = (size_t)view.len;
    if (view.len >= KV_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        crc = crc32c_value(fn, crc, p, n);
        Py_END_ALLOW_THREADS
    } else {
        crc = crc32c_value(fn, crc, p, n);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return crc32c_call(crc_run, "crc32c", args, nargs);
}

/* Index of the usable kernel named `name`; -1 with ValueError/TypeError otherwise. */
static int crc_kernel_index(PyObject *name) {
    const char *s = PyUnicode_AsUTF8(name);
    if (s == NULL)
        return -1;
    for (int i = 0; i < N_CRC_KERNELS; i++)
        if (crc_kernels[i].usable && strcmp(crc_kernels[i].name, s) == 0)
            return i;
    PyErr_Format(PyExc_ValueError, "no usable CRC-32C kernel named %R", name);
    return -1;
}

/* A strided buffer in C order: its trailing dimensions that are contiguous form one run,
 * the leading ones are walked with an odometer. Advances *dst. */
static uint32_t copy_crc_strided(crc_kernel_fn fn, crc_copy_fn copy, uint32_t crc,
                                 uint8_t **dst, const Py_buffer *v) {
    int nd = v->ndim;
    Py_ssize_t run = v->itemsize;
    while (nd > 0 && v->strides[nd - 1] == run) {
        run *= v->shape[nd - 1];
        nd--;
    }
    Py_ssize_t idx[JOIN_MAX_DIMS] = {0};
    const uint8_t *base = (const uint8_t *)v->buf;
    for (;;) {
        const uint8_t *p = base;
        for (int k = 0; k < nd; k++)
            p += idx[k] * v->strides[k];
        crc = copy_crc(fn, copy, crc, *dst, p, (size_t)run);
        *dst += run;
        int k = nd - 1;
        while (k >= 0 && ++idx[k] == v->shape[k])
            idx[k--] = 0;
        if (k < 0)
            return crc;
    }
}

/* Ask for transparent huge pages on the untouched interior of a large fresh output buffer
 * before it is first written: with THP in "madvise" mode (the common default) a bytes
 * object gets 4 KiB pages, and faulting in 65,536 of them for 256 MiB costs more than the
 * copy (numpy advises its own large arrays the same way, and NUMPY_MADVISE_HUGEPAGE=0
 * turns that off; TLKV_MADVISE_HUGEPAGE=0 does the same here: with THP defrag "madvise",
 * a fault may wait for the kernel to compact memory, a rare stall of up to ~1 s measured
 * for 256 MiB). Advice only: errors are ignored. */
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
static void populate_pages(void *buf, size_t n) {
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

PyDoc_STRVAR(join_crc_doc,
"join_crc(parts, kernel=None, /) -> bytes\n\n"
"The concatenation of a sequence of buffers (C-contiguous, or strided: read in C order)\n"
"followed by its CRC-32C as 4 little-endian bytes, copied and checksummed in one pass\n"
"(by the named kernel, one of crc32c_kernels(), or the one crc32c() runs).");

static PyObject *py_join_crc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("join_crc", nargs, 1, 2) < 0)
        return NULL;
    crc_kernel_fn fn = crc_run;
    crc_copy_fn copy = crc_run_copy;
    if (nargs == 2 && args[1] != Py_None) {
        int k = crc_kernel_index(args[1]);
        if (k < 0)
            return NULL;
        fn = crc_kernels[k].fn;
        copy = crc_kernels[k].copy;
    }
    PyObject *seq = PySequence_Fast(args[0], "join_crc: expected a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n_parts = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(n_parts ? (size_t)n_parts : 1, sizeof(Py_buffer));
    PyObject *result = NULL;
    Py_ssize_t got = 0, total = 0;
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n_parts; got++) {
        /* Strided exporters (numpy views of an engine's layout) are read in C order. */
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got],
                               PyBUF_STRIDED_RO) < 0)
            goto done;
        if (views[got].ndim > JOIN_MAX_DIMS) {
            got++;
            PyErr_SetString(PyExc_BufferError, "join_crc: more than 64 dimensions");
            goto done;
        }
        if (views[got].len > PY_SSIZE_T_MAX - 4 - total) {
            got++;
            PyErr_NoMemory();
            goto done;
        }
        total += views[got].len;
    }
    result = PyBytes_FromStringAndSize(NULL, total + 4);
    if (result == NULL)
        goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    advise_huge_pages(out, (size_t)total + 4);
    uint32_t crc = 0xFFFFFFFFu;
    /* The fresh bytes object is private until returned: filling it without the GIL is safe. */
    Py_BEGIN_ALLOW_THREADS
    uint8_t *dst = out;
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
    Py_END_ALLOW_THREADS
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(scatter_crc_doc,
"scatter_crc(envelopes, payload_offset, layers, block_ids, n_heads, run_bytes,\n"
"            record_bytes=None, /) -> int\n\n"
"Copy the block payloads of envelopes into a paged cache while checking each envelope's\n"
"CRC-32C in the same pass; returns how many leading blocks are in envelopes that matched\n"
"their CRC (the copy stops at the first envelope that does not, whose blocks may already\n"
"be partly written). A block's payload is [L][2][n_heads][run_bytes]; an envelope's first\n"
"payload is at `payload_offset`, its CRC (the last 4 bytes, LE) covers every byte before\n"
"it. record_bytes None: each envelope holds one block (bytes after its payload are only\n"
"checksummed). record_bytes >= 0: an envelope holds k >= 1 blocks, their payloads\n"
"`record_bytes` apart, so its length is payload_offset + k * payload + (k - 1) *\n"
"record_bytes + 4. `layers` are the L writable C-contiguous per-layer caches\n"
"[num_blocks][n_heads][2][run_bytes]; the i-th block of the envelopes, in order, goes to\n"
"block block_ids[i] of each. Raises ValueError for sizes or ids that do not fit.");

/* Per envelope: the CRC of the bytes before the first payload, then per block the
 * payload's runs in envelope order, each copied to its place in the paged block (fused
 * copy + CRC), and the record between it and the next payload; then the bytes after the
 * last payload; compared with the trailer. counts[i]: envelope i's blocks. */

static Py_ssize_t scatter_crc_run(crc_kernel_fn fn, crc_copy_fn copy, Py_buffer *envs,
                                  const Py_ssize_t *counts, Py_ssize_t n, size_t off, size_t rec,
                                  uint8_t **layers, Py_ssize_t n_layers, const Py_ssize_t *ids,
                                  size_t heads, size_t run) {
    size_t block = heads * 2 * run;
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
            for (Py_ssize_t l = 0; l < n_layers; l++) {
                uint8_t *dst = layers[l] + (size_t)ids[done + j] * block;
                for (size_t k = 0; k < 2; k++)
                    for (size_t h = 0; h < heads; h++) {
                        crc = copy_crc(fn, copy, crc, dst + (h * 2 + k) * run, src, run);
                        src += run;
                    }
            }
        }
        crc = ~fn(crc, src, (size_t)(end - src));
        uint32_t stored = (uint32_t)end[0] | (uint32_t)end[1] << 8 | (uint32_t)end[2] << 16 |
                          (uint32_t)end[3] << 24;
        if (crc != stored)
            return done;
        done += counts[i];
    }
    return done;
}

static PyObject *py_scatter_crc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("scatter_crc", nargs, 6, 7) < 0)
        return NULL;
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    Py_ssize_t heads = PyLong_AsSsize_t(args[4]);
    Py_ssize_t run = PyLong_AsSsize_t(args[5]);
    Py_ssize_t rec = -1; /* None: single-block envelopes */
    if (nargs == 7 && args[6] != Py_None)
        rec = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (off < 0 || heads < 1 || run < 1 || (nargs == 7 && args[6] != Py_None && rec < 0)) {
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
    /* sizes in size_t: the payload of one block and one paged block */
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
    Py_ssize_t total = 0;
    for (; got_e < n; got_e++) {
        if (get_contiguous(PySequence_Fast_GET_ITEM(envs_seq, got_e), &envs[got_e]) < 0)
            goto done;
        size_t len = (size_t)envs[got_e].len;
        if (len < (size_t)off + payload + 4) {
            got_e++;
            PyErr_Format(PyExc_ValueError,
                         "scatter_crc: envelope %zd has %zd bytes, fewer than its payload needs",
                         got_e - 1, envs[got_e - 1].len);
            goto done;
        }
        counts[got_e] = 1;
        if (rec >= 0) { /* len - off - 4 == k * payload + (k - 1) * rec */
            size_t stride = payload + (size_t)rec;
            size_t span = len - (size_t)off - 4 + (size_t)rec;
            if (span % stride != 0) {
                got_e++;
                PyErr_Format(PyExc_ValueError,
                             "scatter_crc: envelope %zd has %zd bytes, not a whole number of "
                             "blocks", got_e - 1, envs[got_e - 1].len);
                goto done;
            }
            counts[got_e] = (Py_ssize_t)(span / stride);
        }
        total += counts[got_e];
    }
    if (total != n_ids) {
        PyErr_Format(PyExc_ValueError,
                     "scatter_crc: the envelopes hold %zd blocks, %zd block ids given", total,
                     n_ids);
        goto done;
    }
    Py_ssize_t ok;
    Py_BEGIN_ALLOW_THREADS
    ok = scatter_crc_run(crc_run, crc_run_copy, envs, counts, n, (size_t)off,
                         rec < 0 ? 0 : (size_t)rec, bases, n_layers, ids, (size_t)heads,
                         (size_t)run);
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

/* BytesBuilder: fills one new bytes object by appends (and patches of what was written),
 * then hands it over with finish(), trimmed to what was written: a received stream becomes
 * one `bytes` with one copy per part and no join. The object is private to the builder
 * until finish() (its only reference), so parts are copied into it without the GIL, and it
 * grows and shrinks in place (_PyBytes_Resize; glibc's realloc of a large block remaps its
 * pages instead of copying them). The pages a large part lands on are populated with one
 * madvise before the copy (populate_pages), and are not advised onto huge pages as
 * join_crc's output is: a fetched envelope is typically built after the process has been
 * idle, and on a VM with free-page reporting (free memory handed back to the host after
 * ~2 s) a huge page must then be backed again by the host: 256 MiB took 0.29-0.55 s with
 * the advice against 0.10-0.11 s without, after 3 s idle (0.03 s with it, 0.11 s without,
 * when the memory had just been freed). One thread at a time: a call while another
 * thread's copy runs raises RuntimeError. */
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

PyDoc_STRVAR(crc32c_kernel_doc,
"crc32c_kernel() -> str\n\n"
"Name of the kernel crc32c() runs, chosen at import from the CPU's features.");

static PyObject *py_crc32c_kernel(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(crc_run_name);
}

PyDoc_STRVAR(crc32c_kernels_doc,
"crc32c_kernels() -> list[str]\n\n"
"Names of the CRC-32C kernels compiled in that this CPU can run, best first.");

static PyObject *py_crc32c_kernels(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *names = PyList_New(0);
    for (int i = 0; names != NULL && i < N_CRC_KERNELS; i++) {
        if (!crc_kernels[i].usable)
            continue;
        PyObject *name = PyUnicode_FromString(crc_kernels[i].name);
        if (name == NULL || PyList_Append(names, name) < 0)
            Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

PyDoc_STRVAR(crc32c_with_doc,
"crc32c_with(kernel, data, crc=0, /) -> int\n\n"
"crc32c(data, crc) computed by the named kernel (one of crc32c_kernels()).\n"
"Raises ValueError for a kernel that is not compiled in or that this CPU cannot run.");

static PyObject *py_crc32c_with(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "crc32c_with() needs a kernel name");
        return NULL;
    }
    int k = crc_kernel_index(args[0]);
    return k < 0 ? NULL : crc32c_call(crc_kernels[k].fn, "crc32c_with", args + 1, nargs - 1);
}

/* ------------------------------------------------------------------------------------ */
/* FNV-1a 64 and the chained block hash                                                  */
/* ------------------------------------------------------------------------------------ */

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
    if (view.len >= KV_NOGIL_FNV_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        h = fnv_bytes(h, p, n);
        Py_END_ALLOW_THREADS
    } else {
        h = fnv_bytes(h, p, n);
    }
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
    if (view.len >= KV_NOGIL_FNV_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        fnv_chain_run(tok, (size_t)n_full, block_bytes, parent, out);
        Py_END_ALLOW_THREADS
    } else {
        fnv_chain_run(tok, (size_t)n_full, block_bytes, parent, out);
    }
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

/* ------------------------------------------------------------------------------------ */
/* f16 finiteness                                                                        */
/* ------------------------------------------------------------------------------------ */

/* An IEEE binary16 is Inf/NaN iff its exponent field (0x7C00) is all ones. Per 16-bit
 * lane, (x & 0x7C00) + 0x0400 reaches 0x8000 exactly in that case and otherwise stays
 * <= 0x7C00, so the add never carries into the next lane: OR the sums together and test
 * the lane sign bits once per chunk. Chunks give an early exit on bad data without a
 * branch per word. Values are read in native byte order, as numpy stores them. */
#define F16_EXP4 0x7C007C007C007C00ULL
#define F16_ONE4 0x0400040004000400ULL
#define F16_SIGN4 0x8000800080008000ULL
#define F16_CHUNK 4096 /* bytes between early-exit checks */

static int f16_finite_swar(const uint8_t *p, size_t n) {
    while (n >= 8) {
        size_t m = n < F16_CHUNK ? n & ~(size_t)7 : F16_CHUNK;
        uint64_t acc = 0;
        for (size_t i = 0; i < m; i += 8) {
            uint64_t w;
            memcpy(&w, p + i, 8);
            acc |= (w & F16_EXP4) + F16_ONE4;
        }
        if (acc & F16_SIGN4)
            return 0;
        p += m;
        n -= m;
    }
    for (size_t i = 0; i + 2 <= n; i += 2) {
        uint16_t v;
        memcpy(&v, p + i, 2);
        if ((v & 0x7C00u) == 0x7C00u)
            return 0;
    }
    return 1;
}

#ifdef KV_X86
static int f16_avx2_ok;

/* Nonzero 16-bit lanes where the exponent field is all ones. */
__attribute__((target("avx2"))) static inline __m256i f16_bad_lanes(const __m256i *q) {
    const __m256i exp = _mm256_set1_epi16(0x7C00);
    return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_loadu_si256(q), exp), exp);
}

/* Same test 32 bytes at a time, four independent accumulators so the loads are not
 * serialized behind one OR chain. */
__attribute__((target("avx2"))) static int f16_finite_avx2(const uint8_t *p, size_t n) {
    while (n >= 128) {
        size_t m = n < F16_CHUNK ? n & ~(size_t)127 : F16_CHUNK;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = 0; i < m; i += 128) {
            const __m256i *q = (const __m256i *)(const void *)(p + i);
            a0 = _mm256_or_si256(a0, f16_bad_lanes(q));
            a1 = _mm256_or_si256(a1, f16_bad_lanes(q + 1));
            a2 = _mm256_or_si256(a2, f16_bad_lanes(q + 2));
            a3 = _mm256_or_si256(a3, f16_bad_lanes(q + 3));
        }
        __m256i a = _mm256_or_si256(_mm256_or_si256(a0, a1), _mm256_or_si256(a2, a3));
        if (!_mm256_testz_si256(a, a))
            return 0;
        p += m;
        n -= m;
    }
    return f16_finite_swar(p, n);
}
#endif

static int f16_finite_run(const uint8_t *p, size_t n) {
#ifdef KV_X86
    if (f16_avx2_ok)
        return f16_finite_avx2(p, n);
#endif
    return f16_finite_swar(p, n);
}

PyDoc_STRVAR(f16_finite_doc,
"f16_finite(data, /) -> bool\n\n"
"True iff no IEEE binary16 value in the C-contiguous buffer (native byte order, byte\n"
"length a multiple of 2) is Inf or NaN. Raises ValueError for an odd byte length.");

static PyObject *py_f16_finite(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("f16_finite", nargs, 1, 1) < 0)
        return NULL;
    Py_buffer view;
    if (get_contiguous(args[0], &view) < 0)
        return NULL;
    if (view.len % 2) {
        PyErr_Format(PyExc_ValueError,
                     "f16_finite: byte length must be a multiple of 2, found %zd", view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)view.buf;
    size_t n = (size_t)view.len;
    int ok;
    if (view.len >= KV_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        ok = f16_finite_run(p, n);
        Py_END_ALLOW_THREADS
    } else {
        ok = f16_finite_run(p, n);
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* ------------------------------------------------------------------------------------ */
/* Module                                                                                */
/* ------------------------------------------------------------------------------------ */

static PyMethodDef native_methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_FASTCALL, crc32c_doc},
    {"crc32c_kernel", py_crc32c_kernel, METH_NOARGS, crc32c_kernel_doc},
    {"join_crc", (PyCFunction)(void (*)(void))py_join_crc, METH_FASTCALL, join_crc_doc},
    {"scatter_crc", (PyCFunction)(void (*)(void))py_scatter_crc, METH_FASTCALL,
     scatter_crc_doc},
    {"crc32c_kernels", py_crc32c_kernels, METH_NOARGS, crc32c_kernels_doc},
    {"crc32c_with", (PyCFunction)(void (*)(void))py_crc32c_with, METH_FASTCALL, crc32c_with_doc},
    {"fnv1a64", (PyCFunction)(void (*)(void))py_fnv1a64, METH_FASTCALL, fnv1a64_doc},
    {"fnv_chain", (PyCFunction)(void (*)(void))py_fnv_chain, METH_FASTCALL, fnv_chain_doc},
    {"f16_finite", (PyCFunction)(void (*)(void))py_f16_finite, METH_FASTCALL, f16_finite_doc},
    {"fnv_chain_list", (PyCFunction)(void (*)(void))py_fnv_chain_list, METH_FASTCALL,
     fnv_chain_list_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "kvstore.codec._native",
    "Compiled kernels: CRC-32C (and join+CRC), FNV-1a 64, the chained block hash (also\n"
    "from a list), f16 finiteness, and a builder of one bytes object.", -1,
    native_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    /* Once per process: init runs under the GIL, and a later init (another interpreter)
     * must not rewrite tables that a GIL-free kernel may be reading. */
    static int ready;
    if (!ready) {
        crc_sw_init();
#ifdef KV_X86
        __builtin_cpu_init();
        f16_avx2_ok = __builtin_cpu_supports("avx2");
#endif
        crc_select();
        const char *huge = getenv("TLKV_MADVISE_HUGEPAGE");
        advise_huge = !(huge != NULL && strcmp(huge, "0") == 0);
        ready = 1;
    }
    if (PyType_Ready(&BytesBuilderType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&BytesBuilderType);
    if (PyModule_AddObject(module, "BytesBuilder", (PyObject *)&BytesBuilderType) < 0) {
        Py_DECREF(&BytesBuilderType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
