/* Every fp16 scale (and min) of a file's stored blocks checked finite, in one pass on the library's threads.
 *
 * One unit of the native library (kernels.h). Why in C: the loader refuses a file whose blocks hold a NaN or an
 * infinity among their scales (a corrupt file: every product it touches would be NaN), and it checks each block the
 * kernels read. numpy's strided fp16 views did it at 2-4 GB/s of blocks on one thread (0.6 s of a 7B Q4_0 load,
 * 1.7 s of a 7B Q8_0 one, BENCHMARKS.md, issue 31); here the test is an integer one (an fp16 is NaN or infinite
 * exactly when its five exponent bits are all set) over the blocks' bytes, on `threads` threads.
 */

#include "kernels.h"

/* Byte offsets of a block's fp16 fields (ggml-common.h), as the loader's Python check lists them
   (weight_formats._FP16_FIELDS); *count 0 for a type without any here. */
static void fp16_fields(int type, int offsets[2], int *count) {
    *count = 1;
    offsets[0] = 0;
    offsets[1] = 2;
    switch (type) {
    case Q4_1: case Q5_1: case Q4_K: case Q5_K: *count = 2; break;
    case Q4_0: case Q5_0: case Q8_0: break;
    case Q6_K: offsets[0] = offsetof(block_q6_K, d); break;
    default: *count = 0;
    }
}

/* 1 when an fp16's bits are a NaN or an infinity (exponent all ones) */
static inline int half_bad(ggml_half h) { return (h & 0x7C00) == 0x7C00; }

int halves_finite(const ggml_half *h, int64_t n) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= half_bad(h[i]);
    return !bad;
}

int blocks_finite(int type, const uint8_t *blocks, int64_t n_blocks) {
    int64_t values, bytes;
    int offsets[2], count, bad = 0;
    fp16_fields(type, offsets, &count);
    if (!block_shape(type, &values, &bytes)) return 1;
    for (int64_t b = 0; b < n_blocks; b++)
        for (int f = 0; f < count; f++) {
            ggml_half h;
            memcpy(&h, blocks + b * bytes + offsets[f], sizeof h);
            bad |= half_bad(h);
        }
    return !bad;
}

/* Blocks [0, n_blocks) of `type` at `blocks`, on up to `threads` threads: 1 when every fp16 field is finite, 0 when
   one is not, -1 for a type the library does not read or a bad count (the caller checks such a tensor another way). */
int llmt_scales_finite(int type, const uint8_t *blocks, int64_t n_blocks, int threads) {
    int64_t values, bytes;
    int offsets[2], count;
    fp16_fields(type, offsets, &count);
    if (!block_shape(type, &values, &bytes) || count == 0 || n_blocks < 0) return -1;
    const int64_t chunk = 1 << 16; /* blocks a task: 1-14 MB, a few hundred tasks at 7B */
    int bad = 0;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1 && n_blocks > chunk) reduction(| : bad) schedule(dynamic)
#endif
    for (int64_t first = 0; first < n_blocks; first += chunk)
        bad |= !blocks_finite(type, blocks + first * bytes, n_blocks - first < chunk ? n_blocks - first : chunk);
    return !bad;
}
