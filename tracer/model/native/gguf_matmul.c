/* llmtrace's "native" stored kernel: y = x @ W.T with W held in a GGUF's own blocks (blocks.h: the formats).
 *
 * Compiled on first use by llmtrace/tracer/model/native_kernel.py with the system C compiler
 * (-O3 -march=native -fopenmp -ffp-contract=off), one unit of the library kernels.h lists; no Python or torch headers.
 *
 * Exactness. dequantize_row gives exactly the values gguf.quants.dequantize gives: the same fp32 operations in
 * the same order (hence -ffp-contract=off: no multiply-add is fused unless written as one), and d*sc, dmin*m are
 * exact in fp32 (11-bit times 6- or 8-bit). Products are fp32 sums of x times those values, in another order:
 *  - one activation row (decode) with AVX2: the algebra of each block, computed from the bytes in registers:
 *    sum x*(d*q + m) = d * sum(x*q) + m * sum(x), with sum(x) per 32 values taken once per call;
 *  - otherwise (prefill, several rows): tiles of W dequantized exactly into a buffer that stays in cache, then every
 *    activation row multiplied with the tile, so W's bytes are read once for all rows.
 * The scalar reference (exact_row_reference: a row dequantized, then one plain fp32 dot in eight running sums, the
 * order a build without AVX2 multiplies tiles in) is what a build without AVX2 computes; the vector kernels sum the
 * same terms in another order and algebra, so they agree with it within fp32 summation error (the test's bound).
 * Rows of W are split between OpenMP threads (the count is an argument of every call).
 *
 * A part of W described with int8 activations runs the "i8dot" kernel instead (int8_dot.c): the activation rows
 * rounded to 8-bit integers per 32 values, integer dot products; not exact, see that file. A Q8_0 or Q6_K part
 * described with int16 activations runs "i16dot" (int16_dot.c): the same with 16-bit integers.
 */

#include "kernels.h"

#define LLMT_ABI 8 /* bump when a signature below changes: native_kernel.py checks it */

/* Work below this many multiply-adds runs on the calling thread: waking a second one costs more. */
#define PARALLEL_MIN_WORK (1 << 16)
/* Bytes of fp32 values per dequantized tile of W: stays in L2 while every activation row passes over it. */
#define TILE_BYTES (64 * 1024)

_Static_assert(offsetof(block_q5_K, scales) == offsetof(block_q4_K, scales), "Q4_K and Q5_K share a header");

int llmt_abi(void) { return LLMT_ABI; }

/* 1: the AVX2+FMA+F16C paths are compiled in; 2: OpenMP threads are. */
int llmt_features(void) {
    int features = LLMT_AVX2 ? 1 : 0;
#ifdef _OPENMP
    features |= 2;
#endif
    return features;
}

/* ---- exact dequantization ---------------------------------------------------------------------------------- */

static void dequantize_block(int type, const void *block, float *y) {
    switch (type) {
    case Q4_0: {
        const block_q4_0 *b = block;
        const float d = half_to_float(b->d);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b->qs[j] & 0x0F) - 8);
            y[j + 16] = d * (float)((b->qs[j] >> 4) - 8);
        }
        return;
    }
    case Q4_1: {
        const block_q4_1 *b = block;
        const float d = half_to_float(b->d), m = half_to_float(b->m);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(b->qs[j] & 0x0F) + m;
            y[j + 16] = d * (float)(b->qs[j] >> 4) + m;
        }
        return;
    }
    case Q5_0: {
        const block_q5_0 *b = block;
        const float d = half_to_float(b->d);
        const uint32_t qh = read_u32(b->qh);
        for (int j = 0; j < 16; j++) {
            const int lo = (b->qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            const int hi = (b->qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)(lo - 16);
            y[j + 16] = d * (float)(hi - 16);
        }
        return;
    }
    case Q5_1: {
        const block_q5_1 *b = block;
        const float d = half_to_float(b->d), m = half_to_float(b->m);
        const uint32_t qh = read_u32(b->qh);
        for (int j = 0; j < 16; j++) {
            const int lo = (b->qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            const int hi = (b->qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        }
        return;
    }
    case Q8_0: {
        const block_q8_0 *b = block;
        const float d = half_to_float(b->d);
        for (int j = 0; j < 32; j++) y[j] = (float)b->qs[j] * d;
        return;
    }
    case Q4_K:
    case Q5_K: {
        const block_q4_K *b4 = block;
        const block_q5_K *b5 = block;
        const float d = half_to_float(b4->d), dmin = half_to_float(b4->dmin);
        const uint8_t *qs = type == Q4_K ? b4->qs : b5->qs;
        for (int s = 0; s < 8; s++) {
            uint8_t sc, m;
            scale_min_k4(b4->scales, s, &sc, &m);
            const float ds = d * (float)sc, dm = dmin * (float)m;
            const uint8_t *q = qs + 32 * (s / 2);
            const int shift = 4 * (s & 1);
            for (int l = 0; l < 32; l++) {
                int v = (q[l] >> shift) & 0x0F;
                if (type == Q5_K) v |= ((b5->qh[l] >> s) & 1) << 4;
                y[32 * s + l] = ds * (float)v - dm;
            }
        }
        return;
    }
    case Q6_K: {
        const block_q6_K *b = block;
        const float d = half_to_float(b->d);
        const uint8_t *ql = b->ql, *qh = b->qh;
        const int8_t *sc = b->scales;
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

void dequantize_row(int type, const uint8_t *row, int64_t n_blocks, float *y) {
    int64_t values, bytes;
    if (!block_shape(type, &values, &bytes)) return;
    for (int64_t b = 0; b < n_blocks; b++) dequantize_block(type, row + b * bytes, y + b * values);
}

/* ---- the scalar reference ---------------------------------------------------------------------------------- */

/* sum x[c] * w[c] over k values (a multiple of 8) in eight running sums, added at the end: a build without AVX2
   multiplies its tiles so (the compiler may vectorise the eight) */
static float dot_reference(const float *x, const float *w, int64_t k) {
    float lanes[8] = {0};
    for (int64_t c = 0; c < k; c += 8)
        for (int l = 0; l < 8; l++) lanes[l] += x[c + l] * w[c + l];
    float s = 0.0f;
    for (int l = 0; l < 8; l++) s += lanes[l];
    return s;
}

/* one row of W (n_blocks blocks of `type`) times x: dequantized into `values` (k floats), then dot_reference.
   *magnitude (when not NULL): sum |x| * (|a| |c| + |off|) over the row's values, w = a * c + off as block_codes
   splits them: the size of every term the vector kernels' algebra adds (their error bound's scale). */
static float exact_row_reference(int type, const uint8_t *row, int64_t n_blocks, const float *x, float *values,
                                 double *magnitude) {
    int64_t block_values = 32, bytes = 0;
    block_shape(type, &block_values, &bytes);
    dequantize_row(type, row, n_blocks, values);
    if (magnitude != NULL) {
        double size = 0.0;
        for (int64_t b = 0; b < n_blocks; b++)
            for (int s = 0; s < block_values / 32; s++) {
                int c[32] = {0};
                float a0 = 0.0f, a1 = 0.0f, off = 0.0f;
                block_codes(type, row + b * bytes, s, c, &a0, &a1, &off);
                const float *xs = x + b * block_values + 32 * s;
                for (int l = 0; l < 32; l++)
                    size += fabs((double)xs[l]) * (fabs((double)(l < 16 ? a0 : a1)) * abs(c[l]) + fabs((double)off));
            }
        *magnitude = size;
    }
    return dot_reference(x, values, n_blocks * block_values);
}

/* ---- one activation row: the blocks' algebra, in registers ------------------------------------------------- */

#if LLMT_AVX2

/* The activation row in the order a kernel unpacks values, made once per call. Unpacking 4-bit values is the
   kernels' main cost, so they take the order that costs fewest instructions and x is permuted to match:
   - NATURAL (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0, Q6_K): the file's order (the 4-bit kernels widen each 8 bytes
     to 32-bit lanes straight from memory, so low and high nibbles come out in order);
   - DWORDS32 (Q5_K): 32 bytes in one register, vector v of a sub-block shifted right by 8v (+4 for the
     high-nibble sub-block): lane i holds value 4i+v of the sub-block.
   NIBBLES16 (no longer used by a kernel here) keeps its place in the enum: callers size their buffers by it. */
enum { NATURAL, NIBBLES16, DWORDS32 };

int x_order(int type) { return type == Q5_K ? DWORDS32 : NATURAL; }

void prepare_x(int type, const float *x, int64_t k, float *xs, float *sx) {
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

/* Q4_0: sum x*d*(q-8) = d*sum(x*q) + d*(-8*sum x); Q4_1: sum x*(d*q+m) = d*sum(x*q) + m*sum x. `blk` is a block_q4_0
   or, with has_min, a block_q4_1 (d first in both). */
static inline void q4_block(const void *blk, int has_min, const float *x, float sxb, __m256 *acc, __m128 *off) {
    const __m128 dm = halves2(blk); /* d, and m for Q4_1 */
    const __m256 s = nibbles_dot(has_min ? ((const block_q4_1 *)blk)->qs : ((const block_q4_0 *)blk)->qs, x);
    *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), s, *acc);
    if (has_min) *off = _mm_fmadd_ss(_mm_movehdup_ps(dm), _mm_set_ss(sxb), *off);
    else *off = _mm_fmadd_ss(dm, _mm_set_ss(-8.0f * sxb), *off);
}

/* block b of a Q4_0 (or, with has_min, Q4_1) row */
static inline const void *q4_at(const uint8_t *row, int has_min, int64_t b) {
    return has_min ? (const void *)((const block_q4_1 *)row + b) : (const void *)((const block_q4_0 *)row + b);
}

static inline float q4_row(const uint8_t *row, int64_t n_blocks, int has_min, const float *x, const float *sx) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    __m128 off0 = _mm_setzero_ps(), off1 = off0;
    int64_t b = 0;
    for (; b + 2 <= n_blocks; b += 2) {
        prefetch(q4_at(row, has_min, b));
        q4_block(q4_at(row, has_min, b), has_min, x + 32 * b, sx[b], &acc0, &off0);
        q4_block(q4_at(row, has_min, b + 1), has_min, x + 32 * b + 32, sx[b + 1], &acc1, &off1);
    }
    if (b < n_blocks) q4_block(q4_at(row, has_min, b), has_min, x + 32 * b, sx[b], &acc0, &off0);
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
    const __m128i low4 = _mm_set1_epi8(0x0F), sixteen = _mm_set1_epi8(16);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    __m128 off = _mm_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const block_q5_0 *b0 = (const block_q5_0 *)row + b;
        const block_q5_1 *b1 = (const block_q5_1 *)row + b;
        const void *blk = has_min ? (const void *)b1 : (const void *)b0;
        prefetch(blk);
        const __m128 dm = halves2(blk);
        const uint32_t qh = read_u32(has_min ? b1->qh : b0->qh);
        const __m128i v = _mm_loadu_si128((const __m128i *)(has_min ? b1->qs : b0->qs));
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
static inline void q8_block(const block_q8_0 *blk, const float *x, __m256 *acc) {
    const __m256 d = _mm256_broadcastss_ps(halves2(blk));
    const int8_t *q = blk->qs;
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
    const block_q8_0 *blocks = (const block_q8_0 *)row;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    int64_t b = 0;
    for (; b + 2 <= n_blocks; b += 2) {
        prefetch(blocks + b);
        prefetch((const uint8_t *)(blocks + b) + 64);
        q8_block(blocks + b, x + 32 * b, &acc0);
        q8_block(blocks + b + 1, x + 32 * b + 32, &acc1);
    }
    if (b < n_blocks) q8_block(blocks + b, x + 32 * b, &acc0);
    return hsum(_mm256_add_ps(acc0, acc1));
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

/* A Q4_K/Q5_K super-block's header (the two share it), for the exact kernels: its `bytes` prefetched, ds[j] =
   d * sc_j, and mins + (dmin * m_j) * sx[j] per lane (sx: x's sums over the eight 32-value sub-blocks) returned */
static inline __m256 k_block_scales(const block_q4_K *blk, int bytes, const float *sx, float ds[8], __m256 mins) {
    for (int line = 0; line < bytes; line += 64) prefetch((const uint8_t *)blk + line);
    const __m128 dd = halves2(blk); /* d, dmin */
    uint64_t sc8, m8;
    k4_scales(blk->scales, &sc8, &m8);
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_broadcastss_ps(dd),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)))));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8)));
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), m), _mm256_loadu_ps(sx), mins);
}

/* Q5_K: per sub-block s, (d*sc_s)*sum(x*q) - (dmin*m_s)*sum x, x in DWORDS32 order */
static inline float q5k_row(const uint8_t *row, int64_t n_blocks, const float *xs, const float *sx) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, mins = acc0;
    for (int64_t b = 0; b < n_blocks; b++) {
        const block_q5_K *blk = (const block_q5_K *)row + b;
        float ds[8];
        mins = k_block_scales((const block_q4_K *)blk, sizeof *blk, sx + 8 * b, ds, mins);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)blk->qh);
        const float *xb = xs + 256 * b;
        for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * p));
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
        const block_q4_K *blk = (const block_q4_K *)row + b;
        float ds[8];
        mins = k_block_scales(blk, sizeof *blk, sx + 8 * b, ds, mins);
        const float *xb = x + 256 * b;
        for (int p = 0; p < 4; p++) {
            __m256 s0, s1;
            nibbles32_dot(blk->qs + 32 * p, xb + 64 * p, xb + 64 * p + 32, &s0, &s1);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * p]), s0, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * p + 1]), s1, acc1);
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1)) - hsum(mins);
}

/* Q6_K: per 16 values, (d*sc)*sum(x*(q-32)) (natural order) */
static inline float q6k_row(const uint8_t *row, int64_t n_blocks, const float *x) {
    const __m256i thirty_two = _mm256_set1_epi8(32);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t b = 0; b < n_blocks; b++) {
        const block_q6_K *blk = (const block_q6_K *)row + b;
        for (int line = 0; line < (int)sizeof *blk; line += 64) prefetch((const uint8_t *)blk + line);
        const __m256 d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(blk->d))); /* read no further */
        float ds[16];
        const __m128i sc = _mm_loadu_si128((const __m128i *)blk->scales);
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
void dot_rows(int type, const uint8_t *w, int64_t w_stride, int64_t first, int64_t last, int64_t n_blocks,
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
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n_rows; j++) out[i * out_stride + j] = dot_reference(x + i * k, w + j * k, k);
#endif
}

/* ---- entry points ------------------------------------------------------------------------------------------ */

static int thread_count(int threads, double work) {
    if (threads < 1 || work < PARALLEL_MIN_WORK) return 1;
    return threads;
}

/* Bytes the caller allocates for a Matrix (opaque to it). */
int64_t llmt_matrix_size(void) { return (int64_t)sizeof(Matrix); }

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
                                       buffer + j * k);
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
        dequantize_row(type, w + r * w_stride, n_blocks, out + i * k);
    }
    return OK;
}

/* out (m x N) = x @ W.T as llmt_matmul's, by the scalar reference of each part's kernel on one thread, in any build:
   exact_row_reference, i8_row_reference or i16_row_reference (their activations quantized by the scalar
   quantize_x_reference, quantize_x16_reference). magnitude (m x N, or NULL): each output's sum of the sizes of the
   terms it adds (the references say which), the scale of the bound a test holds the vector kernels to. */
int llmt_matmul_reference(const Matrix *mat, const float *x, int64_t m, float *out, double *magnitude) {
    const int64_t k = mat->k, n = mat->total_rows, xblocks = k / 32;
    float *values = malloc(sizeof(float) * (size_t)k);
    XBlock *xq = malloc(sizeof(XBlock) * (size_t)xblocks);
    X16Block *x16 = malloc(sizeof(X16Block) * (size_t)xblocks);
    if (values == NULL || xq == NULL || x16 == NULL) {
        free(values);
        free(xq);
        free(x16);
        return NO_MEMORY;
    }
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * k;
        quantize_x_reference(xi, k, xq);
        quantize_x16_reference(xi, k, x16);
        for (int p = 0; p < mat->parts; p++) {
            const int64_t n_blocks = k / mat->block_values[p];
            uint8_t *scratch = mat->groups[p] != NULL ? malloc((size_t)mat->row_bytes[p]) : NULL;
            if (mat->groups[p] != NULL && scratch == NULL) {
                free(values);
                free(xq);
                free(x16);
                return NO_MEMORY;
            }
            for (int64_t r = 0; r < mat->rows[p]; r++) {
                const uint8_t *row = part_row(mat, p, r, scratch); /* as stored, wherever the part holds it */
                const int64_t at = i * n + mat->column[p] + r;
                double size = 0.0;
                if (mat->acts[p] == INT8_X) out[at] = i8_row_reference(mat->types[p], row, n_blocks, xq, &size);
                else if (mat->acts[p] == INT16_X) out[at] = i16_row_reference(mat->types[p], row, n_blocks, x16, &size);
                else out[at] = exact_row_reference(mat->types[p], row, n_blocks, xi, values, &size);
                if (magnitude != NULL) magnitude[at] = size;
            }
            free(scratch);
        }
    }
    free(values);
    free(xq);
    free(x16);
    return OK;
}
