/* llmtrace's "i16dot" stored kernel: y = x @ W.T with W in Q8_0 or Q6_K blocks and x rounded to 16-bit integers.
 *
 * One unit of the native library (kernels.h), called from gguf_matmul.c's entry points and decode_step.c's products
 * for the parts of a Matrix described with int16 activations (Q8_0 and Q6_K parts).
 *
 * Why: a Q8_0 matrix needs 11 significand bits (tracer/hardware/kernel_choice.py); the i8dot kernel's int8
 * activations keep ~7 and fail its probe, so a Q8_0 LM head ran on the exact kernel, which widens every int8 value to
 * fp32 and multiplies it with an fp32 activation (~18 instructions per 32 values: below the memory's pace). Here
 * the activation row is quantized once per product, per 32 values:
 *     d = max|x| / 32767,  q = round-to-nearest-even(x * 32767 / max|x|)  (int16, |q| <= 32767)
 * and each weight block's int8 codes c, sign-extended to int16, meet q in _mm256_madd_epi16 (vpmaddwd: pairs of
 * int16 products summed into int32): per block an int32 sum, exact (|c| <= 128, |q| <= 32767: at most 2^27 in
 * magnitude), converted to fp32 (one rounding, 2^-24 relative) and one fp32 multiply-add with d_w * d_x:
 *     sum x*w  ~=  sum (d_x*q) * (d_w*c)  =  (d_w*d_x) * sum(c*q)
 * Q6_K the same per 16 values: codes u - 32 (u the 6 bits, as q6k_codes unpacks them) widened to int16, each
 * sub-block's int32 sum times (d * sc) * d_x (i16_q6k_rows; a Q6_K matrix needs 9 bits, i8dot's probe fails it too).
 * Error bound: rounding moves each activation by at most d_x/2 = max|x|/65534 of its block, so
 *     |y - y_exact| <= sum over blocks of (max|x_block| / 65534) * sum|w_block|   (plus fp32 summation)
 * 258 times (32767/127) tighter than i8dot's. Like i8dot it declares no precision (kernel_choice.KERNEL_BITS): the
 * accuracy probe measures it on the model's own matrices and admits it per format.
 * A block of x holding a NaN or an infinity gets d = NaN, so the outputs it touches are NaN, never silently finite
 * (as quantize_x does). A block whose max|x| is so small that 32767 / max|x| overflows fp32 is rounded in double.
 *
 * Float math per row, the same whichever path computes it (so a row's value is bit for bit the same whatever the
 * thread split, the rows per pass, the integer instruction or the build, AVX2 or portable C: the integer sums are
 * exact): per block, in order,
 * acc = fma(d_w * d_x, (float)sum(c*q), acc). Decode takes a thread's rows eight at a time (i16_q8_rows8: x's block
 * loaded once for the eight, their sums folded into one vector, their scales converted in one), the rest one by one;
 * prefill takes tiles of 2 rows of W times 4 activation rows (i16_q8_tile: the 8 pairs folded the same way).
 * The scalar references (i16_q8_row_reference, i16_q6k_row_reference: what a build without AVX2 runs) do that float
 * math term for term, so every vector kernel here gives its reference's bits; quantize_x16 gives
 * quantize_x16_reference's codes bit for bit.
 */

#include "kernels.h"

/* x (k values, k a multiple of 32) -> k / 32 blocks, in scalar C */
void quantize_x16_reference(const float *x, int64_t k, X16Block *out) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *v = x + 32 * b;
        X16Block *o = out + b;
        int finite;
        const float amax = block_amax(v, &finite);
        if (!finite) {
            o->d = NAN;
            memset(o->q, 0, sizeof o->q);
            continue;
        }
        const float id = amax != 0.0f ? 32767.0f / amax : 0.0f;
        o->d = amax / 32767.0f;
        if (!(id < INFINITY)) { /* max|x| below 32767 / FLT_MAX: 32767 * v / max|x| <= 32767 exactly in double */
            for (int i = 0; i < 32; i++) o->q[i] = (int16_t)nearbyint((double)v[i] * 32767.0 / (double)amax);
            continue;
        }
        for (int i = 0; i < 32; i++) o->q[i] = (int16_t)nearbyintf(v[i] * id); /* nearest, ties to even */
    }
}

/* the same, sixteen values at a time (a block holding a NaN or an infinity, or so small that 32767 / max|x|
   overflows, goes to the reference) */
void quantize_x16(const float *x, int64_t k, X16Block *out) {
#if LLMT_AVX2
    for (int64_t b = 0; b < k / 32; b++) {
        const float *v = x + 32 * b;
        X16Block *o = out + b;
        int finite;
        const float amax = block_amax(v, &finite);
        const float id = amax != 0.0f ? 32767.0f / amax : 0.0f;
        if (!finite || !(id < INFINITY)) {
            quantize_x16_reference(v, 32, o);
            continue;
        }
        o->d = amax / 32767.0f;
        const __m256 scale = _mm256_set1_ps(id);
        for (int h = 0; h < 2; h++) { /* nearest, ties to even (default MXCSR); |v * id| <= 32767 */
            const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16 * h), scale));
            const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16 * h + 8), scale));
            /* packs interleaves the 128-bit lanes (values 0-3 8-11 4-7 12-15): the permute puts them in order */
            const __m256i q = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
            _mm256_storeu_si256((__m256i *)(o->q + 16 * h), q);
        }
    }
#else
    quantize_x16_reference(x, k, out);
#endif
}

/* ---- the scalar references ----------------------------------------------------------------------------------- */

/* one row of a Q6_K matrix times one int16 activation row: i16_q6k_rows' float math, term for term, so both give a
   product the same bits. Its 16 lanes (two vectors of 8, one per super-block half) are acc[16]: sub-block j (16
   values) of every super-block goes to acc[j] as fma((d * sc_j) * d_x, sum(c*q), acc[j]); the result is
   hsum(acc[0..8) + acc[8..16)) with hsum's pairing ((0+4) + (2+6)) + ((1+5) + (3+7)). *size += the sizes of the
   terms (|(d * sc_j) * d_x * c * q| per value). */
static float i16_q6k_row_reference(const uint8_t *row, int64_t n_blocks, const X16Block *x, double *size) {
    const block_q6_K *blocks = (const block_q6_K *)row;
    float acc[16] = {0.0f};
    for (int64_t b = 0; b < n_blocks; b++)
        for (int sub = 0; sub < 8; sub++) { /* 32 values: sub-blocks 2 sub and 2 sub + 1 */
            int c[32], lo = 0, hi = 0;
            float a0, a1, off;
            block_codes(Q6_K, blocks + b, sub, c, &a0, &a1, &off); /* a0, a1: d * sc, as the AVX2 kernel forms */
            const X16Block *xb = x + 8 * b + sub;
            for (int l = 0; l < 16; l++) lo += c[l] * xb->q[l];
            for (int l = 16; l < 32; l++) hi += c[l] * xb->q[l];
            acc[2 * sub] = fmaf(a0 * xb->d, (float)lo, acc[2 * sub]);
            acc[2 * sub + 1] = fmaf(a1 * xb->d, (float)hi, acc[2 * sub + 1]);
            for (int l = 0; l < 32; l++) *size += fabs((double)(l < 16 ? a0 : a1) * xb->d) * abs(c[l] * xb->q[l]);
        }
    float v[8];
    for (int l = 0; l < 8; l++) v[l] = acc[l] + acc[8 + l];
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* one row of a Q8_0 matrix times one int16 activation row: per block acc = fma(d_w * d_x, sum(c*q), acc), as
   i16_q8_row and i16_q8_rows8 do */
static float i16_q8_row_reference(const uint8_t *row, int64_t n_blocks, const X16Block *x, double *size) {
    const block_q8_0 *blocks = (const block_q8_0 *)row;
    float acc = 0.0f;
    for (int64_t b = 0; b < n_blocks; b++) {
        const float scale = half_to_float(blocks[b].d) * x[b].d;
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            sum += (int32_t)blocks[b].qs[j] * x[b].q[j];
            *size += fabs((double)scale) * abs((int32_t)blocks[b].qs[j] * x[b].q[j]);
        }
        acc = fmaf(scale, (float)sum, acc);
    }
    return acc;
}

float i16_row_reference(int type, const uint8_t *row, int64_t n_blocks, const X16Block *x, double *magnitude) {
    double size = 0.0;
    const float y = type == Q6_K ? i16_q6k_row_reference(row, n_blocks, x, &size)
                                 : i16_q8_row_reference(row, n_blocks, x, &size);
    if (magnitude != NULL) *magnitude = size;
    return y;
}

#if LLMT_AVX2

/* 8 int32 lanes: per lane the sum of 4 products of W's codes c (32 int8 at c) and x's codes (two halves of 16) */
static inline __attribute__((always_inline)) __m256i i16_block_sums(const int8_t *c, __m256i x_lo, __m256i x_hi) {
    const __m256i w_lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c));
    const __m256i w_hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16)));
    /* vpdpwssd (AVX-512 VNNI) in place of the second madd and the add measured no faster here (BENCHMARKS "Tenth
       session: the i16dot kernel") */
    return _mm256_add_epi32(_mm256_madd_epi16(w_lo, x_lo), _mm256_madd_epi16(w_hi, x_hi));
}

/* eight vectors of 8 int32 lanes -> one vector of their eight lane sums, in order (six hadds, two permutes, one add;
   per 128-bit lane the hadds sum vectors 0-3 and 4-7 over their low, resp. high, four lanes) */
static inline __attribute__((always_inline)) __m256i fold8(const __m256i s[8]) {
    const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}

/* Eight rows of a Q8_0 matrix (at w, w + stride, ...) times one int16 activation row, into out[0..8): each block of
   x loaded once for the eight; the rows' eight vectors of int32 lane sums folded into one vector of the eight rows'
   block sums (six hadds, two lane permutes, one add) and the eight rows' scales converted, multiplied with d_x and
   accumulated in one vector each. Per row the float math is i16_q8_row's. */
static inline __attribute__((always_inline)) void i16_q8_rows8(const uint8_t *w, int64_t stride, int64_t n_blocks,
                                                               const X16Block *x, float *out) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t from = b * (int64_t)sizeof(block_q8_0);
        const uint8_t *ahead = w + I8_AHEAD + 8 * from; /* the eight rows' run of memory */
        for (int line = 0; line < 8 * (int)sizeof(block_q8_0); line += 64)
            _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
        const __m256i x_lo = _mm256_loadu_si256((const __m256i *)x[b].q);
        const __m256i x_hi = _mm256_loadu_si256((const __m256i *)(x[b].q + 16));
        const block_q8_0 *blk[8];
        __m256i s[8];
        for (int i = 0; i < 8; i++) {
            blk[i] = (const block_q8_0 *)(w + i * stride) + b;
            s[i] = i16_block_sums(blk[i]->qs, x_lo, x_hi);
        }
        const __m256i total = fold8(s); /* rows 0..7 in order */
        const __m128i halves = _mm_setr_epi16((short)blk[0]->d, (short)blk[1]->d, (short)blk[2]->d, (short)blk[3]->d,
                                              (short)blk[4]->d, (short)blk[5]->d, (short)blk[6]->d, (short)blk[7]->d);
        const __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(halves), _mm256_set1_ps(x[b].d));
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(total), acc);
    }
    _mm256_storeu_ps(out, acc);
}

/* one row of a Q8_0 matrix times one int16 activation row: per block acc = fma(d_w * d_x, sum(c*q), acc) */
static inline __attribute__((always_inline)) float i16_q8_row(const uint8_t *row, int64_t n_blocks,
                                                              const X16Block *x) {
    float acc = 0.0f;
    for (int64_t b = 0; b < n_blocks; b++) {
        const block_q8_0 *blk = (const block_q8_0 *)row + b;
        const __m256i x_lo = _mm256_loadu_si256((const __m256i *)x[b].q);
        const __m256i x_hi = _mm256_loadu_si256((const __m256i *)(x[b].q + 16));
        acc = fmaf(half_to_float(blk->d) * x[b].d, (float)hsum_i32(i16_block_sums(blk->qs, x_lo, x_hi)), acc);
    }
    return acc;
}

/* Several activation rows (prefill): a tile of 2 rows of W times 4 activation rows, so each block's codes are widened
   once for 4 rows of x and each block of x loaded once for 2 rows of W. The 8 (row, x row) pairs' block sums are
   folded into one vector as i16_q8_rows8 folds eight rows' (lane 4j + i: row j, x row i), their scales d_w * d_x
   multiplied in one vector (dT: the 4 x rows' d per block, interleaved, dT[4b + i]); per pair the float math is
   i16_q8_row's. Rows beyond the matrix or x (a tile's padding) repeat the last one and are not written. */
static inline __attribute__((always_inline)) void i16_q8_tile(const uint8_t *r0, const uint8_t *r1, int64_t n_blocks,
                                                              const X16Block *const xr[4], const float *dT,
                                                              float out[8]) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const block_q8_0 *b0 = (const block_q8_0 *)r0 + b, *b1 = (const block_q8_0 *)r1 + b;
        __m256i s[8];
        for (int j = 0; j < 2; j++) {
            const int8_t *c = (j ? b1 : b0)->qs;
            const __m256i w_lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c));
            const __m256i w_hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16)));
            for (int i = 0; i < 4; i++)
                s[4 * j + i] = _mm256_add_epi32(
                    _mm256_madd_epi16(w_lo, _mm256_loadu_si256((const __m256i *)xr[i][b].q)),
                    _mm256_madd_epi16(w_hi, _mm256_loadu_si256((const __m256i *)(xr[i][b].q + 16))));
        }
        const __m256i total = fold8(s);
        const short h0 = (short)b0->d, h1 = (short)b1->d;
        const __m256 dw = _mm256_cvtph_ps(_mm_setr_epi16(h0, h0, h0, h0, h1, h1, h1, h1));
        const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ps((const __m128 *)(dT + 4 * b)));
        acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(total), acc);
    }
    _mm256_storeu_ps(out, acc);
}

/* rows first..last of a Q8_0 part times m >= 2 int16 activation rows: tiles of 2 x 4; 0 when the scratch cannot be
   had (the caller then takes each row alone) */
static int i16_q8_many_x(const uint8_t *w, int64_t stride, int64_t first, int64_t last, int64_t n_blocks,
                         const X16Block *x, int64_t m, float *out, int64_t out_stride) {
    float *dT = malloc(sizeof(float) * (size_t)(4 * n_blocks));
    if (dT == NULL) return 0;
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
        const X16Block *xr[4];
        for (int i = 0; i < 4; i++) xr[i] = x + (i0 + i < m ? i0 + i : m - 1) * n_blocks;
        for (int64_t b = 0; b < n_blocks; b++)
            for (int i = 0; i < 4; i++) dT[4 * b + i] = xr[i][b].d;
        for (int64_t r = first; r < last; r += 2) {
            const int64_t r1 = r + 1 < last ? r + 1 : r;
            float tile[8];
            i16_q8_tile(w + r * stride, w + r1 * stride, n_blocks, xr, dT, tile);
            for (int j = 0; j < (r + 1 < last ? 2 : 1); j++)
                for (int i = 0; i < 4 && i0 + i < m; i++) out[(i0 + i) * out_stride + r + j] = tile[4 * j + i];
        }
    }
    free(dT);
    return 1;
}

/* How many Q6_K rows i16_q6k_rows takes at a time, sharing x's loads and scales. */
#ifndef I16_K_ROWS
#define I16_K_ROWS 4
#endif

/* Q6_K: `rows` (<= I16_K_ROWS) rows of W times one int16 activation row, into out[0..rows). Per row and super-block
   half h (128 values, 8 sub-blocks of 16 with scales sc[8h..8h+7]): the 8 sub-blocks' sums of (u - 32) * q (int32,
   exact: 16 products of at most 32 * 32767) folded into one vector (lane l: sub-block 8h + l), converted, times
   (d * sc) * d_x in one vector, accumulated lane by lane into acc_h; result hsum(acc0 + acc1), bit for bit the same
   whatever `rows`. Codes unpacked as the exact and int8 kernels do (q6k_codes); the prefetch as i8_q6k_rows'. */
static inline __attribute__((always_inline)) void i16_q6k_rows(int rows, const uint8_t *w, int64_t stride,
                                                               int64_t n_blocks, const X16Block *x, float *out) {
    const __m256i thirty_two = _mm256_set1_epi16(32);
    __m256 acc[2][I16_K_ROWS];
    for (int i = 0; i < rows; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t from = b * (int64_t)sizeof(block_q6_K);
        const uint8_t *ahead = w + I8_AHEAD + rows * from;
        for (int line = 0; line < rows * (int)sizeof(block_q6_K); line += 64)
            _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
        const X16Block *xb = x + 8 * b;
        const __m256 xd[2] = {_mm256_setr_ps(xb[0].d, xb[0].d, xb[1].d, xb[1].d, xb[2].d, xb[2].d, xb[3].d, xb[3].d),
                              _mm256_setr_ps(xb[4].d, xb[4].d, xb[5].d, xb[5].d, xb[6].d, xb[6].d, xb[7].d, xb[7].d)};
        for (int i = 0; i < rows; i++) {
            const block_q6_K *blk = (const block_q6_K *)(w + i * stride + from);
            const __m256 d = _mm256_set1_ps(half_to_float(blk->d));
            const __m128i sc = _mm_loadu_si128((const __m128i *)blk->scales);
            const __m256 a[2] = {
                _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))), xd[0]),
                _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))), xd[1]),
            };
            for (int half = 0; half < 2; half++) {
                __m256i u[4], s[8];
                q6k_codes(blk, half, u);
                for (int c = 0; c < 4; c++) {
                    const X16Block *xc = xb + 4 * half + c;
                    const __m256i lo =
                        _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(u[c])), thirty_two);
                    const __m256i hi =
                        _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(u[c], 1)), thirty_two);
                    s[2 * c] = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xc->q));
                    s[2 * c + 1] = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xc->q + 16)));
                }
                acc[half][i] = _mm256_fmadd_ps(a[half], _mm256_cvtepi32_ps(fold8(s)), acc[half][i]);
            }
        }
    }
    for (int i = 0; i < rows; i++) out[i] = hsum(_mm256_add_ps(acc[0][i], acc[1][i]));
}

#endif /* LLMT_AVX2 */

/* rows first..last of part p (Q8_0 or Q6_K) times m int16 activation rows (k/32 blocks each, row i at x + i * (k/32)):
   out[i * out_stride + r] */
void i16_dot_rows(const Matrix *mat, int p, int64_t first, int64_t last, const X16Block *x, int64_t m, float *out,
                  int64_t out_stride) {
    const int64_t n_blocks = mat->k / mat->block_values[p], stride = mat->strides[p];
    const uint8_t *w = mat->w[p];
#if LLMT_AVX2
    if (mat->types[p] == Q6_K) {
        int64_t r = first;
        if (m == 1)
            for (; r + I16_K_ROWS <= last; r += I16_K_ROWS)
                i16_q6k_rows(I16_K_ROWS, w + r * stride, stride, n_blocks, x, out + r);
        for (; r < last; r++)
            for (int64_t i = 0; i < m; i++)
                i16_q6k_rows(1, w + r * stride, stride, n_blocks, x + i * (mat->k / 32), out + i * out_stride + r);
        return;
    }
    if (m == 1) {
        int64_t r = first;
        for (; r + 8 <= last; r += 8) i16_q8_rows8(w + r * stride, stride, n_blocks, x, out + r);
        for (; r < last; r++) out[r] = i16_q8_row(w + r * stride, n_blocks, x);
        return;
    }
    if (i16_q8_many_x(w, stride, first, last, n_blocks, x, m, out, out_stride)) return;
    for (int64_t r = first; r < last; r++)
        for (int64_t i = 0; i < m; i++)
            out[i * out_stride + r] = i16_q8_row(w + r * stride, n_blocks, x + i * n_blocks);
#else
    for (int64_t r = first; r < last; r++)
        for (int64_t i = 0; i < m; i++) {
            const X16Block *xi = x + i * (mat->k / 32);
            out[i * out_stride + r] = i16_row_reference(mat->types[p], w + r * stride, n_blocks, xi, NULL);
        }
#endif
}
