/* Small, hot kernels for kvstore: CRC-32C, FNV-1a and the chained block hash, and the
 * f16 finiteness check. Every function takes any C-contiguous buffer (bytes, bytearray,
 * memoryview, mmap, numpy) and releases the GIL for large inputs.
 *
 * crc32c(data, crc=0) -> int
 *   CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, init and final XOR 0xFFFFFFFF),
 *   continuing `crc` exactly like the `crc32c` PyPI package (the value is taken mod 2**32).
 *   x86-64 with SSE4.2+PCLMULQDQ: a "fusion" loop that runs PCLMULQDQ folding of one
 *   region and three CRC32-instruction streams over three more regions at the same time,
 *   then joins the four partial CRCs with carry-less "shift by L bytes" multiplications.
 *   Elsewhere: slicing-by-8 tables.
 * fnv1a64(data, h=0xCBF29CE484222325) -> int
 * fnv_chain(tokens, block_tokens, parent=0) -> bytes    (spec section "Block hash")
 * f16_finite(data) -> bool
 * join_crc(parts) -> bytes     the parts, then the LE CRC-32C of them (an envelope's body
 *                              and trailer in one pass)
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
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
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

static int crc_hw_ok;
static uint32_t fus_shift[FUS_IT_MAX + 1]; /* x^(8*L - 33) mod P, L = it*FUS_X*8 */
static uint64_t k_loop_lo, k_loop_hi;      /* fold 16 bytes forward by FUS_V*16 bytes */
static uint64_t k_16_lo, k_16_hi;          /* fold 16 bytes forward by 16 bytes */

/* Folding a 16-byte accumulator A = lo*x^64 + hi (lo = first 8 bytes) forward by D bytes:
 * clmul(lo, k_lo) = lo*k_lo*x^33 and clmul(hi, k_hi) = hi*k_hi*x^33, so
 * k_lo = x^(8D+31) and k_hi = x^(8D-33) give A*x^(8D) (mod P) in 96 bits. */
static void crc_hw_init(void) {
    k_loop_lo = gf2_xpow(8 * FUS_V * 16 + 31);
    k_loop_hi = gf2_xpow(8 * FUS_V * 16 - 33);
    k_16_lo = gf2_xpow(8 * 16 + 31);
    k_16_hi = gf2_xpow(8 * 16 - 33);
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
#endif /* KV_X86_CRC */

/* CRC-32C with the standard inversions, continuing `crc` (a previous final value). */
static uint32_t crc32c_value(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
#ifdef KV_X86_CRC
    if (crc_hw_ok)
        return ~crc_hw(crc, p, n);
#endif
    return ~crc_sw(crc, p, n);
}

PyDoc_STRVAR(crc32c_doc,
"crc32c(data, crc=0, /) -> int\n\n"
"CRC-32C (Castagnoli) of the bytes of a C-contiguous buffer, continuing `crc` like the\n"
"`crc32c` package: crc32c(b, crc32c(a)) == crc32c(a + b). `crc` is taken mod 2**32.\n"
"Raises BufferError for a non-contiguous buffer.");

static PyObject *py_crc32c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("crc32c", nargs, 1, 2) < 0)
        return NULL;
    uint32_t crc = 0;
    if (nargs == 2) {
        /* Mask like the package's "I" format so any int continues the same way. */
        unsigned long v = PyLong_AsUnsignedLongMask(args[1]);
        if (v == (unsigned long)-1 && PyErr_Occurred())
            return NULL;
        crc = (uint32_t)v;
    }
    Py_buffer view;
    if (get_contiguous(args[0], &view) < 0)
        return NULL;
    const uint8_t *p = (const uint8_t *)view.buf;
    size_t n = (size_t)view.len;
    if (view.len >= KV_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        crc = crc32c_value(crc, p, n);
        Py_END_ALLOW_THREADS
    } else {
        crc = crc32c_value(crc, p, n);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
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

static PyObject *py_fnv_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("fnv_chain", nargs, 2, 3) < 0)
        return NULL;
    /* NULL: clamp instead of raising, so a huge block_tokens just means no full block. */
    Py_ssize_t block_tokens = PyNumber_AsSsize_t(args[1], NULL);
    if (block_tokens == -1 && PyErr_Occurred())
        return NULL;
    if (block_tokens < 1) {
        PyErr_Format(PyExc_ValueError, "block_tokens must be >= 1, found %zd", block_tokens);
        return NULL;
    }
    uint64_t parent = 0;
    if (nargs == 3 && as_u64(args[2], "parent", &parent) < 0)
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
/* join_crc: concatenation with the CRC computed while the data is in cache             */
/* ------------------------------------------------------------------------------------ */

/* Bytes copied before they are CRC'd from the destination: small enough to stay in L1/L2. */
#define JOIN_CHUNK ((size_t)64 * 1024)
#define JOIN_HUGE ((size_t)2 * 1024 * 1024)

/* A large output is fresh anonymous memory: every 4 KiB page faults and is zeroed by the
 * kernel before the copy writes it. Asking for transparent huge pages on its aligned
 * interior (before it is touched) makes that one fault per 2 MiB; where THP is off or
 * "never", the advice is ignored. */
static void advise_huge(uint8_t *p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (n < 4 * JOIN_HUGE)
        return;
    uintptr_t lo = ((uintptr_t)p + JOIN_HUGE - 1) & ~(uintptr_t)(JOIN_HUGE - 1);
    uintptr_t hi = ((uintptr_t)p + n) & ~(uintptr_t)(JOIN_HUGE - 1);
    if (hi > lo)
        (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}

/* Outputs at least this large are written with non-temporal stores: they do not fit in
 * cache anyway, and streaming stores skip the read-for-ownership of every destination
 * line, so the copy moves each byte across the memory bus once each way, as memcpy does
 * for large copies. */
#define JOIN_STREAM_BYTES ((size_t)8 * 1024 * 1024)

#ifdef KV_X86
static void copy_stream(uint8_t *dst, const uint8_t *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 48));
        _mm_stream_si128((__m128i *)(void *)(dst + i), a);
        _mm_stream_si128((__m128i *)(void *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(void *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(void *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}
#endif

/* One contiguous run: CRC'd from the source chunk by chunk (which brings the chunk into
 * cache), then copied. Returns the advanced output pointer. */
static uint8_t *join_span(uint8_t *out, const uint8_t *src, size_t len, uint32_t *crc,
                          int stream) {
    while (len) {
        size_t m = len < JOIN_CHUNK ? len : JOIN_CHUNK;
        *crc = crc32c_value(*crc, src, m);
#ifdef KV_X86
        if (stream)
            copy_stream(out, src, m);
        else
#endif
            memcpy(out, src, m);
        out += m;
        src += m;
        len -= m;
    }
    (void)stream;
    return out;
}

/* A strided buffer in C order: its trailing dimensions that are contiguous form one run,
 * the leading ones are walked with an odometer. */
static uint8_t *join_strided(uint8_t *out, const Py_buffer *v, uint32_t *crc, int stream) {
    int nd = v->ndim;
    Py_ssize_t run = v->itemsize;
    while (nd > 0 && v->strides[nd - 1] == run) {
        run *= v->shape[nd - 1];
        nd--;
    }
    Py_ssize_t idx[64] = {0};
    const uint8_t *base = (const uint8_t *)v->buf;
    for (;;) {
        const uint8_t *p = base;
        for (int k = 0; k < nd; k++)
            p += idx[k] * v->strides[k];
        out = join_span(out, p, (size_t)run, crc, stream);
        int k = nd - 1;
        while (k >= 0 && ++idx[k] == v->shape[k])
            idx[k--] = 0;
        if (k < 0)
            return out;
    }
}

static uint32_t join_run(uint8_t *out, Py_buffer *views, Py_ssize_t n, size_t total) {
    uint32_t crc = 0;
    int stream = total >= JOIN_STREAM_BYTES;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (views[i].len == 0)
            continue;
        if (views[i].strides == NULL || PyBuffer_IsContiguous(&views[i], 'C'))
            out = join_span(out, (const uint8_t *)views[i].buf, (size_t)views[i].len, &crc,
                            stream);
        else
            out = join_strided(out, &views[i], &crc, stream);
    }
#ifdef KV_X86
    if (stream)
        _mm_sfence(); /* the streamed stores are ordered before the bytes are shared */
#endif
    return crc;
}

PyDoc_STRVAR(join_crc_doc,
"join_crc(parts, /) -> bytes\n\n"
"The buffers of the sequence `parts` (C-contiguous, or strided: read in C order)\n"
"concatenated, followed by the\n"
"little-endian CRC-32C of all of them: b''.join(parts) + crc32c(...).to_bytes(4, 'little'),\n"
"in one pass (each chunk is CRC'd right before it is copied, while in cache).");

static PyObject *py_join_crc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("join_crc", nargs, 1, 1) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "join_crc: parts must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    PyObject *result = NULL;
    Py_ssize_t held = 0;
    size_t total = 0;
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++) {
        /* Strided exporters (numpy views) are accepted and read in C order. */
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, held), &views[held],
                               PyBUF_STRIDED_RO) < 0)
            goto done;
        if (views[held].ndim > 64) {
            held++;
            PyErr_SetString(PyExc_BufferError, "join_crc: more than 64 dimensions");
            goto done;
        }
        total += (size_t)views[held].len;
        if (total > (size_t)PY_SSIZE_T_MAX - 4) {
            held++;
            PyErr_NoMemory();
            goto done;
        }
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(total + 4));
    if (result == NULL)
        goto done;
    /* The fresh bytes object is private until returned: filling it without the GIL is
     * safe, and the parts' buffers are held (exports locked) until released below. */
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    uint32_t crc;
    advise_huge(out, total + 4);
    if (total >= (size_t)KV_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        crc = join_run(out, views, n, total);
        Py_END_ALLOW_THREADS
    } else {
        crc = join_run(out, views, n, total);
    }
    for (int b = 0; b < 4; b++)
        out[total + (size_t)b] = (uint8_t)(crc >> (8 * b));
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(seq);
    return result;
}

/* ------------------------------------------------------------------------------------ */
/* Module                                                                                */
/* ------------------------------------------------------------------------------------ */

static PyMethodDef native_methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_FASTCALL, crc32c_doc},
    {"fnv1a64", (PyCFunction)(void (*)(void))py_fnv1a64, METH_FASTCALL, fnv1a64_doc},
    {"fnv_chain", (PyCFunction)(void (*)(void))py_fnv_chain, METH_FASTCALL, fnv_chain_doc},
    {"f16_finite", (PyCFunction)(void (*)(void))py_f16_finite, METH_FASTCALL, f16_finite_doc},
    {"join_crc", (PyCFunction)(void (*)(void))py_join_crc, METH_FASTCALL, join_crc_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "kvstore._native",
    "Compiled kernels: CRC-32C, FNV-1a 64, the chained block hash, f16 finiteness, join+CRC.", -1,
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
#ifdef KV_X86_CRC
        crc_hw_ok = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul");
        if (crc_hw_ok)
            crc_hw_init();
#endif
        ready = 1;
    }
    return PyModule_Create(&native_module);
}
