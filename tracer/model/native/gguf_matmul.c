/* llmtrace's "native" stored kernel: y = x @ W.T with W held in a GGUF's own block bytes.
 *
 * Compiled on first use by llmtrace/tracer/model/native_kernel.py with the system C compiler
 * (-O3 -march=native -fopenmp -ffp-contract=off) and loaded with ctypes; no Python or torch headers.
 *
 * W is N rows of K values, row r at w + r * w_stride, each row the file's blocks for that row (ggml-common.h):
 *   Q4_0 (18 B / 32)  fp16 d, 16 B nibbles                    w = d * (q - 8)
 *   Q4_1 (20 B / 32)  fp16 d, fp16 m, 16 B nibbles            w = d * q + m
 *   Q5_0 (22 B / 32)  fp16 d, 4 B high bits, 16 B nibbles     w = d * (q - 16)
 *   Q5_1 (24 B / 32)  fp16 d, fp16 m, 4 B high bits, 16 B     w = d * q + m
 *   Q8_0 (34 B / 32)  fp16 d, 32 int8                         w = q * d
 *   Q4_K (144 B / 256) fp16 d, fp16 dmin, 12 B 6-bit scales and mins, 128 B nibbles: per 32 values
 *                      w = (d * sc) * q - (dmin * m)
 *   Q5_K (176 B / 256) as Q4_K plus 32 B of fifth bits
 *   Q6_K (210 B / 256) 128 B low nibbles, 64 B high 2 bits, 16 int8 scales, fp16 d: per 16 values
 *                      w = (d * sc) * (q - 32)
 * In a 32-value block the low nibbles of the 16 bytes are values 0-15 and the high nibbles 16-31; in Q4_K/Q5_K
 * bytes 32p..32p+31 hold sub-block 2p in their low nibbles and 2p+1 in their high ones.
 *
 * Exactness. dequantize_row gives exactly the values gguf.quants.dequantize gives: the same fp32 operations in
 * the same order (hence -ffp-contract=off: no multiply-add is fused unless written as one), and d*sc, dmin*m are
 * exact in fp32 (11-bit times 6- or 8-bit). Products are fp32 sums of x times those values, in another order:
 *  - one activation row (decode) with AVX2: the algebra of each block, computed from the bytes in registers:
 *    sum x*(d*q + m) = d * sum(x*q) + m * sum(x), with sum(x) per 32 values taken once per call;
 *  - otherwise (prefill, several rows, or no AVX2): tiles of W dequantized exactly into a buffer that stays in
 *    cache, then every activation row multiplied with the tile, so W's bytes are read once for all rows.
 * Rows of W are split between OpenMP threads (the count is an argument of every call).
 *
 * A part of W described with int8 activations runs the "i8dot" kernel instead (int8_dot.c, #included below): the
 * activation rows rounded to 8-bit integers per 32 values, integer dot products; not exact, see that file. A Q8_0
 * or Q6_K part described with int16 activations runs "i16dot" (int16_dot.c): the same with 16-bit integers.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMT_AVX2 1
#else
#define LLMT_AVX2 0
#endif

#define LLMT_ABI 7 /* bump when a signature below changes: native_kernel.py checks it */

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum { OK = 0, BAD_TYPE = 1, BAD_SHAPE = 2, NO_MEMORY = 3 };
/* How a part's products take the activations: exact fp32, rounded to int8 (i8dot) or to int16 (i16dot: Q8_0, Q6_K) */
enum { EXACT_X = 0, INT8_X = 1, INT16_X = 2 };

/* Work below this many multiply-adds runs on the calling thread: waking a second one costs more. */
#define PARALLEL_MIN_WORK (1 << 16)
/* Bytes of fp32 values per dequantized tile of W: stays in L2 while every activation row passes over it. */
#define TILE_BYTES (64 * 1024)

int llmt_abi(void) { return LLMT_ABI; }

/* 1: the AVX2+FMA+F16C paths are compiled in; 2: OpenMP threads are. */
int llmt_features(void) {
    int features = LLMT_AVX2 ? 1 : 0;
#ifdef _OPENMP
    features |= 2;
#endif
    return features;
}

static int block_shape(int type, int64_t *values, int64_t *bytes) {
    switch (type) {
    case Q4_0: *values = 32; *bytes = 18; return 1;
    case Q4_1: *values = 32; *bytes = 20; return 1;
    case Q5_0: *values = 32; *bytes = 22; return 1;
    case Q5_1: *values = 32; *bytes = 24; return 1;
    case Q8_0: *values = 32; *bytes = 34; return 1;
    case Q4_K: *values = 256; *bytes = 144; return 1;
    case Q5_K: *values = 256; *bytes = 176; return 1;
    case Q6_K: *values = 256; *bytes = 210; return 1;
    default: return 0;
    }
}

/* ---- exact dequantization ---------------------------------------------------------------------------------- */

static inline float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if LLMT_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    float f;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in fp32 */
        f = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (exponent == 0x1F) bits = sign | 0x7F800000u | (mantissa << 13);
    else bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline uint32_t read_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Q4_K/Q5_K's 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes. */
static inline void scale_min_k4(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

static void dequantize_block(int type, const uint8_t *b, float *y) {
    switch (type) {
    case Q4_0: {
        const float d = half_to_float(b);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b[2 + j] & 0x0F) - 8);
            y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
        return;
    }
    case Q4_1: {
        const float d = half_to_float(b), m = half_to_float(b + 2);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(b[4 + j] & 0x0F) + m;
            y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        return;
    }
    case Q5_0: {
        const float d = half_to_float(b);
        const uint32_t qh = read_u32(b + 2);
        for (int j = 0; j < 16; j++) {
            const int lo = (b[6 + j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            const int hi = (b[6 + j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)(lo - 16);
            y[j + 16] = d * (float)(hi - 16);
        }
        return;
    }
    case Q5_1: {
        const float d = half_to_float(b), m = half_to_float(b + 2);
        const uint32_t qh = read_u32(b + 4);
        for (int j = 0; j < 16; j++) {
            const int lo = (b[8 + j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            const int hi = (b[8 + j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        }
        return;
    }
    case Q8_0: {
        const float d = half_to_float(b);
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    case Q4_K:
    case Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t *scales = b + 4;
        const uint8_t *qh = b + 16; /* Q5_K only */
        const uint8_t *qs = type == Q4_K ? b + 16 : b + 48;
        for (int s = 0; s < 8; s++) {
            uint8_t sc, m;
            scale_min_k4(scales, s, &sc, &m);
            const float ds = d * (float)sc, dm = dmin * (float)m;
            const uint8_t *q = qs + 32 * (s / 2);
            const int shift = 4 * (s & 1);
            for (int l = 0; l < 32; l++) {
                int v = (q[l] >> shift) & 0x0F;
                if (type == Q5_K) v |= ((qh[l] >> s) & 1) << 4;
                y[32 * s + l] = ds * (float)v - dm;
            }
        }
        return;
    }
    case Q6_K: {
        const float d = half_to_float(b + 208);
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int half = 0; half < 2; half++) {
            for (int l = 0; l < 32; l++) {
                const int g = l / 16;
                const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = (d * (float)sc[g]) * (float)q1;
                y[l + 32] = (d * (float)sc[g + 2]) * (float)q2;
                y[l + 64] = (d * (float)sc[g + 4]) * (float)q3;
                y[l + 96] = (d * (float)sc[g + 6]) * (float)q4;
            }
            y += 128;
            ql += 64;
            qh += 32;
            sc += 8;
        }
        return;
    }
    default:
        return;
    }
}

static void dequantize_row(int type, const uint8_t *row, int64_t n_blocks, int64_t block_values,
                           int64_t block_bytes, float *y) {
    for (int64_t b = 0; b < n_blocks; b++) dequantize_block(type, row + b * block_bytes, y + b * block_values);
}

/* ---- one activation row: the blocks' algebra, in registers ------------------------------------------------- */

#if LLMT_AVX2

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the sum of 8 int32 lanes (exact while it fits) */
static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* A one-row product streams W from memory once (a decode step reads ~100 MB, far more than the caches hold) and
   does too little arithmetic per byte to hide the wait for each line, so the kernels ask for the bytes
   PREFETCH_BYTES ahead of the ones they read: 1.2-1.3x the one-row streaming rate here (BENCHMARKS "native stored
   kernel"). Each thread reads one contiguous run of rows, so "ahead" is simply further along it; a prefetch past
   the end of W is harmless (it never faults). 4 KB: with the matrices on 2 MiB pages (tracer/load/weight_arena.py)
   a decode step ran a few % faster than with 2 KB, mostly in the Q8_0 LM head (BENCHMARKS "The i8dot kernel's
   eight rows"); on 4 KiB pages the two measured the same. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
static inline void prefetch(const uint8_t *p) { _mm_prefetch((const char *)(p + PREFETCH_BYTES), _MM_HINT_T0); }

static inline __m128i load_u32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm_cvtsi32_si128(v);
}

/* The activation row in the order a kernel unpacks values, made once per call. Unpacking 4-bit values is the
   kernels' main cost, so they take the order that costs fewest instructions and x is permuted to match:
   - NATURAL (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0, Q6_K): the file's order (the 4-bit kernels widen each 8 bytes
     to 32-bit lanes straight from memory, so low and high nibbles come out in order);
   - DWORDS32 (Q5_K): 32 bytes in one register, vector v of a sub-block shifted right by 8v (+4 for the
     high-nibble sub-block): lane i holds value 4i+v of the sub-block.
   NIBBLES16 (no longer used by a kernel here) keeps its place in the enum: callers size their buffers by it. */
enum { NATURAL, NIBBLES16, DWORDS32 };

static int x_order(int type) {
    if (type == Q5_K) return DWORDS32;
    return NATURAL;
}

static void prepare_x(int type, const float *x, int64_t k, float *xs, float *sx) {
    if (x_order(type) == DWORDS32) {
        for (int64_t b = 0; b < k; b += 32)
            for (int v = 0; v < 4; v++)
                for (int i = 0; i < 8; i++) xs[b + 8 * v + i] = x[b + 4 * i + v];
    } else {
        memcpy(xs, x, sizeof(float) * (size_t)k);
    }
    for (int64_t b = 0; b < k; b += 32) {
        const float *xb = x + b;
        const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                       _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
        sx[b / 32] = hsum(s);
    }
}

/* sum over 16 values of x * q, q the 16 bytes of `q` read as signed integers (natural order) */
static inline __m256 dot16_i8(__m128i q, const float *x) {
    const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_loadu_ps(x));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q))),
                           _mm256_loadu_ps(x + 8), a);
}

static inline __m256 dot16_u8(__m128i q, const float *x) {
    const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_loadu_ps(x));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q))),
                           _mm256_loadu_ps(x + 8), a);
}

/* sum over a 32-value block's 16 nibble bytes at qs of x * q (natural order): each 8 bytes widened to 32-bit lanes
   straight from memory, so a lane holds one byte and its high nibble needs only a shift; the four products are
   summed in one chain (the chain's latency is hidden by the next blocks') */
static inline __m256 nibbles_dot(const uint8_t *qs, const float *x) {
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));       /* bytes 0-7 */
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8))); /* bytes 8-15 */
    __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low4)), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low4)), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), _mm256_loadu_ps(x + 24), s);
}

/* Q4_0: sum x*d*(q-8) = d*sum(x*q) + d*(-8*sum x); Q4_1: sum x*(d*q+m) = d*sum(x*q) + m*sum x */
static inline void q4_block(const uint8_t *blk, int has_min, const float *x, float sxb, __m256 *acc, __m128 *off) {
    const __m128 dm = _mm_cvtph_ps(load_u32(blk)); /* d, and m for Q4_1 */
    const __m256 s = nibbles_dot(blk + (has_min ? 4 : 2), x);
    *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), s, *acc);
    if (has_min) *off = _mm_fmadd_ss(_mm_movehdup_ps(dm), _mm_set_ss(sxb), *off);
    else *off = _mm_fmadd_ss(dm, _mm_set_ss(-8.0f * sxb), *off);
}

static inline float q4_row(const uint8_t *row, int64_t n_blocks, int has_min, const float *x, const float *sx) {
    const int64_t bytes = has_min ? 20 : 18;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    __m128 off0 = _mm_setzero_ps(), off1 = off0;
    int64_t b = 0;
    for (; b + 2 <= n_blocks; b += 2) {
        prefetch(row + b * bytes);
        q4_block(row + b * bytes, has_min, x + 32 * b, sx[b], &acc0, &off0);
        q4_block(row + (b + 1) * bytes, has_min, x + 32 * b + 32, sx[b + 1], &acc1, &off1);
    }
    if (b < n_blocks) q4_block(row + b * bytes, has_min, x + 32 * b, sx[b], &acc0, &off0);
    return hsum(_mm256_add_ps(acc0, acc1)) + _mm_cvtss_f32(_mm_add_ss(off0, off1));
}

/* byte i of the result: 0x10 where bit i of `bits` (16 bits) is set, else 0 */
static inline __m128i fifth_bits16(uint32_t bits) {
    const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi16((short)(bits & 0xFFFF)),
                                            _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m128i select = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select), _mm_set1_epi8(0x10));
}

/* Q5_0: d*sum(x*(q-16)); Q5_1: d*sum(x*q) + m*sum x (natural order, bytes widened to 32 bits) */
static inline float q5_row(const uint8_t *row, int64_t n_blocks, int has_min, const float *x, const float *sx) {
    const int64_t bytes = has_min ? 24 : 22;
    const __m128i low4 = _mm_set1_epi8(0x0F), sixteen = _mm_set1_epi8(16);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    __m128 off = _mm_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = row + b * bytes;
        prefetch(blk);
        const __m128 dm = _mm_cvtph_ps(load_u32(blk));
        const uint32_t qh = read_u32(blk + 2 + 2 * has_min);
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 6 + 2 * has_min));
        __m128i lo = _mm_or_si128(_mm_and_si128(v, low4), fifth_bits16(qh));
        __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 4), low4), fifth_bits16(qh >> 16));
        __m256 s;
        if (has_min) {
            s = _mm256_add_ps(dot16_u8(lo, x + 32 * b), dot16_u8(hi, x + 32 * b + 16));
            off = _mm_fmadd_ss(_mm_movehdup_ps(dm), _mm_set_ss(sx[b]), off);
        } else {
            lo = _mm_sub_epi8(lo, sixteen);
            hi = _mm_sub_epi8(hi, sixteen);
            s = _mm256_add_ps(dot16_i8(lo, x + 32 * b), dot16_i8(hi, x + 32 * b + 16));
        }
        if (b & 1) acc1 = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), s, acc1);
        else acc0 = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), s, acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + _mm_cvtss_f32(off);
}

/* Q8_0: d*sum(x*q), each 8 int8 widened to 32-bit lanes straight from memory */
static inline void q8_block(const uint8_t *blk, const float *x, __m256 *acc) {
    const __m256 d = _mm256_broadcastss_ps(_mm_cvtph_ps(load_u32(blk)));
    const uint8_t *q = blk + 2;
    __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))),
                             _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)))),
                        _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16)))),
                        _mm256_loadu_ps(x + 16), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 24)))),
                        _mm256_loadu_ps(x + 24), s);
    *acc = _mm256_fmadd_ps(d, s, *acc);
}

static inline float q8_row(const uint8_t *row, int64_t n_blocks, const float *x) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    int64_t b = 0;
    for (; b + 2 <= n_blocks; b += 2) {
        prefetch(row + b * 34);
        prefetch(row + b * 34 + 64);
        q8_block(row + b * 34, x + 32 * b, &acc0);
        q8_block(row + (b + 1) * 34, x + 32 * b + 32, &acc1);
    }
    if (b < n_blocks) q8_block(row + b * 34, x + 32 * b, &acc0);
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* Q4_K/Q5_K's eight 6-bit scales (sc) and mins (m) of a super-block, as bytes 0..7 of two 64-bit words */
static inline void k4_scales(const uint8_t *packed, uint64_t *sc, uint64_t *m) {
    const uint32_t a = read_u32(packed), b = read_u32(packed + 4), c = read_u32(packed + 8);
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    const uint32_t m_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    *sc = (uint64_t)(a & 0x3F3F3F3Fu) | ((uint64_t)sc_hi << 32);
    *m = (uint64_t)(b & 0x3F3F3F3Fu) | ((uint64_t)m_hi << 32);
}

/* sum over a DWORDS32 sub-block of x * q; `nib` is the 32 bytes shifted so the sub-block's nibble is in bits 0-3
   of byte 0 of each 32-bit lane (bits 8-11 of byte 1...); `high` holds bit 4 of each value at the same places
   (Q5_K; zero for Q4_K) */
static inline __m256 dwords32_dot(__m256i nib, __m256i high, const float *xs) {
    const __m256i low4 = _mm256_set1_epi32(0x0F), bit4 = _mm256_set1_epi32(0x10);
    __m256 p0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(nib, low4),
                                                                 _mm256_and_si256(high, bit4))),
                              _mm256_loadu_ps(xs));
    __m256 p1 = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(nib, 8), low4),
                                           _mm256_and_si256(_mm256_srli_epi32(high, 8), bit4))),
        _mm256_loadu_ps(xs + 8));
    p0 = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(nib, 16), low4),
                                           _mm256_and_si256(_mm256_srli_epi32(high, 16), bit4))),
        _mm256_loadu_ps(xs + 16), p0);
    p1 = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(nib, 24), low4),
                                           _mm256_and_si256(_mm256_srli_epi32(high, 24), bit4))),
        _mm256_loadu_ps(xs + 24), p1);
    return _mm256_add_ps(p0, p1);
}

/* A Q4_K/Q5_K super-block's header, for the exact kernels: its lines prefetched, ds[j] = d * sc_j, and
   mins + (dmin * m_j) * sx[j] per lane (sx: x's sums over the block's eight 32-value sub-blocks) returned */
static inline __m256 k_block_scales(const uint8_t *blk, int bytes, const float *sx, float ds[8], __m256 mins) {
    for (int line = 0; line < bytes; line += 64) prefetch(blk + line);
    const __m128 dd = _mm_cvtph_ps(load_u32(blk)); /* d, dmin */
    uint64_t sc8, m8;
    k4_scales(blk + 4, &sc8, &m8);
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_broadcastss_ps(dd),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)))));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8)));
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), m), _mm256_loadu_ps(sx), mins);
}

/* Q5_K: per sub-block s, (d*sc_s)*sum(x*q) - (dmin*m_s)*sum x, x in DWORDS32 order */
static inline float q5k_row(const uint8_t *row, int64_t n_blocks, const float *xs, const float *sx) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, mins = acc0;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = row + b * 176;
        float ds[8];
        mins = k_block_scales(blk, 176, sx + 8 * b, ds, mins);
        const uint8_t *qs = blk + 48;
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        const float *xb = xs + 256 * b;
        for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            /* fifth bits of sub-blocks 2p and 2p+1: bit 2p (2p+1) of each qh byte moved to bit 4 */
            const __m256i h0 = p < 2 ? _mm256_sll_epi32(qh, _mm_cvtsi32_si128(4 - 2 * p))
                                     : _mm256_srl_epi32(qh, _mm_cvtsi32_si128(2 * p - 4));
            const __m256i h1 = p < 2 ? _mm256_sll_epi32(qh, _mm_cvtsi32_si128(3 - 2 * p))
                                     : _mm256_srl_epi32(qh, _mm_cvtsi32_si128(2 * p - 3));
            const __m256 s0 = dwords32_dot(v, h0, xb + 64 * p);
            const __m256 s1 = dwords32_dot(_mm256_srli_epi32(v, 4), h1, xb + 64 * p + 32);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * p]), s0, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * p + 1]), s1, acc1);
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1)) - hsum(mins);
}

/* sum over 8 bytes at q widened to 32-bit lanes, as low nibbles (lo) and high nibbles (hi), times x: the four
   groups of 8 values of two 32-value sub-blocks at once, each summed in one chain */
static inline void nibbles32_dot(const uint8_t *q, const float *x_lo, const float *x_hi, __m256 *lo, __m256 *hi) {
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    for (int i = 0; i < 4; i++) {
        const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)));
        const __m256 a = _mm256_cvtepi32_ps(_mm256_and_si256(u, low4)), b = _mm256_cvtepi32_ps(_mm256_srli_epi32(u, 4));
        *lo = i ? _mm256_fmadd_ps(a, _mm256_loadu_ps(x_lo + 8 * i), *lo) : _mm256_mul_ps(a, _mm256_loadu_ps(x_lo));
        *hi = i ? _mm256_fmadd_ps(b, _mm256_loadu_ps(x_hi + 8 * i), *hi) : _mm256_mul_ps(b, _mm256_loadu_ps(x_hi));
    }
}

/* Q4_K: per sub-block s, (d*sc_s)*sum(x*q) - (dmin*m_s)*sum x, x in natural order (bytes widened from memory) */
static inline float q4k_row(const uint8_t *row, int64_t n_blocks, const float *x, const float *sx) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, mins = acc0;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = row + b * 144;
        float ds[8];
        mins = k_block_scales(blk, 144, sx + 8 * b, ds, mins);
        const float *xb = x + 256 * b;
        for (int p = 0; p < 4; p++) {
            __m256 s0, s1;
            nibbles32_dot(blk + 16 + 32 * p, xb + 64 * p, xb + 64 * p + 32, &s0, &s1);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * p]), s0, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * p + 1]), s1, acc1);
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1)) - hsum(mins);
}

/* Q6_K: half `half` of the block at blk as four 32-value chunks of unsigned 6-bit codes (0..63): low nibbles of
   ql0, ql1, then high nibbles; bits 2c..2c+1 of qh are chunk c's top two bits (moved to bits 4-5 of each byte).
   The exact kernel (q6k_row) and the int8 one (int8_dot.c) unpack the same way. */
static inline void q6k_codes(const uint8_t *blk, int half, __m256i q[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * half));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, top2));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2));
}

/* Q6_K: per 16 values, (d*sc)*sum(x*(q-32)) (natural order) */
static inline float q6k_row(const uint8_t *row, int64_t n_blocks, const float *x) {
    const __m256i thirty_two = _mm256_set1_epi8(32);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = row + b * 210;
        for (int line = 0; line < 210; line += 64) prefetch(blk + line);
        const __m128i d16 = _mm_cvtsi32_si128(blk[208] | (blk[209] << 8)); /* d ends the block: read no further */
        const __m256 d = _mm256_broadcastss_ps(_mm_cvtph_ps(d16));
        float ds[16];
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        _mm256_storeu_ps(ds, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(ds + 8,
                         _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc)))));
        for (int half = 0; half < 2; half++) {
            __m256i q[4];
            q6k_codes(blk, half, q);
            const float *xh = x + 256 * b + 128 * half;
            for (int c = 0; c < 4; c++) {
                const __m256i qc = _mm256_sub_epi8(q[c], thirty_two);
                const __m256 s0 = dot16_i8(_mm256_castsi256_si128(qc), xh + 32 * c);
                const __m256 s1 = dot16_i8(_mm256_extracti128_si256(qc, 1), xh + 32 * c + 16);
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(ds[8 * half + 2 * c]), s0, acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(ds[8 * half + 2 * c + 1]), s1, acc1);
            }
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* rows first..last of W times the prepared activation row: one loop per type, so each inlines its block code */
static void dot_rows(int type, const uint8_t *w, int64_t w_stride, int64_t first, int64_t last, int64_t n_blocks,
                     const float *xs, const float *sx, float *out) {
    switch (type) {
    case Q4_0: for (int64_t r = first; r < last; r++) out[r] = q4_row(w + r * w_stride, n_blocks, 0, xs, sx); break;
    case Q4_1: for (int64_t r = first; r < last; r++) out[r] = q4_row(w + r * w_stride, n_blocks, 1, xs, sx); break;
    case Q5_0: for (int64_t r = first; r < last; r++) out[r] = q5_row(w + r * w_stride, n_blocks, 0, xs, sx); break;
    case Q5_1: for (int64_t r = first; r < last; r++) out[r] = q5_row(w + r * w_stride, n_blocks, 1, xs, sx); break;
    case Q8_0: for (int64_t r = first; r < last; r++) out[r] = q8_row(w + r * w_stride, n_blocks, xs); break;
    case Q4_K: for (int64_t r = first; r < last; r++) out[r] = q4k_row(w + r * w_stride, n_blocks, xs, sx); break;
    case Q5_K: for (int64_t r = first; r < last; r++) out[r] = q5k_row(w + r * w_stride, n_blocks, xs, sx); break;
    case Q6_K: for (int64_t r = first; r < last; r++) out[r] = q6k_row(w + r * w_stride, n_blocks, xs); break;
    default: break;
    }
}

#endif /* LLMT_AVX2 */

/* ---- several activation rows: exact tiles of W, multiplied in cache ---------------------------------------- */

/* out[i * out_stride + j] = sum_k x[i * k + ...] * w[j * k + ...] for i < m, j < n_rows (w: n_rows x k dense). */
static void multiply_tile(const float *x, int64_t m, const float *w, int64_t n_rows, int64_t k, float *out,
                          int64_t out_stride) {
#if LLMT_AVX2
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
        const float *x0 = x + i * k, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k;
        int64_t j = 0;
        for (; j + 2 <= n_rows; j += 2) {
            const float *w0 = w + j * k, *w1 = w0 + k;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                   a31 = a00;
            for (int64_t c = 0; c < k; c += 8) {
                const __m256 v0 = _mm256_loadu_ps(w0 + c), v1 = _mm256_loadu_ps(w1 + c);
                __m256 u = _mm256_loadu_ps(x0 + c);
                a00 = _mm256_fmadd_ps(u, v0, a00);
                a01 = _mm256_fmadd_ps(u, v1, a01);
                u = _mm256_loadu_ps(x1 + c);
                a10 = _mm256_fmadd_ps(u, v0, a10);
                a11 = _mm256_fmadd_ps(u, v1, a11);
                u = _mm256_loadu_ps(x2 + c);
                a20 = _mm256_fmadd_ps(u, v0, a20);
                a21 = _mm256_fmadd_ps(u, v1, a21);
                u = _mm256_loadu_ps(x3 + c);
                a30 = _mm256_fmadd_ps(u, v0, a30);
                a31 = _mm256_fmadd_ps(u, v1, a31);
            }
            float *o = out + i * out_stride + j;
            o[0] = hsum(a00); o[1] = hsum(a01);
            o[out_stride] = hsum(a10); o[out_stride + 1] = hsum(a11);
            o[2 * out_stride] = hsum(a20); o[2 * out_stride + 1] = hsum(a21);
            o[3 * out_stride] = hsum(a30); o[3 * out_stride + 1] = hsum(a31);
        }
        for (; j < n_rows; j++) {
            const float *w0 = w + j * k;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t c = 0; c < k; c += 8) {
                const __m256 v0 = _mm256_loadu_ps(w0 + c);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + c), v0, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + c), v0, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + c), v0, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + c), v0, a3);
            }
            float *o = out + i * out_stride + j;
            o[0] = hsum(a0); o[out_stride] = hsum(a1); o[2 * out_stride] = hsum(a2); o[3 * out_stride] = hsum(a3);
        }
    }
    for (; i < m; i++) {
        const float *x0 = x + i * k;
        for (int64_t j = 0; j < n_rows; j++) {
            const float *w0 = w + j * k;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            for (int64_t c = 0; c < k; c += 16) { /* k is a multiple of 32 */
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + c), _mm256_loadu_ps(w0 + c), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + c + 8), _mm256_loadu_ps(w0 + c + 8), a1);
            }
            out[i * out_stride + j] = hsum(_mm256_add_ps(a0, a1));
        }
    }
#else
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n_rows; j++) {
            const float *x0 = x + i * k, *w0 = w + j * k;
            float lanes[8] = {0}; /* eight partial sums: the compiler may vectorise them */
            for (int64_t c = 0; c < k; c += 8)
                for (int l = 0; l < 8; l++) lanes[l] += x0[c + l] * w0[c + l];
            float s = 0.0f;
            for (int l = 0; l < 8; l++) s += lanes[l];
            out[i * out_stride + j] = s;
        }
    }
#endif
}

/* ---- entry points ------------------------------------------------------------------------------------------ */

static int thread_count(int threads, double work) {
    if (threads < 1 || work < PARALLEL_MIN_WORK) return 1;
    return threads;
}

/* W as row blocks ("parts") stacked: part p has rows[p] rows of type types[p], row r at w[p] + r * w_strides[p]
   (wq|wk|wv of a Q4_K_M file mixes Q4_K and Q6_K); the parts are multiplied in place, never copied. */
#define MAX_PARTS 8

typedef struct {
    int parts;
    int types[MAX_PARTS];
    const uint8_t *w[MAX_PARTS];
    int64_t strides[MAX_PARTS], rows[MAX_PARTS], row_bytes[MAX_PARTS], column[MAX_PARTS]; /* column: first output */
    int64_t block_values[MAX_PARTS], block_bytes[MAX_PARTS];
    int acts[MAX_PARTS]; /* EXACT_X, INT8_X or INT16_X: how this part's products take the activations */
    int any_int8, any_int16;
    int64_t k, total_rows, total_bytes;
    /* an i8dot Q4_0/Q4_1 part's rows interleaved in eights, or NULL (int8_groups.c) */
    const uint8_t *groups[MAX_PARTS];
} Matrix;

/* Bytes the caller allocates for a Matrix (opaque to it). */
int64_t llmt_matrix_size(void) { return (int64_t)sizeof(Matrix); }

#include "int8_dot.c"
#include "int16_dot.c"

/* Checks and describes W once (the caller keeps `mat` and the blocks alive); every product then passes only `mat`,
   so a call costs what a call must (a decode step makes ~120). acts: per part, EXACT_X, INT8_X (i8dot) or INT16_X
   (i16dot: Q8_0 and Q6_K parts only) (NULL: all exact). */
int llmt_describe(int parts, const int *types, const uint8_t *const *w, const int64_t *strides, const int64_t *rows,
                  int64_t k, const int *acts, Matrix *mat) {
    if (parts < 1 || parts > MAX_PARTS || k <= 0) return BAD_SHAPE;
    mat->k = k;
    mat->parts = parts;
    mat->any_int8 = mat->any_int16 = 0;
    mat->total_rows = mat->total_bytes = 0;
    for (int p = 0; p < parts; p++) {
        int64_t block_values, block_bytes;
        if (!block_shape(types[p], &block_values, &block_bytes)) return BAD_TYPE;
        if (rows[p] < 0 || k % block_values || strides[p] < k / block_values * block_bytes) return BAD_SHAPE;
        mat->types[p] = types[p];
        mat->w[p] = w[p];
        mat->strides[p] = strides[p];
        mat->rows[p] = rows[p];
        mat->row_bytes[p] = k / block_values * block_bytes;
        mat->block_values[p] = block_values;
        mat->block_bytes[p] = block_bytes;
        mat->acts[p] = acts != NULL ? acts[p] : EXACT_X;
        if (mat->acts[p] < EXACT_X || mat->acts[p] > INT16_X ||
            (mat->acts[p] == INT16_X && types[p] != Q8_0 && types[p] != Q6_K))
            return BAD_TYPE;
        mat->any_int8 |= mat->acts[p] == INT8_X;
        mat->any_int16 |= mat->acts[p] == INT16_X;
        mat->groups[p] = NULL; /* llmt_set_groups attaches one */
        mat->column[p] = mat->total_rows;
        mat->total_rows += rows[p];
        mat->total_bytes += rows[p] * mat->row_bytes[p];
    }
    return OK;
}

/* Thread t of `count` takes a contiguous run of the stacked rows holding 1/count of the bytes (a Q6_K row costs
   more than a Q4_K one): rows [*first, *last) of part p. Neighbouring threads' runs meet exactly. */
static void share(const Matrix *mat, int p, int t, int count, int64_t *first, int64_t *last) {
    int64_t before = 0;
    for (int q = 0; q < p; q++) before += mat->rows[q] * mat->row_bytes[q];
    const int64_t start = (int64_t)((double)mat->total_bytes * t / count);
    const int64_t stop = t + 1 == count ? mat->total_bytes : (int64_t)((double)mat->total_bytes * (t + 1) / count);
    /* rows of p whose first byte lies in [start, stop) */
    int64_t lo = start <= before ? 0 : (start - before + mat->row_bytes[p] - 1) / mat->row_bytes[p];
    int64_t hi = stop <= before ? 0 : (stop - before + mat->row_bytes[p] - 1) / mat->row_bytes[p];
    *first = lo < mat->rows[p] ? lo : mat->rows[p];
    *last = hi < mat->rows[p] ? hi : mat->rows[p];
}

static int current_thread(int *count) {
#ifdef _OPENMP
    *count = omp_get_num_threads();
    return omp_get_thread_num();
#else
    *count = 1;
    return 0;
#endif
}

/* out (m x N, row stride N = all parts' rows) = x (m x k, contiguous) @ W.T, W described by llmt_describe */
int llmt_matmul(const Matrix *described, const float *x, int64_t m, float *out, int threads) {
    const Matrix mat = *described;
    const int parts = mat.parts;
    const int64_t k = mat.k;
    if (m < 0) return BAD_SHAPE;
    if (mat.total_rows == 0 || m == 0) return OK;
    const int64_t n = mat.total_rows;
    const int team = thread_count(threads, (double)n * (double)k * (double)m);
    int status = OK;
    XBlock *xq = NULL; /* the activation rows quantized for the i8dot parts, once per call */
    X16Block *x16 = NULL; /* and for the i16dot parts */
    if (mat.any_int8) xq = malloc(sizeof(XBlock) * (size_t)(m * (k / 32)));
    if (mat.any_int16) x16 = malloc(sizeof(X16Block) * (size_t)(m * (k / 32)));
    if ((mat.any_int8 && xq == NULL) || (mat.any_int16 && x16 == NULL)) {
        free(xq);
        free(x16);
        return NO_MEMORY;
    }
    if (mat.any_int8 || mat.any_int16) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(team) if (team > 1 && m > 1) schedule(static)
#endif
        for (int64_t i = 0; i < m; i++) {
            if (xq != NULL) quantize_x(x + i * k, k, xq + i * (k / 32));
            if (x16 != NULL) quantize_x16(x + i * k, k, x16 + i * (k / 32));
        }
    }
#if LLMT_AVX2
    if (m == 1) {
        /* x in each order a part needs (NATURAL, NIBBLES16, DWORDS32), then its sums per 32 values */
        float *buffer = malloc(sizeof(float) * (size_t)(3 * k + k / 32));
        if (buffer == NULL) {
            free(xq);
            free(x16);
            return NO_MEMORY;
        }
        float *sx = buffer + 3 * k;
        int made[3] = {0, 0, 0};
        for (int p = 0; p < parts; p++) {
            const int order = x_order(mat.types[p]);
            if (mat.acts[p] == EXACT_X && !made[order]) {
                prepare_x(mat.types[p], x, k, buffer + order * k, sx);
                made[order] = 1;
            }
        }
#ifdef _OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
        {
            int count;
            const int t = current_thread(&count);
            for (int p = 0; p < parts; p++) {
                int64_t first, last;
                share(&mat, p, t, count, &first, &last);
                if (mat.acts[p] == INT8_X)
                    i8_dot_rows(&mat, p, first, last, xq, 1, out + mat.column[p], n);
                else if (mat.acts[p] == INT16_X)
                    i16_dot_rows(&mat, p, first, last, x16, 1, out + mat.column[p], n);
                else
                    dot_rows(mat.types[p], mat.w[p], mat.strides[p], first, last, k / mat.block_values[p],
                             buffer + x_order(mat.types[p]) * k, sx, out + mat.column[p]);
            }
        }
        free(buffer);
        free(xq);
        free(x16);
        return OK;
    }
#endif
    int64_t tile = TILE_BYTES / (int64_t)(sizeof(float) * (size_t)k);
    if (tile < 1) tile = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
    {
        int count;
        const int t = current_thread(&count);
        float *buffer = malloc(sizeof(float) * (size_t)(tile * k));
        if (buffer == NULL) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            status = NO_MEMORY;
        } else {
            for (int p = 0; p < parts; p++) {
                int64_t first, last;
                share(&mat, p, t, count, &first, &last);
                if (mat.acts[p] == INT8_X) {
                    i8_dot_rows(&mat, p, first, last, xq, m, out + mat.column[p], n);
                    continue;
                }
                if (mat.acts[p] == INT16_X) {
                    i16_dot_rows(&mat, p, first, last, x16, m, out + mat.column[p], n);
                    continue;
                }
                for (int64_t r = first; r < last; r += tile) {
                    const int64_t count_rows = last - r < tile ? last - r : tile;
                    for (int64_t j = 0; j < count_rows; j++)
                        dequantize_row(mat.types[p], mat.w[p] + (r + j) * mat.strides[p], k / mat.block_values[p],
                                       mat.block_values[p], mat.block_bytes[p], buffer + j * k);
                    multiply_tile(x, m, buffer, count_rows, k, out + mat.column[p] + r, n);
                }
            }
        }
        free(buffer);
    }
    free(xq);
    free(x16);
    return status;
}

/* out (n x k) = rows ids[0..n) of W (rows 0..n when ids is NULL) as fp32, exactly gguf.quants.dequantize's values;
   W has w_rows rows. */
int llmt_dequantize(int type, const uint8_t *w, int64_t w_stride, int64_t w_rows, const int64_t *ids, int64_t n,
                    int64_t k, float *out, int threads) {
    int64_t block_values, block_bytes;
    if (!block_shape(type, &block_values, &block_bytes)) return BAD_TYPE;
    if (n < 0 || k <= 0 || k % block_values || w_stride < k / block_values * block_bytes) return BAD_SHAPE;
    if (ids == NULL && n > w_rows) return BAD_SHAPE;
    for (int64_t i = 0; ids != NULL && i < n; i++)
        if (ids[i] < 0 || ids[i] >= w_rows) return BAD_SHAPE;
    const int64_t n_blocks = k / block_values;
    const int team = thread_count(threads, (double)n * (double)k);
#ifdef _OPENMP
#pragma omp parallel for num_threads(team) if (team > 1) schedule(static)
#endif
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = ids != NULL ? ids[i] : i;
        dequantize_row(type, w + r * w_stride, n_blocks, block_values, block_bytes, out + i * k);
    }
    return OK;
}
