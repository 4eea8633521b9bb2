/* The sampler's selection in one pass (tracer/model/native_top.py, for tracer/run/sampling.py): the indices of the
 * largest `count` values of a float32 vector, largest first, ties by lower index (argmax's order).
 *
 * Why: right after a decode step has streamed ~100 MB of weights, every cache line, TLB entry and code page the
 * sampler touches is cold, and numpy's selection of the top ten (a strided sample, a partition, a comparison pass,
 * a gather, a stable sort: ~8 calls) took ~0.2 ms a token that way. Here it is one pass that keeps the `count` best
 * seen so far and, with AVX2, compares eight values at a time against the worst of them; the pass also brings the
 * logits into cache for the numpy passes that follow.
 *
 * Exact by construction (comparisons only, no arithmetic on the values): tests/test_sampling_equality.py holds it to
 * the numpy selection and to the sampler's reference figures. One unit of the native library (kernels.h: its
 * entry points are declared there for decode_step.c's llmt_decode_ahead, with LLMT_TOP_MAX and LLMT_DRAW_BLOCK).
 */

#include "kernels.h"

/* Insert v (at index i) into the sorted best-so-far (values descending, indices ascending among equals): after every
 * kept value >= v, since those are larger or came first. With `count` held, v replaces the last (v > it). */
static inline int64_t top_insert(float *vals, int64_t *ids, int64_t held, int64_t count, float v, int64_t i) {
    int64_t at = held < count ? held : count - 1;
    for (; at > 0 && vals[at - 1] < v; at--) {
        vals[at] = vals[at - 1];
        ids[at] = ids[at - 1];
    }
    vals[at] = v;
    ids[at] = i;
    return held < count ? held + 1 : held;
}

/* ids[0 .. k) <- the indices of the k = min(count, n, LLMT_TOP_MAX) largest values, largest first, ties lower index
 * first. Returns k, or -1 when any value is NaN (the caller's numpy max then says so). */
int64_t llmt_top_values(const float *x, int64_t n, int64_t count, int64_t *ids) {
    float vals[LLMT_TOP_MAX];
    if (count > n) count = n;
    if (count > LLMT_TOP_MAX) count = LLMT_TOP_MAX;
    if (count < 1) return 0;
    int64_t held = 0, i = 0;
    int nan = 0;
    for (; i < n && held < count; i++) { /* the first values go in whatever they are, until `count` are held */
        if (x[i] == x[i]) held = top_insert(vals, ids, held, count, x[i], i);
        else nan = 1;
    }
#if LLMT_AVX2
    __m256 unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        int above = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(vals[count - 1]), _CMP_GT_OQ));
        while (above) { /* rare after the first few hundred values */
            int lane = __builtin_ctz((unsigned)above);
            above &= above - 1;
            if (x[i + lane] > vals[count - 1]) /* the bar rises as lanes go in */
                held = top_insert(vals, ids, held, count, x[i + lane], i + lane);
        }
    }
    if (_mm256_movemask_ps(unordered)) nan = 1;
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) nan = 1;
        else if (x[i] > vals[count - 1]) held = top_insert(vals, ids, held, count, x[i], i);
    }
    return nan ? -1 : held;
}

/* ---- the softmax's sums, the draw and the counts (native_top.py's SamplerPasses) ----------------------------------
 *
 * After the selection above, what the sampler computes over the whole vocabulary is a softmax's log-sum-exp and
 * entropy, sometimes with entries below a cut set to -inf (min-p, top-k ties), a draw from it, and counts. numpy
 * needs a subtraction, an exp, a sum, a product and another sum for one softmax (five cold passes, ~0.3 ms after a
 * decode step); here it is one pass that keeps nothing but two sums (and per-block sums for a draw).
 *
 * Not bit for bit numpy's fp32 figures: the weights are exp(s) with s = x - max in double, by llmt_exp_le0 below, and
 * summed in double. Its error bound (derived at llmt_exp_le0) is relative 4.1e-10 per weight, which native_top.py
 * turns into the tolerances sampling.py states; numpy's fp32 passes are only within ~1e-6 of the true values. */

#define LLMT_SAMPLER_ABI 1 /* bump when a signature below changes: native_kernel.py checks it */
#define LLMT_EXP_MIN (-708.0) /* below it 2^k leaves double's normal range: the weight is taken as 0 */

int llmt_sampler_abi(void) { return LLMT_SAMPLER_ABI; }

/* exp(s) for LLMT_EXP_MIN <= s <= 0 (callers mask the rest), as exp(s) = 2^k exp(r): k = s/ln2 rounded to nearest
 * (the 1.5 * 2^52 trick, which leaves k in the low mantissa bits), r = s - k ln2 in two parts (Cody and Waite: k ln2_hi
 * is exact for |k| < 2^11, so r is s - k ln2 to ~1e-16), |r| <= ln2/2, then the Taylor polynomial of degree 8 (in
 * Estrin's form: a shorter dependency chain than Horner's, which kept the pass waiting on latencies), then k added to
 * the exponent bits.
 * Error: the Taylor remainder is at most |r|^9/9! e^|r| = 0.3466^9/362880 * 1.415 = 2.8e-10 absolute on a value >=
 * e^-0.3466 = 0.707, so relative 4.0e-10; the ~15 double roundings add ~15 * 2^-53 = 1.7e-15, the reduction
 * |k| (ln2 - ln2_hi - ln2_lo) < 1e-16 * 1022; the total is under 4.1e-10 relative (native_top.SOFTMAX_WEIGHT_ERROR;
 * the worst measured against libm's exp over 2e8 values of s in [-708, 0] was 2.7e-10; tests/test_sampler_passes.py
 * checks values against math.exp).
 * The vector and scalar forms run the same operations in the same order (LLMT_MADD: fused where the vector form is,
 * so the scalar tail matches it), so they give the same bits: a value's weight does not depend on where a vector
 * lane fell. */
static const double llmt_log2e = 1.4426950408889634, llmt_shift = 6755399441055744.0; /* 1.5 * 2^52 */
static const double llmt_ln2_hi = 6.93147180369123816490e-01, llmt_ln2_lo = 1.90821492927058770002e-10;
static const double llmt_taylor[9] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                                      1.0 / 40320};
#if LLMT_AVX2 || defined(FP_FAST_FMA)
#define LLMT_MADD(a, b, c) fma((a), (b), (c)) /* one instruction here: the vector form's _mm256_fmadd_pd */
#else
#define LLMT_MADD(a, b, c) ((a) * (b) + (c)) /* no fast fma (a software one would cost ~50 ns a call) */
#endif

static inline double llmt_exp_le0(double s) {
    double t = LLMT_MADD(s, llmt_log2e, llmt_shift);
    double k = t - llmt_shift;
    double r = LLMT_MADD(-k, llmt_ln2_lo, LLMT_MADD(-k, llmt_ln2_hi, s));
    double r2 = r * r, r4 = r2 * r2;
    double ab = LLMT_MADD(r2, LLMT_MADD(r, llmt_taylor[3], llmt_taylor[2]), LLMT_MADD(r, llmt_taylor[1], llmt_taylor[0]));
    double cd = LLMT_MADD(r2, LLMT_MADD(r, llmt_taylor[7], llmt_taylor[6]), LLMT_MADD(r, llmt_taylor[5], llmt_taylor[4]));
    double p = LLMT_MADD(r4, LLMT_MADD(r4, llmt_taylor[8], cd), ab);
    uint64_t bits;
    memcpy(&bits, &t, sizeof bits);
    bits = (bits + 1023) << 52;
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The weight of one value: exp(x - max) when x >= cut and x - max >= LLMT_EXP_MIN, else 0; *shifted <- x - max
 * (clamped to LLMT_EXP_MIN, so a weight of 0 times it is 0, never 0 * -inf). */
static inline double llmt_weight(float x, double max, float cut, double *shifted) {
    double s = (double)x - max;
    if (s < LLMT_EXP_MIN) s = LLMT_EXP_MIN;
    *shifted = s;
    return (x >= cut && s > LLMT_EXP_MIN) ? llmt_exp_le0(s) : 0.0;
}

#if LLMT_AVX2
/* llmt_exp_le0's t (k in its low bits) and polynomial p for a vector s, in W-bit intrinsics (W: 256 or 512): one
 * spelling for both widths, so every lane runs the scalar form's operations in its order. */
#define LLMT_SET(W, v) _mm##W##_set1_pd(v)
/* c_j + c_(j+1) r */
#define LLMT_LINE(W, r, j) _mm##W##_fmadd_pd(r, LLMT_SET(W, llmt_taylor[j + 1]), LLMT_SET(W, llmt_taylor[j]))
#define LLMT_EXP_PARTS(W, s, t, p)                                                                                     \
    __m##W##d t = _mm##W##_fmadd_pd(s, LLMT_SET(W, llmt_log2e), LLMT_SET(W, llmt_shift));                              \
    __m##W##d p;                                                                                                       \
    {                                                                                                                  \
        __m##W##d k_ = _mm##W##_sub_pd(t, LLMT_SET(W, llmt_shift));                                                    \
        __m##W##d r_ = _mm##W##_fnmadd_pd(k_, LLMT_SET(W, llmt_ln2_lo),                                                \
                                          _mm##W##_fnmadd_pd(k_, LLMT_SET(W, llmt_ln2_hi), s));                        \
        __m##W##d r2_ = _mm##W##_mul_pd(r_, r_), r4_ = _mm##W##_mul_pd(r2_, r2_);                                      \
        __m##W##d ab_ = _mm##W##_fmadd_pd(r2_, LLMT_LINE(W, r_, 2), LLMT_LINE(W, r_, 0));                              \
        __m##W##d cd_ = _mm##W##_fmadd_pd(r2_, LLMT_LINE(W, r_, 6), LLMT_LINE(W, r_, 4));                              \
        p = _mm##W##_fmadd_pd(r4_, _mm##W##_fmadd_pd(r4_, LLMT_SET(W, llmt_taylor[8]), cd_), ab_);                     \
    }

static inline __m256d llmt_exp_le0_4(__m256d s) {
    LLMT_EXP_PARTS(256, s, t, p)
    __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(_mm256_castpd_si256(t), _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(p, _mm256_castsi256_pd(bits));
}

/* Four weights as llmt_weight gives them (x4: four floats), and their clamped shifts in *shifted. */
static inline __m256d llmt_weight_4(__m128 x4, __m256d max, __m128 cut, __m256d *shifted) {
    __m256d floor = _mm256_set1_pd(LLMT_EXP_MIN);
    __m256d s = _mm256_max_pd(_mm256_sub_pd(_mm256_cvtps_pd(x4), max), floor); /* max(-inf, floor) = floor */
    *shifted = s;
    __m256d at_or_above_cut = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm_castps_si128(_mm_cmpge_ps(x4, cut))));
    __m256d keep = _mm256_and_pd(at_or_above_cut, _mm256_cmp_pd(s, floor, _CMP_GT_OQ));
    return _mm256_and_pd(llmt_exp_le0_4(s), keep);
}
#endif

#if LLMT_AVX2 && defined(__AVX512F__) && defined(__AVX512VL__)
/* Eight weights at once, lane for lane llmt_weight_4's operations on x8's halves (lanes 0-3 its first four floats,
 * 4-7 its last four): the same bits for each value; a masked lane is +0, as llmt_weight_4's and-ed one is. */
static inline __m512d llmt_weight_8(__m256 x8, __m512d max, __m256 cut, __m512d *shifted) {
    __m512d floor = _mm512_set1_pd(LLMT_EXP_MIN);
    __m512d s = _mm512_max_pd(_mm512_sub_pd(_mm512_cvtps_pd(x8), max), floor);
    *shifted = s;
    __mmask8 keep = _mm256_cmp_ps_mask(x8, cut, _CMP_GE_OQ) & _mm512_cmp_pd_mask(s, floor, _CMP_GT_OQ);
    LLMT_EXP_PARTS(512, s, t, p)
    __m512i bits = _mm512_slli_epi64(_mm512_add_epi64(_mm512_castpd_si512(t), _mm512_set1_epi64(1023)), 52);
    return _mm512_maskz_mul_pd(keep, p, _mm512_castsi512_pd(bits));
}
#endif

/* One block's sum of weights and of weight * shift, over x[start .. end). */
static void llmt_block_sums(const float *x, int64_t start, int64_t end, double max, float cut, double *total,
                            double *weighted) {
    double w_sum = 0.0, ws_sum = 0.0, shifted;
    int64_t i = start;
#if LLMT_AVX2 && defined(__AVX512F__) && defined(__AVX512VL__)
    /* The AVX2 loop below in one register: lanes 0-3 are its `_lo` sums, 4-7 its `_hi` sums, each added in the same
     * order, and the halves added as it adds them, so the sums have its bits (tests/test_sampler_passes.py compares
     * a build without AVX-512); eight doubles an instruction take half the instructions. */
    __m512d w8 = _mm512_setzero_pd(), ws8 = w8, max8 = _mm512_set1_pd(max), s8;
    __m256 cut8 = _mm256_set1_ps(cut);
    for (; i + 8 <= end; i += 8) {
        __m512d a = llmt_weight_8(_mm256_loadu_ps(x + i), max8, cut8, &s8);
        w8 = _mm512_add_pd(w8, a);
        ws8 = _mm512_fmadd_pd(a, s8, ws8);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm512_castpd512_pd256(w8), _mm512_extractf64x4_pd(w8, 1)));
    w_sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm512_castpd512_pd256(ws8), _mm512_extractf64x4_pd(ws8, 1)));
    ws_sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#elif LLMT_AVX2
    /* eight values an iteration in two independent halves: more work in flight for the out-of-order core */
    __m256d w_lo = _mm256_setzero_pd(), w_hi = w_lo, ws_lo = w_lo, ws_hi = w_lo, max4 = _mm256_set1_pd(max), s_lo, s_hi;
    __m128 cut4 = _mm_set1_ps(cut);
    for (; i + 8 <= end; i += 8) {
        __m256d a = llmt_weight_4(_mm_loadu_ps(x + i), max4, cut4, &s_lo);
        __m256d b = llmt_weight_4(_mm_loadu_ps(x + i + 4), max4, cut4, &s_hi);
        w_lo = _mm256_add_pd(w_lo, a);
        w_hi = _mm256_add_pd(w_hi, b);
        ws_lo = _mm256_fmadd_pd(a, s_lo, ws_lo);
        ws_hi = _mm256_fmadd_pd(b, s_hi, ws_hi);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(w_lo, w_hi));
    w_sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    _mm256_storeu_pd(lanes, _mm256_add_pd(ws_lo, ws_hi));
    ws_sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
    for (; i < end; i++) {
        double w = llmt_weight(x[i], max, cut, &shifted);
        w_sum += w;
        ws_sum = LLMT_MADD(w, shifted, ws_sum);
    }
    *total = w_sum;
    *weighted = ws_sum;
}

/* Over x[0 .. n) with w_i = exp(x_i - max) for x_i >= cut (cut = -inf: every value), else 0; `max` must be the
 * largest x_i (no shift is positive): sums[0] <- sum w_i, sums[1] <- sum w_i (x_i - max), in double, added block by
 * block (LLMT_DRAW_BLOCK values) in index order; blocks (NULL: not wanted) <- each block's sum of w_i, for
 * llmt_softmax_draw. Returns how many x_i >= cut. The log-sum-exp is max + log(sums[0]), the entropy
 * log(sums[0]) - sums[1] / sums[0] (nats). */
int64_t llmt_softmax_sums(const float *x, int64_t n, float max, float cut, double *sums, double *blocks) {
    double total = 0.0, weighted = 0.0;
    int64_t kept = 0;
    for (int64_t start = 0, b = 0; start < n; start += LLMT_DRAW_BLOCK, b++) {
        int64_t end = start + LLMT_DRAW_BLOCK < n ? start + LLMT_DRAW_BLOCK : n;
        double t, ws;
        llmt_block_sums(x, start, end, (double)max, cut, &t, &ws);
        total += t;
        weighted += ws;
        if (blocks) blocks[b] = t;
    }
    if (cut == -INFINITY) kept = n;
    else
        for (int64_t i = 0; i < n; i++) kept += x[i] >= cut;
    sums[0] = total;
    sums[1] = weighted;
    return kept;
}

/* The inverse-CDF draw from the weights llmt_softmax_sums summed (the same x, max, cut, and its `blocks`): the first
 * index whose running sum of weights exceeds target (u * sums[0], u uniform in [0, 1)). Two levels: the block totals,
 * then the weights of one block, computed again (the same bits). Never an index of weight 0: when rounding puts the
 * target at or past a running sum's end, the last index of nonzero weight before it. */
int64_t llmt_softmax_draw(const float *x, int64_t n, float max, float cut, const double *blocks, double target) {
    int64_t n_blocks = (n + LLMT_DRAW_BLOCK - 1) / LLMT_DRAW_BLOCK, b = 0, last = -1;
    double before = 0.0;
    for (; b < n_blocks; b++) {
        if (blocks[b] > 0) last = b;
        if (before + blocks[b] > target) break;
        before += blocks[b];
    }
    if (b == n_blocks) { /* rounding put the target at the total: the last nonzero weight of the last such block */
        if (last < 0) return -1;
        b = last;
        target = INFINITY;
    }
    int64_t start = b * LLMT_DRAW_BLOCK, end = start + LLMT_DRAW_BLOCK < n ? start + LLMT_DRAW_BLOCK : n;
    double running = before, shifted;
    int64_t chosen = -1;
    for (int64_t i = start; i < end; i++) {
        double w = llmt_weight(x[i], (double)max, cut, &shifted);
        if (w > 0) {
            chosen = i;
            running += w;
            if (running > target) return i;
        }
    }
    return chosen;
}

/* #{i : x_i > v} + #{i < index : x_i == v}: with v = x[index], index's rank - 1 among the values sorted largest
 * first, ties lower index first; with index = n, how many x_i >= v. */
int64_t llmt_count_before(const float *x, int64_t n, float v, int64_t index) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) count += (x[i] > v) | ((i < index) & (x[i] == v));
    return count;
}

/* The selection and the softmax of the same vector in one call (one ctypes call a token instead of two): ids as
 * llmt_top_values gives them and values[j] = x[ids[j]], then, when the largest value is finite, llmt_softmax_sums
 * over x shifted by it, no cut, into sums (and blocks, when not NULL). Returns llmt_top_values's count, or -1 for a
 * NaN (values and sums then unwritten). */
int64_t llmt_top_softmax(const float *x, int64_t n, int64_t count, int64_t *ids, float *values, double *sums,
                         double *blocks) {
    int64_t k = llmt_top_values(x, n, count, ids);
    if (k < 1) return k;
    for (int64_t j = 0; j < k; j++) values[j] = x[ids[j]];
    if (isfinite(values[0])) llmt_softmax_sums(x, n, values[0], -INFINITY, sums, blocks);
    return k;
}
