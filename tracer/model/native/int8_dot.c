/* llmtrace's "i8dot" stored kernel: y = x @ W.T with W in a GGUF's own blocks and x rounded to 8-bit integers.
 *
 * #included by gguf_matmul.c (one unity build; it uses that file's block helpers) and called from its entry points
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
 *   Q8_0 c = int8 (signed),         a = d_w,        b = 0
 *   Q4_K c = nibble, per 32 values  a = d * sc,     b = -dmin * m
 *   Q5_K c = nibble | bit4,         a = d * sc,     b = -dmin * m
 *   Q6_K c = 6 bits - 32 (signed),  a = d * sc per 16 values, b = 0
 * (a and b exactly as the exact kernel's dequantization forms them). The integer sums are exact; the result differs
 * from the exact product only by the rounding of x: at most d/2 per value, so |error| <= sum over blocks of
 * d/2 * sum|w| (plus fp32 summation). Whether that is close enough for a model is not declared here: the kernel
 * choice's accuracy probe measures it on the model's own matrices (tracer/hardware/kernel_choice.py).
 * A block of x holding a NaN or an infinity gets d = s = NaN, so the outputs it touches are NaN, never silently
 * finite. One activation row: each row of W read once; several rows: each row of W, while in L1, times every
 * quantized activation row. The portable C path computes the same sums without AVX2.
 */

/* One 32-value block of the quantized activations: scale, scale * sum of codes, codes. */
typedef struct {
    float d, s;
    int8_t q[32];
} XBlock;

/* max |v[i]| over 32 values, and in *finite whether all 32 are finite (0: a NaN or an infinity among them); the
   int16 activations (int16_dot.c) share it */
static inline float block_amax(const float *v, int *finite) {
#if LLMT_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i));
        top = _mm256_max_ps(top, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ)); /* NaN or infinite */
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    *finite = _mm256_movemask_ps(bad) == 0;
    return _mm_cvtss_f32(t);
#else
    float amax = 0.0f;
    *finite = 1;
    for (int i = 0; i < 32; i++) {
        const float a = fabsf(v[i]);
        if (!(a < INFINITY)) *finite = 0;
        amax = a > amax ? a : amax;
    }
    return amax;
#endif
}

/* x (k values, k a multiple of 32) -> k / 32 blocks */
static void quantize_x(const float *x, int64_t k, XBlock *out) {
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
        int sum = 0;
        if (!(id < INFINITY)) { /* max|x| below 127 / FLT_MAX: 127 * v / max|x| <= 127 exactly in double */
            for (int i = 0; i < 32; i++) {
                o->q[i] = (int8_t)nearbyint((double)v[i] * 127.0 / (double)amax);
                sum += o->q[i];
            }
            o->d = d;
            o->s = d * (float)sum;
            continue;
        }
#if LLMT_AVX2
        const __m256 scale = _mm256_set1_ps(id);
        /* nearest, ties to even (default MXCSR) */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), scale));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), scale));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), scale));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), scale));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        sum = hsum_i32(total);
        /* packs interleave the 128-bit lanes: values 0-3 16-19 4-7 20-23 ... put back in order by the permute */
        i0 = _mm256_packs_epi32(i0, i1);
        i2 = _mm256_packs_epi32(i2, i3);
        i0 = _mm256_packs_epi16(i0, i2);
        i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)o->q, i0);
#else
        for (int i = 0; i < 32; i++) {
            const int q = (int)nearbyintf(v[i] * id); /* the default rounding mode: nearest, ties to even */
            o->q[i] = (int8_t)q;
            sum += q;
        }
#endif
        o->d = d;
        o->s = d * (float)sum;
    }
}

/* ---- portable C (builds without AVX2): a block's codes and scales, then integer sums ------------------------ */

#if !LLMT_AVX2

/* Sub-block `sub` (32 values) of the block at b: codes c, the scales a0 (values 0-15) and a1 (16-31), offset off */
static void block_codes(int type, const uint8_t *b, int sub, int c[32], float *a0, float *a1, float *off) {
    switch (type) {
    case Q4_0:
    case Q4_1: {
        const int has_min = type == Q4_1;
        const float d = half_to_float(b);
        const uint8_t *qs = b + 2 + 2 * has_min;
        for (int j = 0; j < 16; j++) {
            c[j] = qs[j] & 0x0F;
            c[j + 16] = qs[j] >> 4;
        }
        *a0 = *a1 = d;
        *off = has_min ? half_to_float(b + 2) : -8.0f * d;
        return;
    }
    case Q5_0:
    case Q5_1: {
        const int has_min = type == Q5_1;
        const float d = half_to_float(b);
        const uint32_t qh = read_u32(b + 2 + 2 * has_min);
        const uint8_t *qs = b + 6 + 2 * has_min;
        for (int j = 0; j < 16; j++) {
            c[j] = (qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            c[j + 16] = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
        }
        *a0 = *a1 = d;
        *off = has_min ? half_to_float(b + 2) : -16.0f * d;
        return;
    }
    case Q8_0: {
        for (int j = 0; j < 32; j++) c[j] = (int8_t)b[2 + j];
        *a0 = *a1 = half_to_float(b);
        *off = 0.0f;
        return;
    }
    case Q4_K:
    case Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        uint8_t sc, m;
        scale_min_k4(b + 4, sub, &sc, &m);
        const uint8_t *qs = (type == Q4_K ? b + 16 : b + 48) + 32 * (sub / 2);
        for (int l = 0; l < 32; l++) {
            c[l] = (qs[l] >> (4 * (sub & 1))) & 0x0F;
            if (type == Q5_K) c[l] |= ((b[16 + l] >> sub) & 1) << 4;
        }
        *a0 = *a1 = d * (float)sc;
        *off = -(dmin * (float)m);
        return;
    }
    case Q6_K: {
        const float d = half_to_float(b + 208);
        const int half = sub / 4, chunk = sub % 4;
        const uint8_t *ql = b + 64 * half + (chunk & 1) * 32, *qh = b + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * half + 2 * chunk;
        for (int l = 0; l < 32; l++) {
            const int low = chunk < 2 ? ql[l] & 0x0F : ql[l] >> 4;
            c[l] = (low | (((qh[l] >> (2 * chunk)) & 3) << 4)) - 32;
        }
        *a0 = d * (float)sc[0];
        *a1 = d * (float)sc[1];
        *off = 0.0f;
        return;
    }
    default:
        return;
    }
}

static float i8_row_portable(int type, const uint8_t *row, int64_t n_blocks, int64_t block_values, int64_t block_bytes,
                             const XBlock *x) {
    const int subs = (int)(block_values / 32);
    float acc = 0.0f;
    for (int64_t b = 0; b < n_blocks; b++) {
        for (int s = 0; s < subs; s++) {
            int c[32] = {0};
            float a0 = 0.0f, a1 = 0.0f, off = 0.0f;
            block_codes(type, row + b * block_bytes, s, c, &a0, &a1, &off);
            const XBlock *xb = x + b * subs + s;
            int lo = 0, hi = 0;
            for (int l = 0; l < 16; l++) lo += c[l] * xb->q[l];
            for (int l = 16; l < 32; l++) hi += c[l] * xb->q[l];
            acc += (a0 * xb->d) * (float)lo + (a1 * xb->d) * (float)hi + off * xb->s;
        }
    }
    return acc;
}
#endif /* !LLMT_AVX2 */

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

/* one block of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0: (d_w * d_x) * sum(c*q) into acc, offset * s_x into off */
static inline __attribute__((always_inline)) void i8_q32_block(int type, const uint8_t *blk, const XBlock *x, __m256 *acc, __m128 *off) {
    const __m128 dm = _mm_cvtph_ps(load_u32(blk)); /* d, and m for Q4_1/Q5_1 (Q4_0's next bytes: unused) */
    __m256 p;
    __m128 offset; /* lane 0: the block's offset b (w = d*c + b) */
    switch (type) {
    case Q4_0:
        p = dot_us(nibble_bytes(blk + 2), xcodes(x));
        offset = _mm_mul_ss(dm, _mm_set_ss(-8.0f));
        break;
    case Q4_1:
        p = dot_us(nibble_bytes(blk + 4), xcodes(x));
        offset = _mm_movehdup_ps(dm);
        break;
    case Q5_0:
        p = dot_us(_mm256_or_si256(nibble_bytes(blk + 6), fifth_bits32(read_u32(blk + 2))), xcodes(x));
        offset = _mm_mul_ss(dm, _mm_set_ss(-16.0f));
        break;
    case Q5_1:
        p = dot_us(_mm256_or_si256(nibble_bytes(blk + 8), fifth_bits32(read_u32(blk + 4))), xcodes(x));
        offset = _mm_movehdup_ps(dm);
        break;
    default: /* Q8_0 */
        p = dot_ss(_mm256_loadu_si256((const __m256i *)(blk + 2)), xcodes(x));
        offset = _mm_setzero_ps();
        break;
    }
    const __m128 ds = _mm_load_ss(&x->d), ss = _mm_load_ss(&x->s);
    *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_mul_ss(dm, ds)), p, *acc);
    if (type != Q8_0) *off = _mm_fmadd_ss(offset, ss, *off);
}

static inline __attribute__((always_inline)) int64_t q32_bytes(int type) {
    switch (type) {
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    default: return 18;
    }
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

/* one block of Q4_0..Q8_0 as codes (32 bytes: unsigned, or signed for Q8_0), d_w and the offset b (lane 0 each) */
static inline __attribute__((always_inline)) __m256i q32_codes(int type, const uint8_t *blk, __m128 *d, __m128 *off) {
    const __m128 dm = _mm_cvtph_ps(load_u32(blk));
    *d = dm;
    switch (type) {
    case Q4_0: *off = _mm_mul_ss(dm, _mm_set_ss(-8.0f)); return nibble_bytes(blk + 2);
    case Q4_1: *off = _mm_movehdup_ps(dm); return nibble_bytes(blk + 4);
    case Q5_0:
        *off = _mm_mul_ss(dm, _mm_set_ss(-16.0f));
        return _mm256_or_si256(nibble_bytes(blk + 6), fifth_bits32(read_u32(blk + 2)));
    case Q5_1:
        *off = _mm_movehdup_ps(dm);
        return _mm256_or_si256(nibble_bytes(blk + 8), fifth_bits32(read_u32(blk + 4)));
    default: *off = _mm_setzero_ps(); return _mm256_loadu_si256((const __m256i *)(blk + 2));
    }
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
                dT[4 * b + i] = xr[i][b].d;
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

/* one Q4_0/Q4_1 row with i8_q4_group's per-row float math (int8_groups.c: a row outside a whole group of eight) */
static inline __attribute__((always_inline)) float i8_q4_row(int type, const uint8_t *row, int64_t n_blocks,
                                                             const XBlock *x) {
    const int64_t bytes = q32_bytes(type), codes = type == Q4_1 ? 4 : 2;
    float acc = 0.0f, off = 0.0f;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = row + b * bytes;
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(nibble_bytes(blk + codes), xcodes(x + b)),
                                            _mm256_set1_epi16(1));
        const float d = half_to_float(blk);
        acc = fmaf(d * x[b].d, (float)hsum_i32(p), acc);
        off = fmaf(type == Q4_1 ? half_to_float(blk + 2) : d * -8.0f, x[b].s, off);
    }
    return acc + off;
}

#endif /* LLMT_AVX2 */

#include "int8_groups.c" /* Q4_0/Q4_1 rows interleaved in eights: their decode kernel and its entry points */

#if LLMT_AVX2

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
    const int64_t bytes = type == Q4_K ? 144 : 176;
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
            const uint8_t *blk = w + i * stride + from;
            const __m128 dd = _mm_cvtph_ps(load_u32(blk));
            uint64_t sc8, m8; /* the eight scales and mins as bytes (gguf_matmul.c's k4_scales), widened to fp32 */
            k4_scales(blk + 4, &sc8, &m8);
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)));
            const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8)));
            const __m256 a = _mm256_mul_ps(_mm256_mul_ps(_mm256_broadcastss_ps(dd), sc), xd);
            const __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), m), xs);
            const __m256 pairs = _mm256_add_ps(t, _mm256_permute_ps(t, 0xB1)); /* lane 2p: t_2p + t_2p+1 */
            const uint8_t *qs = type == Q4_K ? blk + 16 : blk + 48;
            const __m256i qh = type == Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : zero;
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
        const int64_t from = b * 210;
        const uint8_t *ahead = w + I8_AHEAD + rows * from;
        for (int line = 0; line < rows * 210; line += 64) _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
        const XBlock *xb = x + 8 * b;
        const __m256 xd[2] = {_mm256_i32gather_ps(&xb[0].d, at, 4), _mm256_i32gather_ps(&xb[4].d, at, 4)};
        __m256i minus[8]; /* per lane -32 * (sum of x's 4 codes) */
        for (int j = 0; j < 8; j++)
            minus[j] = _mm256_sub_epi32(zero, dot4_add(zero, thirty_two, xcodes(xb + j)));
        for (int i = 0; i < rows; i++) {
            const uint8_t *blk = w + i * stride + from;
            const __m128i d16 = _mm_cvtsi32_si128(blk[208] | (blk[209] << 8)); /* d ends the block: read no further */
            const __m256 d = _mm256_broadcastss_ps(_mm_cvtph_ps(d16));
            const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
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
static inline float i8_row(int type, const uint8_t *row, int64_t n_blocks, int64_t block_values, int64_t block_bytes,
                           const XBlock *x) {
#if LLMT_AVX2
    (void)block_values;
    (void)block_bytes;
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
    return i8_row_portable(type, row, n_blocks, block_values, block_bytes, x);
#endif
}

/* rows first..last of part p times m quantized activation rows (k/32 blocks each, row i at x + i * (k/32)):
   out[i * out_stride + r]; each row of W stays in L1 while every activation row passes over it */
static void i8_dot_rows(const Matrix *mat, int p, int64_t first, int64_t last, const XBlock *x, int64_t m,
                        float *out, int64_t out_stride) {
    const int64_t xblocks = mat->k / 32, n_blocks = mat->k / mat->block_values[p];
#if LLMT_AVX2
    if (m == 1) { /* decode: one loop per type */
        const uint8_t *w = mat->w[p];
        const int64_t stride = mat->strides[p];
        switch (mat->types[p]) {
        case Q4_0: i8_q4_rows(Q4_0, w, stride, mat->groups[p], first, last, n_blocks, x, out); return;
        case Q4_1: i8_q4_rows(Q4_1, w, stride, mat->groups[p], first, last, n_blocks, x, out); return;
        case Q5_0: i8_q32_one_x(Q5_0, w, stride, first, last, n_blocks, x, out); return;
        case Q5_1: i8_q32_one_x(Q5_1, w, stride, first, last, n_blocks, x, out); return;
        case Q8_0: i8_q32_one_x(Q8_0, w, stride, first, last, n_blocks, x, out); return;
        case Q4_K: i8_k_one_x(Q4_K, w, stride, first, last, n_blocks, x, out); return;
        case Q5_K: i8_k_one_x(Q5_K, w, stride, first, last, n_blocks, x, out); return;
        case Q6_K: i8_k_one_x(Q6_K, w, stride, first, last, n_blocks, x, out); return;
        default: break;
        }
    }
    if (m > 1) { /* prefill: 2 x 4 tiles (falls through to the row loop below only if the scratch cannot be had) */
        const uint8_t *w = mat->w[p];
        const int64_t stride = mat->strides[p];
        switch (mat->types[p]) {
        case Q4_0: if (i8_q32_many_x(Q4_0, w, stride, first, last, n_blocks, x, m, out, out_stride)) return; break;
        case Q4_1: if (i8_q32_many_x(Q4_1, w, stride, first, last, n_blocks, x, m, out, out_stride)) return; break;
        case Q5_0: if (i8_q32_many_x(Q5_0, w, stride, first, last, n_blocks, x, m, out, out_stride)) return; break;
        case Q5_1: if (i8_q32_many_x(Q5_1, w, stride, first, last, n_blocks, x, m, out, out_stride)) return; break;
        case Q8_0: if (i8_q32_many_x(Q8_0, w, stride, first, last, n_blocks, x, m, out, out_stride)) return; break;
        default: break;
        }
    }
#endif
    for (int64_t r = first; r < last; r++) {
        const uint8_t *row = mat->w[p] + r * mat->strides[p];
        for (int64_t i = 0; i < m; i++)
            out[i * out_stride + r] = i8_row(mat->types[p], row, n_blocks, mat->block_values[p], mat->block_bytes[p],
                                             x + i * xblocks);
    }
}
