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
 * the numpy selection and to the sampler's reference figures. Included by decode_step.c (one library).
 */

#include <stdint.h>

#define LLMT_TOP_MAX 64 /* the most values one call selects: native_top.py asks for no more */

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
