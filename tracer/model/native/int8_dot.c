/* llmtrace's "i8dot" stored kernel: y = x @ W.T with W in a GGUF's own blocks and x rounded to 8-bit integers.
 *
 * One unit of the native library (kernels.h), called from gguf_matmul.c's entry points and decode_step.c's products
 * for the parts of a Matrix described with int8 activations.
 *
 * Why: the exact kernel widens every 4-bit value to fp32 and multiplies it with an fp32 activation: about 8 cycles
 * per 32-value block on an AVX2 core, so a decode step is compute-bound below the memory's bandwidth. Here the
 * activation row is quantized once per product, per 32 values (the scheme of ggml's Q8_1 activation blocks):
 *     d = max|x| / 127,  q = round-to-nearest-even(x * 127 / max|x|)  (int8, |q| <= 127),  s = d * sum(q)
 * and each weight block's integer codes c meet q in integer dot products (AVX2: _mm256_maddubs_epi16 of unsigned
 * codes and signed activations, _mm256_madd_epi16 with ones, one conversion, one multiply-add with the two scales).
 * Per 32 values, with the weight's values w = a * c + b (a, b the block's fp32 scale and offset):
 *     sum x*w  ~=  sum (d*q) * (a*c + b)  =  (a*d) * sum(c*q) + b * s
 *   Q4_0 c = nibble 0..15,          a = d_w,        b = -8 d_w
 *   Q4_1 c = nibble,                a = d_w,        b = m
 *   Q5_0 c = nibble | bit4 0..31,   a = d_w,        b = -16 d_w
 *   Q5_1 c = as Q5_0,               a = d_w,        b = m
 *   Q8_0 c = int8 (signed),         a = d_w,        b = 0    (d rounded to fp16, as llama.cpp: q8_x_scale)
 *   Q4_K c = nibble, per 32 values  a = d * sc,     b = -dmin * m
 *   Q5_K c = nibble | bit4,         a = d * sc,     b = -dmin * m
 *   Q6_K c = 6 bits - 32 (signed),  a = d * sc per 16 values, b = 0
 * (a and b exactly as the exact kernel's dequantization forms them). The integer sums are exact; the result differs
 * from the exact product only by the rounding of x: at most d/2 per value, so |error| <= sum over blocks of
 * d/2 * sum|w| (plus fp32 summation). Whether that is close enough for a model is not declared here: the kernel
 * choice's accuracy probe measures it on the model's own matrices (tracer/hardware/kernel_choice.py).
 * A block of x holding a NaN or an infinity gets d = s = NaN, so the outputs it touches are NaN, never silently
 * finite. One activation row: each row of W read once; several rows: each row of W, while in L1, times every
 * quantized activation row.
 * The scalar reference (i8_row_reference, what a build without AVX2 runs) computes the same integer sums, exact, and
 * adds the same fp32 terms (a*d) * sum(c*q) and b * s in another order, so a vector kernel agrees with it within fp32
 * summation error of those terms (the test's bound); quantize_x gives quantize_x_reference's codes bit for bit (the
 * same fp32 product, the same rounding to nearest even).
 */

#include "kernels.h"

/* x (k values, k a multiple of 32) -> k / 32 blocks, in scalar C */
void quantize_x_reference(const float *x, int64_t k, XBlock *out) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *v = x + 32 * b;
        XBlock *o = out + b;
        int finite;
        const float amax = block_amax(v, &finite);
        if (!finite) {
            o->d = o->s = NAN;
            memset(o->q, 0, sizeof o->q);
            continue;
        }
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        const int tiny = !(id < INFINITY); /* max|x| below 127 / FLT_MAX: 127 * v / max|x| <= 127 exactly in double */
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            /* the default rounding mode: nearest, ties to even */
            const int q = tiny ? (int)nearbyint((double)v[i] * 127.0 / (double)amax) : (int)nearbyintf(v[i] * id);
            o->q[i] = (int8_t)q;
            sum += q;
        }
        o->d = d;
        o->s = d * (float)sum;
    }
}

/* the same, eight values at a time (a block holding a NaN or an infinity, or so small that 127 / max|x|
   overflows, goes to the reference) */
void quantize_x(const float *x, int64_t k, XBlock *out) {
#if LLMT_AVX2
    for (int64_t b = 0; b < k / 32; b++) {
        const float *v = x + 32 * b;
        XBlock *o = out + b;
        int finite;
        const float amax = block_amax(v, &finite);
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        if (!finite || !(id < INFINITY)) {
            quantize_x_reference(v, 32, o);
            continue;
        }
        const __m256 scale = _mm256_set1_ps(id);
        /* nearest, ties to even (default MXCSR) */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), scale));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), scale));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), scale));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), scale));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        const int sum = hsum_i32(total);
        /* packs interleave the 128-bit lanes: values 0-3 16-19 4-7 20-23 ... put back in order by the permute */
        i0 = _mm256_packs_epi32(i0, i1);
        i2 = _mm256_packs_epi32(i2, i3);
        i0 = _mm256_packs_epi16(i0, i2);
        i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)o->q, i0);
        o->d = d;
        o->s = d * (float)sum;
    }
#else
    quantize_x_reference(x, k, out);
#endif
}

/* The activation scale a Q8_0 product takes: d rounded to fp16's 11-bit significand (nearest, ties to even), as
   llama.cpp's q8_0 activation blocks store it (ggml_half d), where d is in fp16's normal range [2^-14, 65504]; d
   itself outside it (where fp16 would flush it towards 0 or overflow it, losing the block). Why: with fp32 d, i8dot
   on a real Q8_0 model agreed with llama.cpp at 98.83 % of 512 teacher-forced greedy tokens, with this d at 99.80 %
   (BENCHMARKS "i8dot for Q8_0", helper H1): the same integers and now the same scales, so its Q8_0 products are
   llama.cpp's up to fp32 summation order. Costs ~2^-12 relative per block beside the ~2^-7.5 of x's rounding.
   Bit operations, so every build (with or without F16C) gives the same value. */
static inline float q8_x_scale(float d) {
    if (!(d >= 0x1p-14f && d <= 65504.0f)) return d;
    uint32_t u;
    memcpy(&u, &d, sizeof u);
    u += 0xFFFu + ((u >> 13) & 1u); /* round the 23-bit fraction to 10 bits, ties to even */
    u &= ~0x1FFFu;
    memcpy(&d, &u, sizeof d);
    return d;
}

/* ---- the scalar reference: a block's codes and scales (block_codes), then integer sums ------------------ */

/* one row of W (n_blocks blocks of `type`) times one quantized activation row. *magnitude: the sum of the sizes of
   the fp32 terms added, |(a*d) * sum(c*q)| at its finest (per value) and |b * s|, the scale of the bound a vector
   kernel is held to. */
float i8_row_reference(int type, const uint8_t *row, int64_t n_blocks, const XBlock *x, double *magnitude) {
    int64_t block_values = 32, block_bytes = 0;
    block_shape(type, &block_values, &block_bytes);
    const int subs = (int)(block_values / 32);
    float acc = 0.0f;
    double size = 0.0;
    for (int64_t b = 0; b < n_blocks; b++) {
        for (int s = 0; s < subs; s++) {
            int c[32] = {0};
            float a0 = 0.0f, a1 = 0.0f, off = 0.0f;
            block_codes(type, row + b * block_bytes, s, c, &a0, &a1, &off);
            const XBlock *xb = x + b * subs + s;
            const float xd = type == Q8_0 ? q8_x_scale(xb->d) : xb->d;
            int lo = 0, hi = 0;
            for (int l = 0; l < 16; l++) lo += c[l] * xb->q[l];
            for (int l = 16; l < 32; l++) hi += c[l] * xb->q[l];
            acc += (a0 * xd) * (float)lo + (a1 * xd) * (float)hi + off * xb->s;
            for (int l = 0; l < 32; l++) size += fabs((double)(l < 16 ? a0 : a1) * xd) * abs(c[l] * xb->q[l]);
            size += fabs((double)off * xb->s);
        }
    }
    if (magnitude != NULL) *magnitude = size;
    return acc;
}

/* ---- AVX2 --------------------------------------------------------------------------------------------------- */

#if LLMT_AVX2

/* 32 unsigned bytes times 32 signed bytes: the 8 int32 sums of 4 neighbouring products, as fp32 */
static inline __m256 dot_us(__m256i u, __m256i s) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* signed times signed: |a| times s carrying a's sign (a = -128 reads as 128 unsigned; |s| <= 127) */
static inline __m256 dot_ss(__m256i a, __m256i s) {
    return dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(s, a));
}

/* a 32-value block's 16 nibble bytes as 32 bytes in value order: low nibbles (values 0-15), then high ones */
static inline __m256i nibble_bytes(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

/* byte i: 0x10 where bit i of `bits` is set, else 0 (Q5_0/Q5_1's fifth bits) */
static inline __m256i fifth_bits32(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                                 0x0101010101010101LL, 0));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(0x10));
}

static inline __m256i xcodes(const XBlock *x) { return _mm256_loadu_si256((const __m256i *)x->q); }

static inline __attribute__((always_inline)) int64_t q32_bytes(int type) {
    switch (type) {
    case Q4_1: return sizeof(block_q4_1);
    case Q5_0: return sizeof(block_q5_0);
    case Q5_1: return sizeof(block_q5_1);
    case Q8_0: return sizeof(block_q8_0);
    default: return sizeof(block_q4_0);
    }
}

/* one block of Q4_0..Q8_0 (at blk, of `type`) as codes (32 bytes: unsigned, or signed for Q8_0), d_w and the
   offset b (lane 0 each; w = d*c + b) */
static inline __attribute__((always_inline)) __m256i q32_codes(int type, const void *blk, __m128 *d, __m128 *off) {
    const __m128 dm = halves2(blk); /* d, and m for Q4_1/Q5_1 (the next bytes otherwise: unused) */
    *d = dm;
    switch (type) {
    case Q4_0: *off = _mm_mul_ss(dm, _mm_set_ss(-8.0f)); return nibble_bytes(((const block_q4_0 *)blk)->qs);
    case Q4_1: *off = _mm_movehdup_ps(dm); return nibble_bytes(((const block_q4_1 *)blk)->qs);
    case Q5_0: {
        const block_q5_0 *b = blk;
        *off = _mm_mul_ss(dm, _mm_set_ss(-16.0f));
        return _mm256_or_si256(nibble_bytes(b->qs), fifth_bits32(read_u32(b->qh)));
    }
    case Q5_1: {
        const block_q5_1 *b = blk;
        *off = _mm_movehdup_ps(dm);
        return _mm256_or_si256(nibble_bytes(b->qs), fifth_bits32(read_u32(b->qh)));
    }
    default: *off = _mm_setzero_ps(); return _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)blk)->qs);
    }
}

/* one block of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0: (d_w * d_x) * sum(c*q) into acc, offset * s_x into off */
static inline __attribute__((always_inline)) void i8_q32_block(int type, const void *blk, const XBlock *x,
                                                               __m256 *acc, __m128 *off) {
    __m128 dm, offset;
    const __m256i c = q32_codes(type, blk, &dm, &offset);
    const __m256 p = type == Q8_0 ? dot_ss(c, xcodes(x)) : dot_us(c, xcodes(x));
    const __m128 ds = type == Q8_0 ? _mm_set_ss(q8_x_scale(x->d)) : _mm_load_ss(&x->d), ss = _mm_load_ss(&x->s);
    *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_mul_ss(dm, ds)), p, *acc);
    if (type != Q8_0) *off = _mm_fmadd_ss(offset, ss, *off);
}

/* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: one scale (and offset) per 32 values; one row of W. Its even and odd blocks go to
   two accumulators (the multiply-adds of neighbouring blocks do not wait for each other). One row at a time, not two
   sharing each block of x: rows in pairs were 1.4x faster with W in cache but streamed from DRAM slower than one at
   a time (a decode step's products 10.8 -> 8.4 ms on the bundled model, BENCHMARKS "The i8dot kernel").
   Always inlined with a constant type: one loop per type, no branch per block. */
static inline __attribute__((always_inline)) float i8_q32_row(int type, const uint8_t *row, int64_t n_blocks,
                                                              const XBlock *x) {
    const int64_t bytes = q32_bytes(type);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    __m128 off0 = _mm_setzero_ps(), off1 = off0;
    int64_t b = 0;
    for (; b + 2 <= n_blocks; b += 2) {
        prefetch(row + b * bytes);
        if (type == Q8_0) prefetch(row + b * bytes + 64);
        i8_q32_block(type, row + b * bytes, x + b, &acc0, &off0);
        i8_q32_block(type, row + (b + 1) * bytes, x + b + 1, &acc1, &off1);
    }
    if (b < n_blocks) i8_q32_block(type, row + b * bytes, x + b, &acc0, &off0);
    return hsum(_mm256_add_ps(acc0, acc1)) + _mm_cvtss_f32(_mm_add_ss(off0, off1));
}

/* Several activation rows (prefill): a tile of 2 rows of W times 4 quantized rows of x, so each block's codes are
   unpacked once for 4 rows of x and each block of x loaded once for 2 rows of W. dT, sT: the 4 rows' d and s per
   block, interleaved (dT[4b + i]), so one load gives the 4 rows' scales. Rows beyond the matrix or x (a tile's
   padding) repeat the last one and are not written. */
static inline __attribute__((always_inline)) void i8_q32_tile(int type, const uint8_t *r0, const uint8_t *r1,
                                                              int64_t n_blocks, const XBlock *x0, const XBlock *x1,
                                                              const XBlock *x2, const XBlock *x3, const float *dT,
                                                              const float *sT, float out[2][4]) {
    const int64_t bytes = q32_bytes(type);
    __m256 acc[2][4];
    __m128 off[2];
    for (int j = 0; j < 2; j++) {
        off[j] = _mm_setzero_ps();
        for (int i = 0; i < 4; i++) acc[j][i] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < n_blocks; b++) {
        const __m128 dv = _mm_loadu_ps(dT + 4 * b), sv = _mm_loadu_ps(sT + 4 * b);
        const __m256i q[4] = {xcodes(x0 + b), xcodes(x1 + b), xcodes(x2 + b), xcodes(x3 + b)};
        for (int j = 0; j < 2; j++) {
            const uint8_t *blk = (j ? r1 : r0) + b * bytes;
            __m128 d, offset;
            const __m256i c = q32_codes(type, blk, &d, &offset);
            const __m128 dd = _mm_mul_ps(_mm_broadcastss_ps(d), dv); /* d_w * d_x of the 4 rows of x */
            if (type != Q8_0) off[j] = _mm_fmadd_ps(_mm_broadcastss_ps(offset), sv, off[j]);
            const __m256i sc = type == Q8_0 ? _mm256_sign_epi8(c, c) : c;
#define LLMT_TILE_LANE(i, imm)                                                                                      \
    acc[j][i] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_permute_ps(dd, imm)),                                     \
                                dot_us(sc, type == Q8_0 ? _mm256_sign_epi8(q[i], c) : q[i]), acc[j][i])
            LLMT_TILE_LANE(0, 0x00);
            LLMT_TILE_LANE(1, 0x55);
            LLMT_TILE_LANE(2, 0xAA);
            LLMT_TILE_LANE(3, 0xFF);
#undef LLMT_TILE_LANE
        }
    }
    for (int j = 0; j < 2; j++) {
        float offs[4];
        _mm_storeu_ps(offs, off[j]);
        for (int i = 0; i < 4; i++) out[j][i] = hsum(acc[j][i]) + offs[i];
    }
}

/* rows first..last of a Q4_0..Q8_0 part times m >= 2 quantized rows of x: tiles of 2 x 4 */
static int i8_q32_many_x(int type, const uint8_t *w, int64_t stride, int64_t first, int64_t last, int64_t n_blocks,
                         const XBlock *x, int64_t m, float *out, int64_t out_stride) {
    float *dT = malloc(sizeof(float) * (size_t)(8 * n_blocks));
    if (dT == NULL) return 0;
    float *sT = dT + 4 * n_blocks;
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
        const XBlock *xr[4];
        for (int i = 0; i < 4; i++) xr[i] = x + (i0 + i < m ? i0 + i : m - 1) * n_blocks;
        for (int64_t b = 0; b < n_blocks; b++)
            for (int i = 0; i < 4; i++) {
                dT[4 * b + i] = type == Q8_0 ? q8_x_scale(xr[i][b].d) : xr[i][b].d;
                sT[4 * b + i] = xr[i][b].s;
            }
        for (int64_t r = first; r < last; r += 2) {
            const int64_t r1 = r + 1 < last ? r + 1 : r;
            float tile[2][4];
            i8_q32_tile(type, w + r * stride, w + r1 * stride, n_blocks, xr[0], xr[1], xr[2], xr[3], dT, sT, tile);
            for (int j = 0; j < (r + 1 < last ? 2 : 1); j++)
                for (int i = 0; i < 4 && i0 + i < m; i++) out[(i0 + i) * out_stride + r + j] = tile[j][i];
        }
    }
    free(dT);
    return 1;
}

/* one Q4_0/Q4_1 row with i8_q4_group's per-row float math (a row outside a whole group of sixteen) */
static inline __attribute__((always_inline)) float i8_q4_row(int type, const uint8_t *row, int64_t n_blocks,
                                                             const XBlock *x) {
    float acc = 0.0f, off = 0.0f;
    for (int64_t b = 0; b < n_blocks; b++) {
        const block_q4_0 *b0 = (const block_q4_0 *)row + b;
        const block_q4_1 *b1 = (const block_q4_1 *)row + b;
        const __m256i p = _mm256_madd_epi16(
            _mm256_maddubs_epi16(nibble_bytes(type == Q4_1 ? b1->qs : b0->qs), xcodes(x + b)), _mm256_set1_epi16(1));
        const float d = half_to_float(type == Q4_1 ? b1->d : b0->d);
        acc = fmaf(d * x[b].d, (float)hsum_i32(p), acc);
        off = fmaf(type == Q4_1 ? half_to_float(b1->m) : d * -8.0f, x[b].s, off);
    }
    return acc + off;
}

/* ---- Q4_0/Q4_1 rows interleaved in groups of sixteen (int8_groups.c: the layout and why) -------------------- */

/* x's codes 4i..4i+3 as one 32-bit word (broadcast to every row's lane) */
static inline int32_t x_word(const XBlock *xb, int i) {
    int32_t v;
    memcpy(&v, xb->q + 4 * i, sizeof v);
    return v;
}

/* One group of sixteen rows (its interleaved blocks at g) times n activation rows (x[i], into out[i][0..16); n = 1
   for decode, 2 for prefill: a block's codes unpacked once for both). Per block, row r's integer sum of its 32 code x
   activation products (exact: each at most 15 * 127 in magnitude, 32 of them), then acc_r += (d_r * d_x) * sum and
   off_r += offset_r * s_x in fp32 (offset: Q4_1's m, Q4_0's -8 d), block after block, result acc_r + off_r: the
   same integers and the same fp32 operations in the same order as i8_q4_row, in both builds below, so the same bits
   whatever n. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* AVX-512 VNNI: 32-bit lane r of each 64-byte code vector is row r, so x's four codes, broadcast from memory, meet
   every row's four in one vpdpbusd: eight a block (low nibbles, high ones; four chains), then the float step in 16
   lanes. No permutes and no horizontal adds: 1.5x the eight-row kernel's pace with its bytes in L2, 1.75x for two
   activation rows sharing the unpacked codes (one core's CPU time, BENCHMARKS, issue 31, helper H4). No software
   prefetch: the groups are one contiguous run per thread, which the hardware prefetchers follow (the prefetches
   took issue slots: 1.00-1.16x without them, helper H5). */
static inline __attribute__((always_inline)) void i8_q4_group_n(int type, int n, const uint8_t *g, int64_t n_blocks,
                                                                const XBlock *const *x, float *const *out) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[2], off[2];
    for (int i = 0; i < n; i++) acc[i] = off[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const group_q4_0 *g0 = (const group_q4_0 *)g + b;
        const group_q4_1 *g1 = (const group_q4_1 *)g + b;
        const uint8_t *qs = type == Q4_1 ? &g1->qs[0][0] : &g0->qs[0][0];
        __m512i lo[4], hi[4];
        for (int v = 0; v < 4; v++) {
            const __m512i c = _mm512_loadu_si512((const void *)(qs + 64 * v));
            lo[v] = _mm512_and_si512(c, low4);
            hi[v] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(type == Q4_1 ? g1->d : g0->d)));
        const __m512 offset = type == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g1->m))
                                           : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        for (int i = 0; i < n; i++) {
            const XBlock *xb = x[i] + b;
            __m512i s[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                            _mm512_setzero_si512()};
            for (int v = 0; v < 4; v++) {
                s[v & 1] = _mm512_dpbusd_epi32(s[v & 1], lo[v], _mm512_set1_epi32(x_word(xb, v)));
                s[2 + (v & 1)] = _mm512_dpbusd_epi32(s[2 + (v & 1)], hi[v], _mm512_set1_epi32(x_word(xb, 4 + v)));
            }
            const __m512i total = _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb->d)), _mm512_cvtepi32_ps(total), acc[i]);
            off[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xb->s), off[i]);
        }
    }
    for (int i = 0; i < n; i++) _mm512_storeu_ps(out[i], _mm512_add_ps(acc[i], off[i]));
}
#define I8_Q4_PAIRS 1 /* prefill takes activation rows two at a time */
#else
/* AVX2: each code vector as two 32-byte halves (rows 0-7, 8-15); x's four codes broadcast, one maddubs of the low
   nibbles and one of the high ones per half-vector (each int16 at most 2 * 15 * 127, eight added 30480: no
   saturation), one madd with ones for the eight rows' int32 sums, then the float step on eight rows at a time. */
static inline __attribute__((always_inline)) void i8_q4_group_n(int type, int n, const uint8_t *g, int64_t n_blocks,
                                                                const XBlock *const *x, float *const *out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[2][2], off[2][2];
    for (int i = 0; i < n; i++)
        for (int h = 0; h < 2; h++) acc[i][h] = off[i][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const group_q4_0 *g0 = (const group_q4_0 *)g + b;
        const group_q4_1 *g1 = (const group_q4_1 *)g + b;
        const uint8_t *blk = type == Q4_1 ? (const uint8_t *)g1 : (const uint8_t *)g0;
        for (int line = 0; line < (int)sizeof(group_q4_1); line += 64)
            _mm_prefetch((const char *)blk + I8_AHEAD + line, _MM_HINT_T0);
        const uint8_t *qs = type == Q4_1 ? &g1->qs[0][0] : &g0->qs[0][0];
        for (int h = 0; h < 2; h++) {
            const ggml_half *dh = (type == Q4_1 ? g1->d : g0->d) + 8 * h;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
            const __m256 offset = type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g1->m + 8 * h)))
                                               : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
            for (int i = 0; i < n; i++) {
                const XBlock *xb = x[i] + b;
                __m256i sum = _mm256_setzero_si256();
                for (int v = 0; v < 4; v++) {
                    const __m256i c = _mm256_loadu_si256((const __m256i *)(qs + 64 * v + 32 * h));
                    const __m256i xl = _mm256_set1_epi32(x_word(xb, v)), xh = _mm256_set1_epi32(x_word(xb, 4 + v));
                    sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(_mm256_and_si256(c, low4), xl));
                    sum = _mm256_add_epi16(sum,
                                           _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 4), low4), xh));
                }
                const __m256i total = _mm256_madd_epi16(sum, ones);
                acc[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb->d)), _mm256_cvtepi32_ps(total),
                                            acc[i][h]);
                off[i][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xb->s), off[i][h]);
            }
        }
    }
    for (int i = 0; i < n; i++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out[i] + 8 * h, _mm256_add_ps(acc[i][h], off[i][h]));
}
#define I8_Q4_PAIRS 0 /* no codes shared between activation rows: one at a time */
#endif

/* one group of sixteen rows times one activation row, into out[0..16) */
static inline __attribute__((always_inline)) void i8_q4_group(int type, const uint8_t *g, int64_t n_blocks,
                                                              const XBlock *x, float *out) {
    i8_q4_group_n(type, 1, g, n_blocks, &x, &out);
}

/* The rows of a Q4_0/Q4_1 part with its interleaved copy: whole groups are read from the copy only, never from
   the part's rows (the loader holds such a matrix once, interleaved in place: int8_groups.c), and the rows after the
   last whole group (`whole` = rows / 16 * 16) from the rows. A thread's run that starts or ends inside a group
   computes that group whole and keeps its own rows' values, which are i8_q4_row's bit for bit. */

/* rows first..last of a Q4_0/Q4_1 part times one activation row: the whole groups inside the range from the
   interleaved copy (when there is one), the rows before the first and after the last whole group one by one */
static inline __attribute__((always_inline)) void i8_q4_rows(int type, const uint8_t *w, int64_t stride,
                                                             const uint8_t *groups, int64_t first, int64_t last,
                                                             int64_t whole, int64_t n_blocks, const XBlock *x,
                                                             float *out) {
    const int64_t G = GROUP_ROWS;
    int64_t r = first;
    if (groups != NULL) {
        const int64_t row_bytes = n_blocks * q32_bytes(type);
        float y[GROUP_ROWS];
        if (r < last && r % G && r < whole) { /* a group this run shares with the run before */
            const int64_t g = r - r % G;
            i8_q4_group(type, groups + g * row_bytes, n_blocks, x, y);
            for (; r < last && r % G; r++) out[r] = y[r - g];
        }
        for (; r + G <= last; r += G) i8_q4_group(type, groups + r * row_bytes, n_blocks, x, out + r);
        if (r < last && r < whole) { /* a group this run shares with the run after */
            const int64_t g = r;
            i8_q4_group(type, groups + g * row_bytes, n_blocks, x, y);
            for (; r < last; r++) out[r] = y[r - g];
        }
    }
    for (; r < last; r++) out[r] = i8_q4_row(type, w + r * stride, n_blocks, x);
}

/* rows first..last of a Q4_0/Q4_1 part times m activation rows (prefill) when the part has its interleaved copy:
   group by group, every activation row passes over the group's blocks while they sit in L1/L2 (16 rows x k/32
   blocks: 36 KB at k = 4096), two activation rows at a time where the build shares a block's unpacked codes
   between them (I8_Q4_PAIRS), so the matrix is read once per product, from the copy the decode step reads. The
   2 x 4 tiles over the rows (i8_q32_many_x) read the whole matrix again for every four activation rows. Each value
   is i8_q4_rows' for its activation row: bit for bit the decode product's. */
static void i8_q4_groups_many_x(int type, const uint8_t *w, int64_t stride, const uint8_t *groups, int64_t first,
                                int64_t last, int64_t whole, int64_t n_blocks, const XBlock *x, int64_t xblocks,
                                int64_t m, float *out, int64_t out_stride) {
    const int64_t row_bytes = n_blocks * q32_bytes(type), G = GROUP_ROWS;
    int64_t r = first;
    if (r < last && r % G) { /* up to the first whole group (or the end of a run inside one group) */
        const int64_t stop = r + (G - r % G) < last ? r + (G - r % G) : last;
        for (int64_t i = 0; i < m; i++)
            i8_q4_rows(type, w, stride, groups, r, stop, whole, n_blocks, x + i * xblocks, out + i * out_stride);
        r = stop;
    }
    for (; r + G <= last; r += G) {
        const uint8_t *g = groups + r * row_bytes;
        int64_t i = 0;
        for (; I8_Q4_PAIRS && i + 2 <= m; i += 2) {
            const XBlock *xs[2] = {x + i * xblocks, x + (i + 1) * xblocks};
            float *outs[2] = {out + i * out_stride + r, out + (i + 1) * out_stride + r};
            i8_q4_group_n(type, 2, g, n_blocks, xs, outs);
        }
        for (; i < m; i++) i8_q4_group(type, g, n_blocks, x + i * xblocks, out + i * out_stride + r);
    }
    if (r < last)
        for (int64_t i = 0; i < m; i++)
            i8_q4_rows(type, w, stride, groups, r, last, whole, n_blocks, x + i * xblocks, out + i * out_stride);
}

/* ---- Q8_0 prefill: sixteen rows at a time, packed per call (AVX-512 VNNI) ---------------------------------- */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Why: the 2 x 4 tiles (i8_q32_tile) sum each row's 32 products in 8 lanes of their own and pay two vpsignb a block
   and row of x for Q8_0's signed codes, then a horizontal add per row and tile; and they read the whole matrix again
   for every four activation rows. Here, as i8dot's Q4 groups (int8_groups.c), 32-bit lane j of every code vector is
   row j of sixteen, so x's four codes, broadcast from memory, meet sixteen rows' four in one vpdpbusd, eight a block,
   and every activation row passes over the sixteen rows while they sit in L2. The Q4 types hold their groups in
   memory; a Q8_0 matrix is multiplied where it lies (the file's map), so each call packs its thread's rows sixteen at
   a time into a scratch block (n_blocks x 576 bytes: 198 KB at k = 11008), which every activation row then reads:
   the packing (nine gathers a block of sixteen rows) is paid once per sixteen rows and call, the dot products once
   per activation row. vpdpbusd multiplies unsigned bytes by signed ones: the codes c are stored as c + 128 (0..255),
   and each row's sum of (c + 128) * q is started at -128 * sum(q) (the same for the sixteen rows: one broadcast), so
   the integer sum is sum(c * q), exact (|sum| <= 32 * 255 * 127 before the correction). Per row the float math is
   acc = fma(d_w * d_x, sum(c*q), acc) block after block, in its own lane: a row's value is the same bits whichever
   sixteen it was packed with, so a thread split, a matrix's last rows (a short group, its lanes padded with its last
   row) and the number of activation rows taken together do not move it. */
typedef struct {
    float d[GROUP_ROWS]; /* the sixteen rows' d_w, as fp32 */
    uint8_t qs[8][4 * GROUP_ROWS]; /* vector v: codes 4v..4v+3 of each row, + 128, row order */
} pack_q8_0;
_Static_assert(sizeof(pack_q8_0) == 9 * 64, "a packed block is nine cache lines");

/* rows r..r+n-1 (n <= 16; lanes n..15 repeat row r+n-1) of a Q8_0 matrix, every block, into pack */
static void pack_q8_rows(const uint8_t *w, int64_t stride, int64_t r, int n, int64_t n_blocks, pack_q8_0 *pack) {
    int32_t at[GROUP_ROWS];
    for (int j = 0; j < GROUP_ROWS; j++) at[j] = (int32_t)((j < n ? j : n - 1) * stride);
    const __m512i offsets = _mm512_loadu_si512((const void *)at), flip = _mm512_set1_epi8((char)0x80);
    const uint8_t *row0 = w + r * stride;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = row0 + b * (int64_t)sizeof(block_q8_0);
        /* d and the first two code bytes, as one 32-bit word a row: the low half is d */
        const __m512i dw = _mm512_i32gather_epi32(offsets, (const void *)blk, 1);
        _mm512_store_ps(pack[b].d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dw)));
        for (int v = 0; v < 8; v++) {
            const __m512i c = _mm512_i32gather_epi32(offsets, (const void *)(blk + 2 + 4 * v), 1);
            _mm512_store_si512((void *)pack[b].qs[v], _mm512_xor_si512(c, flip));
        }
    }
}

/* -128 * sum(q) and the Q8_0 scale (q8_x_scale) of each block of m activation rows ([i * n_blocks + b]) */
static void q8_corrections(const XBlock *x, int64_t count, int32_t *corr, float *scale) {
    for (int64_t i = 0; i < count; i++) {
        int32_t sum = 0;
        for (int l = 0; l < 32; l++) sum += x[i].q[l];
        corr[i] = -128 * sum;
        scale[i] = q8_x_scale(x[i].d);
    }
}

/* one packed group of sixteen rows times N activation rows (x[i], corr[i]: their blocks and corrections), into
   out[i][0..16) where lane j < n (a short group writes only its rows) */
static inline __attribute__((always_inline)) void i8_q8_group_n(int N, const pack_q8_0 *pack, int64_t n_blocks,
                                                                const XBlock *const *x, const int32_t *const *corr,
                                                                const float *const *scale, float *const *out, int n) {
    __m512 acc[4];
    for (int i = 0; i < N; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        __m512i c[8];
        for (int v = 0; v < 8; v++) {
            c[v] = _mm512_load_si512((const void *)pack[b].qs[v]);
            __asm__("" : "+v"(c[v])); /* held in a register for the N rows (GCC reloaded it for each) */
        }
        const __m512 d = _mm512_load_ps(pack[b].d);
        for (int i = 0; i < N; i++) {
            const XBlock *xb = x[i] + b;
            __m512i s0 = _mm512_set1_epi32(corr[i][b]), s1 = _mm512_setzero_si512();
            for (int v = 0; v < 8; v += 2) {
                s0 = _mm512_dpbusd_epi32(s0, c[v], _mm512_set1_epi32(x_word(xb, v)));
                s1 = _mm512_dpbusd_epi32(s1, c[v + 1], _mm512_set1_epi32(x_word(xb, v + 1)));
            }
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(scale[i][b])),
                                     _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[i]);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << n) - 1u);
    for (int i = 0; i < N; i++) _mm512_mask_storeu_ps(out[i], keep, acc[i]);
}

/* rows first..last of a Q8_0 part times m >= 2 activation rows: sixteen rows packed at a time (the last group
   short), every activation row over them, four at a time; 0 if the scratch cannot be had */
static int i8_q8_groups_many_x(const uint8_t *w, int64_t stride, int64_t first, int64_t last, int64_t n_blocks,
                               const XBlock *x, int64_t m, float *out, int64_t out_stride) {
    pack_q8_0 *pack = aligned_alloc(64, sizeof(pack_q8_0) * (size_t)n_blocks);
    int32_t *corr = malloc((sizeof(int32_t) + sizeof(float)) * (size_t)(m * n_blocks));
    if (pack == NULL || corr == NULL) {
        free(pack);
        free(corr);
        return 0;
    }
    float *scale = (float *)(corr + m * n_blocks);
    q8_corrections(x, m * n_blocks, corr, scale);
    for (int64_t r = first; r < last; r += GROUP_ROWS) {
        const int n = last - r < GROUP_ROWS ? (int)(last - r) : GROUP_ROWS;
        pack_q8_rows(w, stride, r, n, n_blocks, pack);
        int64_t i = 0;
        for (; i + 4 <= m; i += 4) {
            const XBlock *xs[4] = {x + i * n_blocks, x + (i + 1) * n_blocks, x + (i + 2) * n_blocks,
                                   x + (i + 3) * n_blocks};
            const int32_t *cs[4] = {corr + i * n_blocks, corr + (i + 1) * n_blocks, corr + (i + 2) * n_blocks,
                                    corr + (i + 3) * n_blocks};
            const float *ds[4] = {scale + i * n_blocks, scale + (i + 1) * n_blocks, scale + (i + 2) * n_blocks,
                                  scale + (i + 3) * n_blocks};
            float *outs[4] = {out + i * out_stride + r, out + (i + 1) * out_stride + r, out + (i + 2) * out_stride + r,
                              out + (i + 3) * out_stride + r};
            i8_q8_group_n(4, pack, n_blocks, xs, cs, ds, outs, n);
        }
        for (; i < m; i++) {
            const XBlock *xs[1] = {x + i * n_blocks};
            const int32_t *cs[1] = {corr + i * n_blocks};
            const float *ds[1] = {scale + i * n_blocks};
            float *outs[1] = {out + i * out_stride + r};
            i8_q8_group_n(1, pack, n_blocks, xs, cs, ds, outs, n);
        }
    }
    free(pack);
    free(corr);
    return 1;
}
#endif

/* rows first..last of a Q5_0/Q5_1/Q8_0 matrix times one activation row */
static inline __attribute__((always_inline)) void i8_q32_one_x(int type, const uint8_t *w, int64_t stride,
                                                               int64_t first, int64_t last, int64_t n_blocks,
                                                               const XBlock *x, float *out) {
    for (int64_t r = first; r < last; r++) out[r] = i8_q32_row(type, w + r * stride, n_blocks, x);
}

/* ---- K-quants (256-value super-blocks), one activation row: several rows of W at a time ---------------------- */

/* src + per int32 lane the sum of 4 neighbouring products of unsigned bytes u and signed bytes s: one vpdpbusd
   with AVX-512 VNNI, else maddubs + madd + add. The same integers either way while maddubs' int16 pair sums do not
   saturate: here u <= 63 and |s| <= 127, 2 * 63 * 127 < 2^15. */
static inline __m256i dot4_add(__m256i src, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(src, u, s);
#else
    return _mm256_add_epi32(src, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* x's scales d (lanes 0-7: blocks xb[at[j] / 10]) and s, gathered (XBlock: 10 floats) */
static inline void x_scales(const XBlock *xb, __m256i at, __m256 *d, __m256 *s) {
    *d = _mm256_i32gather_ps(&xb->d, at, 4);
    *s = _mm256_i32gather_ps(&xb->s, at, 4);
}

/* byte i: 0x10 where bit j of byte i of qh is set (Q5_K's fifth bit of sub-block j) */
static inline __attribute__((always_inline)) __m256i k5_bit(__m256i qh, int j) {
    const __m256i bit = _mm256_and_si256(qh, _mm256_set1_epi8((char)(1 << j)));
    return j < 4 ? _mm256_slli_epi16(bit, 4 - j) : _mm256_srli_epi16(bit, j - 4);
}

/* How many rows of W the K-quant kernels take at a time, sharing x's codes and scales. */
#ifndef I8_K_ROWS
#define I8_K_ROWS 4
#endif

/* Q4_K, Q5_K: `rows` rows of W (at w, w + stride, ...) times one activation row, into out[0..rows). Per row and
   32-value sub-block j: acc[j & 1] += ((d*sc_j) * d_x) * sum(c*q) in 8 lanes of 4 products each; per super-block
   mins += (dmin*m_j) * s_x + (dmin*m_j+1) * s_x for j = 0, 2, 4, 6; result hsum(acc0 + acc1) - mins. The scales and
   mins of a super-block are unpacked (k4_scales) and multiplied in one vector each (the same fp32 products as one at a time:
   one multiply per value, in the same order), so a row's value is bit for bit the same whatever `rows`, the
   thread split or the build (AVX2 or AVX-512 VNNI): the integer sums are exact. Rows share x's loads and
   scales; the prefetch runs I8_AHEAD ahead along the rows' run of memory (as i8_q4_group). */
static inline __attribute__((always_inline)) void i8_k45_rows(int type, int rows, const uint8_t *w, int64_t stride,
                                                              int64_t n_blocks, const XBlock *x, float *out) {
    const int64_t bytes = type == Q4_K ? sizeof(block_q4_K) : sizeof(block_q5_K);
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    const __m256i at = _mm256_setr_epi32(0, 10, 20, 30, 40, 50, 60, 70);
    __m256 acc0[I8_K_ROWS], acc1[I8_K_ROWS];
    float mins[I8_K_ROWS];
    for (int i = 0; i < rows; i++) {
        acc0[i] = acc1[i] = _mm256_setzero_ps();
        mins[i] = 0.0f;
    }
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t from = b * bytes;
        const uint8_t *ahead = w + I8_AHEAD + rows * from;
        for (int line = 0; line < rows * bytes; line += 64) _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
        const XBlock *xb = x + 8 * b;
        __m256 xd, xs;
        x_scales(xb, at, &xd, &xs);
        for (int i = 0; i < rows; i++) {
            const block_q4_K *k4 = (const block_q4_K *)(w + i * stride + from); /* Q5_K: the same header */
            const block_q5_K *k5 = (const block_q5_K *)k4;
            const __m128 dd = halves2(k4); /* d, dmin */
            uint64_t sc8, m8; /* the eight scales and mins as bytes (blocks.h's k4_scales), widened to fp32 */
            k4_scales(k4->scales, &sc8, &m8);
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)));
            const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8)));
            const __m256 a = _mm256_mul_ps(_mm256_mul_ps(_mm256_broadcastss_ps(dd), sc), xd);
            const __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), m), xs);
            const __m256 pairs = _mm256_add_ps(t, _mm256_permute_ps(t, 0xB1)); /* lane 2p: t_2p + t_2p+1 */
            const uint8_t *qs = type == Q4_K ? k4->qs : k5->qs;
            const __m256i qh = type == Q5_K ? _mm256_loadu_si256((const __m256i *)k5->qh) : zero;
            for (int p = 0; p < 4; p++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
                __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                if (type == Q5_K) {
                    lo = _mm256_or_si256(lo, k5_bit(qh, 2 * p));
                    hi = _mm256_or_si256(hi, k5_bit(qh, 2 * p + 1));
                }
                const __m256 p0 = _mm256_cvtepi32_ps(dot4_add(zero, lo, xcodes(xb + 2 * p)));
                const __m256 p1 = _mm256_cvtepi32_ps(dot4_add(zero, hi, xcodes(xb + 2 * p + 1)));
                acc0[i] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(a, _mm256_set1_epi32(2 * p)), p0, acc0[i]);
                acc1[i] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(a, _mm256_set1_epi32(2 * p + 1)), p1, acc1[i]);
            }
            const __m128 low = _mm256_castps256_ps128(pairs), high = _mm256_extractf128_ps(pairs, 1);
            mins[i] += _mm_cvtss_f32(low);
            mins[i] += _mm_cvtss_f32(_mm_movehl_ps(low, low));
            mins[i] += _mm_cvtss_f32(high);
            mins[i] += _mm_cvtss_f32(_mm_movehl_ps(high, high));
        }
    }
    for (int i = 0; i < rows; i++) out[i] = hsum(_mm256_add_ps(acc0[i], acc1[i])) - mins[i];
}

/* Q6_K: `rows` rows of W times one activation row. Per row, 16 values at a time, (d*sc) * d_x times the sum of
   c*q with c = 6 bits - 32, summed per int32 lane as sum(u*q) - 32 * sum(q) (u the unsigned 6 bits: the same
   integer; x's -32 * sum(q) per lane computed once for all the rows); the 16 scales converted and multiplied in two
   vectors. Sub-block j of half h: lanes 0-3 (values 0-15) scale sc[8h+2j], lanes 4-7 sc[8h+2j+1]; even j into acc0,
   odd into acc1; result hsum(acc0 + acc1), bit for bit the same whatever `rows` (see i8_k45_rows). */
static inline __attribute__((always_inline)) void i8_q6k_rows(int rows, const uint8_t *w, int64_t stride,
                                                              int64_t n_blocks, const XBlock *x, float *out) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i thirty_two = _mm256_set1_epi8(32);
    const __m256i at = _mm256_setr_epi32(0, 0, 10, 10, 20, 20, 30, 30); /* lane pairs: one block of x each */
    __m256 acc0[I8_K_ROWS], acc1[I8_K_ROWS];
    for (int i = 0; i < rows; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t from = b * (int64_t)sizeof(block_q6_K);
        const uint8_t *ahead = w + I8_AHEAD + rows * from;
        for (int line = 0; line < rows * (int)sizeof(block_q6_K); line += 64)
            _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
        const XBlock *xb = x + 8 * b;
        const __m256 xd[2] = {_mm256_i32gather_ps(&xb[0].d, at, 4), _mm256_i32gather_ps(&xb[4].d, at, 4)};
        __m256i minus[8]; /* per lane -32 * (sum of x's 4 codes) */
        for (int j = 0; j < 8; j++)
            minus[j] = _mm256_sub_epi32(zero, dot4_add(zero, thirty_two, xcodes(xb + j)));
        for (int i = 0; i < rows; i++) {
            const block_q6_K *blk = (const block_q6_K *)(w + i * stride + from);
            const __m256 d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(blk->d))); /* read no further */
            const __m128i sc = _mm_loadu_si128((const __m128i *)blk->scales);
            const __m256 a[2] = {
                _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))), xd[0]),
                _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))),
                              xd[1]),
            };
            for (int half = 0; half < 2; half++) {
                __m256i u[4];
                q6k_codes(blk, half, u);
                for (int c = 0; c < 4; c++) {
                    const __m256 scale = _mm256_permutevar8x32_ps(
                        a[half], _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1));
                    const __m256 p = _mm256_cvtepi32_ps(dot4_add(minus[4 * half + c], u[c], xcodes(xb + 4 * half + c)));
                    if (c & 1) acc1[i] = _mm256_fmadd_ps(scale, p, acc1[i]);
                    else acc0[i] = _mm256_fmadd_ps(scale, p, acc0[i]);
                }
            }
        }
    }
    for (int i = 0; i < rows; i++) out[i] = hsum(_mm256_add_ps(acc0[i], acc1[i]));
}

/* rows first..last of a Q4_K/Q5_K/Q6_K matrix times one activation row: I8_K_ROWS at a time, the rest one by one */
static inline __attribute__((always_inline)) void i8_k_one_x(int type, const uint8_t *w, int64_t stride,
                                                             int64_t first, int64_t last, int64_t n_blocks,
                                                             const XBlock *x, float *out) {
    int64_t r = first;
    for (; r + I8_K_ROWS <= last; r += I8_K_ROWS) {
        if (type == Q6_K) i8_q6k_rows(I8_K_ROWS, w + r * stride, stride, n_blocks, x, out + r);
        else i8_k45_rows(type, I8_K_ROWS, w + r * stride, stride, n_blocks, x, out + r);
    }
    for (; r < last; r++) {
        if (type == Q6_K) i8_q6k_rows(1, w + r * stride, stride, n_blocks, x, out + r);
        else i8_k45_rows(type, 1, w + r * stride, stride, n_blocks, x, out + r);
    }
}

#endif /* LLMT_AVX2 */

/* one row of W (n_blocks blocks of `type`) times one quantized activation row */
static inline float i8_row(int type, const uint8_t *row, int64_t n_blocks, const XBlock *x) {
#if LLMT_AVX2
    switch (type) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1:
    case Q8_0: return i8_q32_row(type, row, n_blocks, x);
    case Q4_K:
    case Q5_K:
    case Q6_K: {
        float y; /* the decode kernel's row, so prefill and decode give a row the same value */
        if (type == Q4_K) i8_k_one_x(Q4_K, row, 0, 0, 1, n_blocks, x, &y);
        else if (type == Q5_K) i8_k_one_x(Q5_K, row, 0, 0, 1, n_blocks, x, &y);
        else i8_k_one_x(Q6_K, row, 0, 0, 1, n_blocks, x, &y);
        return y;
    }
    default: return 0.0f;
    }
#else
    return i8_row_reference(type, row, n_blocks, x, NULL);
#endif
}

/* rows first..last of part p times m quantized activation rows (k/32 blocks each, row i at x + i * (k/32)):
   out[i * out_stride + r]; each row of W stays in L1 while every activation row passes over it */
void i8_dot_rows(const Matrix *mat, int p, int64_t first, int64_t last, const XBlock *x, int64_t m, float *out,
                 int64_t out_stride) {
    const int64_t xblocks = mat->k / 32, n_blocks = mat->k / mat->block_values[p];
#if LLMT_AVX2
    const int64_t whole = mat->rows[p] / GROUP_ROWS * GROUP_ROWS; /* the rows in whole groups (an interleaved part's) */
    if (m == 1) { /* decode: one loop per type */
        const uint8_t *w = mat->w[p];
        const int64_t stride = mat->strides[p];
        switch (mat->types[p]) {
        case Q4_0: i8_q4_rows(Q4_0, w, stride, mat->groups[p], first, last, whole, n_blocks, x, out); return;
        case Q4_1: i8_q4_rows(Q4_1, w, stride, mat->groups[p], first, last, whole, n_blocks, x, out); return;
        case Q5_0: i8_q32_one_x(Q5_0, w, stride, first, last, n_blocks, x, out); return;
        case Q5_1: i8_q32_one_x(Q5_1, w, stride, first, last, n_blocks, x, out); return;
        case Q8_0: i8_q32_one_x(Q8_0, w, stride, first, last, n_blocks, x, out); return;
        case Q4_K: i8_k_one_x(Q4_K, w, stride, first, last, n_blocks, x, out); return;
        case Q5_K: i8_k_one_x(Q5_K, w, stride, first, last, n_blocks, x, out); return;
        case Q6_K: i8_k_one_x(Q6_K, w, stride, first, last, n_blocks, x, out); return;
        default: break;
        }
    }
    if (m > 1) { /* prefill: Q4 groups, Q8_0's packed sixteens (AVX-512 VNNI), else 2 x 4 tiles (falls through to
                    the row loop below only if the scratch cannot be had) */
        const uint8_t *w = mat->w[p];
        const int64_t stride = mat->strides[p];
        const int q4 = mat->types[p] == Q4_0 || mat->types[p] == Q4_1;
        /* Q4_0/Q4_1 with their interleaved copy: group by group (int8_groups.c); with fewer rows than a group (an
           empty copy) row by row the same way, so each token gets its decode bits there too */
        if (mat->groups[p] != NULL || (q4 && whole == 0)) {
            i8_q4_groups_many_x(mat->types[p], w, stride, mat->groups[p], first, last, whole, n_blocks, x, xblocks,
                                m, out, out_stride);
            return;
        }
        if (mat->types[p] == Q4_K || mat->types[p] == Q5_K || mat->types[p] == Q6_K) {
            /* K-quants: eight rows at a time through the decode kernel, every activation row passing over them while
               they sit in L1 (the row loop below took one row per pass over the activations); each row's value is
               the decode kernel's, as that loop's i8_row gives it */
            for (int64_t r = first; r < last; r += 8) {
                const int64_t stop = r + 8 < last ? r + 8 : last;
                for (int64_t i = 0; i < m; i++) i8_dot_rows(mat, p, r, stop, x + i * xblocks, 1, out + i * out_stride, 0);
            }
            return;
        }
        switch (mat->types[p]) {
        case Q4_0: if (i8_q32_many_x(Q4_0, w, stride, first, last, n_blocks, x, m, out, out_stride)) return; break;
        case Q4_1: if (i8_q32_many_x(Q4_1, w, stride, first, last, n_blocks, x, m, out, out_stride)) return; break;
        case Q5_0: if (i8_q32_many_x(Q5_0, w, stride, first, last, n_blocks, x, m, out, out_stride)) return; break;
        case Q5_1: if (i8_q32_many_x(Q5_1, w, stride, first, last, n_blocks, x, m, out, out_stride)) return; break;
        case Q8_0:
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
            if (i8_q8_groups_many_x(w, stride, first, last, n_blocks, x, m, out, out_stride)) return;
#endif
            if (i8_q32_many_x(Q8_0, w, stride, first, last, n_blocks, x, m, out, out_stride)) return;
            break;
        default: break;
        }
    }
#endif
    for (int64_t r = first; r < last; r++) {
        const uint8_t *row = mat->w[p] + r * mat->strides[p];
        for (int64_t i = 0; i < m; i++)
            out[i * out_stride + r] = i8_row(mat->types[p], row, n_blocks, x + i * xblocks);
    }
}
