/* The CRC-32C kernels (Castagnoli, reflected polynomial 0x82F63B78), on the raw register
 * (see native.h), and the choice of one at import by CPU features:
 *   "vpclmulqdq-avx512": VPCLMULQDQ folding of 256 bytes per step in four 512-bit
 *     accumulators (x86-64 with AVX-512), with a copy twin for join_crc;
 *   "vpclmulqdq-avx2": the fusion loop below with two 256-bit VPCLMULQDQ accumulators
 *     beside three CRC32-instruction streams (x86-64 with AVX2 and VPCLMULQDQ);
 *   "sse4.2-pclmul": a "fusion" loop that runs PCLMULQDQ folding of one region and three
 *     CRC32-instruction streams over three more regions at the same time, then joins the
 *     four partial CRCs with carry-less "shift by L bytes" multiplications;
 *   "slicing-by-8": portable tables, everywhere else.
 *
 * Polynomial notation used below ("reflected"): a 32-bit value v stands for the polynomial
 * sum(v_i * x^(31-i)) over GF(2), so bit 0 is the x^31 coefficient; a 64-bit value w stands
 * for sum(w_i * x^(63-i)). In this notation _mm_crc32_u64(0, w) == w(x) * x^32 mod P and
 * the carry-less product of two 32-bit values a, b read as a 64-bit value is a*b*x.
 */
#include "native.h"

#define CRC32C_POLY 0x82F63B78u /* reflected 0x1EDC6F41 */

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
 * unit work in parallel where the CPU can overlap them. v4/s3/x3 is corsix/fast-crc32's
 * balance for cores with about one CRC32 and one PCLMULQDQ per cycle; where the two
 * instructions do not overlap (AMD Zen 1) every mix runs at the same speed, so this one
 * costs nothing there (BENCHMARKS.md, "Measurements behind design choices"). */
#define FUS_V 4
#define FUS_S 3
#define FUS_X 3
#define FUS_BLOCK (FUS_V * 16 + FUS_S * FUS_X * 8) /* 136 bytes */
#define FUS_IT_MAX 2048 /* iterations per fused pass (~272 KiB): bounds the table below */
/* Below this the fixed cost of joining the streams (about a dozen carry-less products)
 * outweighs the gain over a single CRC32 stream: the crossover. */
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
 * CRC32-instruction streams run over three more, and the same Horner step joins them:
 * the folding and the CRC32 units are busy at once. FY_V = 2 is the fastest count of
 * accumulators, and this loop beats pure 256-bit folding (BENCHMARKS.md, "Measurements
 * behind design choices"). */
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

/* The kernels compiled in, best first; crc_init() marks those this CPU runs and makes the
 * first of them crc_run. */
crc_kernel crc_kernels[] = {
#ifdef KV_X86_CRC
    {"vpclmulqdq-avx512", crc_wide512, crc_wide512_copy, 0},
    {"vpclmulqdq-avx2", crc_avx2, NULL, 0},
    {"sse4.2-pclmul", crc_hw, NULL, 0},
#endif
    {"slicing-by-8", crc_sw, NULL, 1},
};
const int n_crc_kernels = (int)(sizeof(crc_kernels) / sizeof(crc_kernels[0]));
crc_kernel_fn crc_run = crc_sw;
crc_copy_fn crc_run_copy = NULL;
const char *crc_run_name = "slicing-by-8";

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
    for (int i = 0; i < n_crc_kernels; i++)
        if (crc_kernels[i].usable) {
            crc_run = crc_kernels[i].fn;
            crc_run_copy = crc_kernels[i].copy;
            crc_run_name = crc_kernels[i].name;
            break;
        }
}

void crc_init(void) {
    crc_sw_init();
    crc_select();
}
