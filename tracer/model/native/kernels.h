/* What the native library's units share: a described matrix, the quantized activation rows, the vector helpers
 * every kernel inlines, and the functions one unit calls in another (hidden: the library exports only llmt_*).
 *
 * Units (each its own compilation unit, linked into the one library native_kernel.py builds):
 *   gguf_matmul.c  the "native" kernel (exact products), dequantization, llmt_describe/llmt_matmul, the references
 *   int8_dot.c     the "i8dot" kernel (activations rounded to int8)
 *   int8_groups.c  i8dot's Q4_0/Q4_1 rows interleaved in sixteens (the layout and its entry points)
 *   int16_dot.c    the "i16dot" kernel (activations rounded to int16; Q8_0 and Q6_K)
 *   decode_step.c  one decode step in one call, and decode steps back to back, the caller choosing each token
 *   scales.c       every fp16 scale of a file's stored blocks checked finite (the loader's check, in one pass)
 *   mapped_file.c  a SIGBUS inside a registered map of a GGUF (the file truncated under the run): one line, exit 2
 * Every kernel has a plain scalar reference beside its vector code (the *_reference functions), always compiled:
 * a build without AVX2 runs them, and llmt_matmul_reference runs them in any build, so tests hold each vector
 * kernel to its reference on every build.
 */

#ifndef LLMT_KERNELS_H
#define LLMT_KERNELS_H

#include "blocks.h"

#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define LLMT_INTERNAL __attribute__((visibility("hidden")))

enum { OK = 0, BAD_TYPE = 1, BAD_SHAPE = 2, NO_MEMORY = 3, NOT_FINITE = 4 }; /* NOT_FINITE: a scale NaN/infinite */
/* How a part's products take the activations: exact fp32, rounded to int8 (i8dot) or to int16 (i16dot: Q8_0, Q6_K) */
enum { EXACT_X = 0, INT8_X = 1, INT16_X = 2 };

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
    /* an i8dot Q4_0/Q4_1 part's rows interleaved in sixteens, or NULL (int8_groups.c) */
    const uint8_t *groups[MAX_PARTS];
} Matrix;

/* Block b of sixteen Q4_0 (Q4_1) rows interleaved for i8dot's products (int8_groups.c says why): the sixteen rows'
   d (and m) in row order, then 4 x 64 code bytes, vector v holding bytes 4v..4v+3 of each row's 16 in row order. */
#define GROUP_ROWS 16
typedef struct { ggml_half d[GROUP_ROWS]; uint8_t qs[4][4 * GROUP_ROWS]; } group_q4_0;
typedef struct { ggml_half d[GROUP_ROWS], m[GROUP_ROWS]; uint8_t qs[4][4 * GROUP_ROWS]; } group_q4_1;
_Static_assert(sizeof(group_q4_0) == GROUP_ROWS * sizeof(block_q4_0), "a group holds its rows' bytes");
_Static_assert(sizeof(group_q4_1) == GROUP_ROWS * sizeof(block_q4_1), "a group holds its rows' bytes");

/* One 32-value block of the int8 activations (int8_dot.c): scale, scale * sum of codes, codes. */
typedef struct {
    float d, s;
    int8_t q[32];
} XBlock;

/* One 32-value block of the int16 activations (int16_dot.c): scale, codes. */
typedef struct {
    float d;
    int16_t q[32];
} X16Block;

static inline int current_thread(int *count) {
#ifdef _OPENMP
    *count = omp_get_num_threads();
    return omp_get_thread_num();
#else
    *count = 1;
    return 0;
#endif
}

/* max |v[i]| over 32 values, and in *finite whether all 32 are finite (0: a NaN or an infinity among them) */
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
static inline void prefetch(const void *p) {
    _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
}

/* How far ahead the kernels that take several rows at a time (i8dot's groups of eight and K-quant rows, i16dot's)
   fetch along their run of memory. At a few cycles a row's block eight rows eat 2 KB in well under a DRAM access:
   with PREFETCH_BYTES' distance the eight-row kernel over the file's rows took 9.6 ms a decode step (p10), slower
   than one row at a time (7.4); 4 KB ahead 7.1, 8 KB 6.3, 16 KB 6.4 (BENCHMARKS "The i8dot kernel's eight rows"). */
#ifndef I8_AHEAD
#define I8_AHEAD 8192
#endif

/* the fp16 pair at p (d, and m or dmin after it) as lanes 0 and 1 */
static inline __m128 halves2(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}

/* Q6_K: half `half` of block q as four 32-value chunks of unsigned 6-bit codes (0..63): low nibbles of the half's
   first 32 ql bytes, of its next 32, then their high nibbles; bits 2c..2c+1 of qh are chunk c's top two bits (moved
   to bits 4-5 of each byte). The exact, int8 and int16 kernels unpack the same way. */
static inline void q6k_codes(const block_q6_K *q, int half, __m256i out[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(q->ql + 64 * half));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(q->ql + 64 * half + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(q->qh + 32 * half));
    out[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2));
    out[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2));
    out[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, top2));
    out[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                             _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2));
}

#endif /* LLMT_AVX2 */

/* ---- across units ------------------------------------------------------------------------------------------ */

/* gguf_matmul.c: exact dequantization (gguf.quants.dequantize's values), the exact kernel's activation row and rows */
LLMT_INTERNAL void dequantize_row(int type, const uint8_t *row, int64_t n_blocks, float *y);
LLMT_INTERNAL int x_order(int type);
LLMT_INTERNAL void prepare_x(int type, const float *x, int64_t k, float *xs, float *sx);
LLMT_INTERNAL void dot_rows(int type, const uint8_t *w, int64_t w_stride, int64_t first, int64_t last,
                            int64_t n_blocks, const float *xs, const float *sx, float *out);

/* int8_dot.c: x (k values) -> k/32 int8 blocks; rows first..last of part p times m such rows */
LLMT_INTERNAL void quantize_x(const float *x, int64_t k, XBlock *out);
LLMT_INTERNAL void quantize_x_reference(const float *x, int64_t k, XBlock *out);
LLMT_INTERNAL void i8_dot_rows(const Matrix *mat, int p, int64_t first, int64_t last, const XBlock *x, int64_t m,
                               float *out, int64_t out_stride);
LLMT_INTERNAL float i8_row_reference(int type, const uint8_t *row, int64_t n_blocks, const XBlock *x,
                                     double *magnitude);

/* int8_groups.c: row r of part p as the file stores it (gathered into scratch, row_bytes[p] bytes, when the part's
   whole groups are interleaved) */
LLMT_INTERNAL const uint8_t *part_row(const Matrix *mat, int p, int64_t r, uint8_t *scratch);
/* scales.c: 1 when every fp16 of h[0..n) is finite; 1 when every fp16 scale and min of n stored blocks of `type` is */
LLMT_INTERNAL int halves_finite(const ggml_half *h, int64_t n);
LLMT_INTERNAL int blocks_finite(int type, const uint8_t *blocks, int64_t n_blocks);

/* int16_dot.c: the same with int16 activations (Q8_0 and Q6_K parts) */
LLMT_INTERNAL void quantize_x16(const float *x, int64_t k, X16Block *out);
LLMT_INTERNAL void quantize_x16_reference(const float *x, int64_t k, X16Block *out);
LLMT_INTERNAL void i16_dot_rows(const Matrix *mat, int p, int64_t first, int64_t last, const X16Block *x,
                                int64_t m, float *out, int64_t out_stride);
LLMT_INTERNAL float i16_row_reference(int type, const uint8_t *row, int64_t n_blocks, const X16Block *x,
                                      double *magnitude);

#endif /* LLMT_KERNELS_H */
