/* Q4_0/Q4_1 rows interleaved in groups of sixteen for the i8dot kernel's products.
 *
 * One unit of the native library (kernels.h): the layout and the entry points that make and attach it; the kernel
 * that reads it is int8_dot.c's i8_q4_group (a row outside a whole group: i8_q4_row).
 *
 * Why: in the GGUF's own layout a row's block is its 2 or 4 bytes of fp16 scales, then 16 code bytes; rows
 * multiplied together (each block of x loaded once for all of them) spend more instructions gathering each row's
 * scales and codes into vectors (scalar loads, inserts, permutes, a tree of hadds) than on the dot products. At
 * load the matrix is copied once into the order the kernel reads, so a group's block is whole vectors:
 *
 *   group g = rows 16g..16g+15 (only whole groups: a matrix's last rows % 16 stay in its rows), at
 *   groups + 16g * row_bytes, its blocks one after another, block b a group_q4_0 or group_q4_1 (kernels.h:
 *   16 * 18 or 16 * 20 bytes, as stored):
 *     d[0..15]     the sixteen rows' fp16 d, row order            (one vcvtph2ps into 16 lanes)
 *     m[0..15]     Q4_1: the sixteen rows' fp16 m, row order      (one vcvtph2ps)
 *     codes        4 x 64 bytes: vector v holds, for row j = 0..15, bytes 4v..4v+3 of row j's 16 code bytes
 *
 * so 32-bit lane j of every code vector is row j: with x's codes broadcast 4 at a time (straight from memory), one
 * vpdpbusd of vector v's low nibbles (values 4v..4v+3 of each row) and one of its high ones (16+4v..) add to every
 * row's sum in its own lane; eight give the sixteen rows' integer sums, in row order, with no permutes or horizontal
 * adds, and the float step (the scales, the offsets) runs on the sixteen rows at once. (Groups of eight, 32-byte
 * vectors, needed x's four-byte words permuted into each half of a 64-byte vector and a float step per eight rows:
 * 1.3-1.5x the instructions a byte; BENCHMARKS, issue 31, helper H4.) AVX2 builds read each vector as two 32-byte
 * halves, rows 0-7 and 8-15. The copy holds the same bytes as the rows (stored_bytes, and the bytes a step reads,
 * are the file's). Per row the float math is i8_q4_row's: acc = fma(d_w * d_x, sum(c*q), acc),
 * off = fma(b, s_x, off) block by block, result acc + off, and the integer sums are exact, so every row's value is
 * bit for bit the same whether its group, i8_q4_row, a thread split or no interleaved copy at all computed it.
 *
 * Held in place. The loader keeps no other copy of such a matrix (issue 31: the rows beside their copy held a 7B
 * Q4_0 model twice): its buffer of rows x row_bytes holds the whole groups interleaved, then the rows after the last
 * whole group as stored, at their own offsets (row r at r * row_bytes), and the part is described with w = groups =
 * that buffer. So nothing reads a row of a whole group at w + r * stride: the kernels read the groups (int8_dot.c's
 * i8_q4_rows computes a group a thread shares with its neighbour whole), and whatever needs a row as stored (an
 * embedding lookup, the reference products, dequantization) gathers it from its group (part_row, llmt_group_rows).
 */

#include "kernels.h"

static int grouped_type(int type) { return type == Q4_0 || type == Q4_1; }

#if LLMT_AVX2
/* Block b of eight rows (row j at row0 + j * stride) as four 32-byte vectors into out[v] (each 32 bytes apart by
   `pitch`): rows j and j+4's 16 code bytes in the two halves of one vector, then a 4 x 4 transpose of 4-byte words in
   each half, so vector v's words are rows 0-3's word v, then rows 4-7's. A 7B Q4_0 load moves 3.6 GB through
   this; 32 4-byte moves a block did it at ~1.5-3 GB/s. */
static inline __attribute__((always_inline)) void transpose_eight(const uint8_t *at, int64_t stride, int64_t head,
                                                                  uint8_t *out, int64_t pitch) {
    __m256i r[4];
    for (int j = 0; j < 4; j++)
        r[j] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(at + (j + 4) * stride + head)),
                                _mm_loadu_si128((const __m128i *)(at + j * stride + head)));
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    _mm256_storeu_si256((__m256i *)out, _mm256_unpacklo_epi64(t0, t2));
    _mm256_storeu_si256((__m256i *)(out + pitch), _mm256_unpackhi_epi64(t0, t2));
    _mm256_storeu_si256((__m256i *)(out + 2 * pitch), _mm256_unpacklo_epi64(t1, t3));
    _mm256_storeu_si256((__m256i *)(out + 3 * pitch), _mm256_unpackhi_epi64(t1, t3));
}

/* Block b of rows 16g..16g+15 (row j at row0 + j * stride) into out: rows 0-7 into the first half of each code
   vector, rows 8-15 into the second, then the scales. */
static inline __attribute__((always_inline)) void interleave_block(int type, const uint8_t *row0, int64_t stride,
                                                                   int64_t b, uint8_t *out) {
    const int64_t bytes = type == Q4_1 ? sizeof(block_q4_1) : sizeof(block_q4_0), head = bytes - 16;
    const uint8_t *at = row0 + b * bytes;
    ggml_half *scales = (ggml_half *)out; /* d[16], then Q4_1's m[16] */
    uint8_t *qs = out + GROUP_ROWS * head;
    transpose_eight(at, stride, head, qs, 4 * GROUP_ROWS);
    transpose_eight(at + 8 * stride, stride, head, qs + 32, 4 * GROUP_ROWS);
    for (int j = 0; j < GROUP_ROWS; j++) {
        const ggml_half *h = (const ggml_half *)(at + j * stride);
        scales[j] = h[0];
        if (type == Q4_1) scales[GROUP_ROWS + j] = h[1];
    }
}
#else
/* The same, byte by byte: builds without AVX2. */
static void interleave_block(int type, const uint8_t *row0, int64_t stride, int64_t b, uint8_t *out) {
    group_q4_0 *g0 = (group_q4_0 *)out;
    group_q4_1 *g1 = (group_q4_1 *)out;
    for (int j = 0; j < GROUP_ROWS; j++) {
        const block_q4_0 *b0 = (const block_q4_0 *)(row0 + j * stride) + b;
        const block_q4_1 *b1 = (const block_q4_1 *)(row0 + j * stride) + b;
        for (int v = 0; v < 4; v++) {
            if (type == Q4_1) memcpy(&g1->qs[v][4 * j], b1->qs + 4 * v, 4);
            else memcpy(&g0->qs[v][4 * j], b0->qs + 4 * v, 4);
        }
        if (type == Q4_1) {
            g1->d[j] = b1->d;
            g1->m[j] = b1->m;
        } else {
            g0->d[j] = b0->d;
        }
    }
}
#endif

/* Rows 16g..16g+15 of a (rows x k) Q4_0/Q4_1 matrix (row r at w + r * stride) interleaved into out, for every
   whole group: out holds (rows / 16 * 16) * row_bytes bytes. Byte moves: builds with or without AVX2 write the same
   (tests/test_int8_groups.py holds both to the layout built in numpy). */
int llmt_interleave(int type, const uint8_t *w, int64_t stride, int64_t rows, int64_t k, uint8_t *out) {
    if (!grouped_type(type)) return BAD_TYPE;
    const int64_t bytes = type == Q4_1 ? sizeof(block_q4_1) : sizeof(block_q4_0);
    if (rows < 0 || k <= 0 || k % 32 || stride < k / 32 * bytes) return BAD_SHAPE;
    const int64_t n_blocks = k / 32;
    for (int64_t g = 0; g < rows / GROUP_ROWS; g++) {
        const uint8_t *row0 = w + GROUP_ROWS * g * stride;
        uint8_t *group = out + g * n_blocks * GROUP_ROWS * bytes;
        /* one loop per type, so each inlines its block */
        if (type == Q4_1)
            for (int64_t b = 0; b < n_blocks; b++) interleave_block(Q4_1, row0, stride, b, group + b * GROUP_ROWS * bytes);
        else
            for (int64_t b = 0; b < n_blocks; b++) interleave_block(Q4_0, row0, stride, b, group + b * GROUP_ROWS * bytes);
    }
    return OK;
}

/* The loader's one pass over a Q4_0/Q4_1 matrix the i8dot kernel holds in place ("Held in place" above): rows
   [0, rows) of the file (row r at w + r * stride: the file's map) written into out (rows x row_bytes, contiguous: the
   matrix's room in the weight arena) in the model's row order, the whole groups interleaved and the rows after the
   last as they are, every fp16 d (and m) checked on the way, on up to `threads` threads, each writing (and faulting
   in) its own share of out. `unit` > 0: Q/K rows llama.cpp permuted, heads of `unit` rows (a multiple of 32, rows a
   multiple of unit): HF's row i < unit/2 of a head is the file's row 2i, row unit/2 + i the file's 2i + 1, so each
   group of sixteen is sixteen file rows two apart. Returns OK, NOT_FINITE when a scale is a NaN or an infinity (a
   corrupt file; everything is written all the same), or BAD_TYPE / BAD_SHAPE. It replaces a pread into a scratch
   buffer, a numpy check of the scratch and llmt_interleave out of it: three passes on one thread (BENCHMARKS.md,
   issue 31). */
int llmt_hold_groups(int type, const uint8_t *w, int64_t stride, int64_t rows, int64_t k, int64_t unit, uint8_t *out,
                     int threads) {
    if (!grouped_type(type)) return BAD_TYPE;
    const int64_t bytes = type == Q4_1 ? sizeof(block_q4_1) : sizeof(block_q4_0);
    if (rows < 0 || k <= 0 || k % 32 || stride < k / 32 * bytes) return BAD_SHAPE;
    if (unit < 0 || (unit > 0 && (unit % (2 * GROUP_ROWS) || rows % unit))) return BAD_SHAPE;
    const int64_t n_blocks = k / 32, row_bytes = n_blocks * bytes, groups = rows / GROUP_ROWS;
    const int64_t scales = GROUP_ROWS * (type == Q4_1 ? 2 : 1); /* fp16 fields at the start of a group's block */
    int bad = 0;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1 && groups > 1) reduction(| : bad) schedule(dynamic, 8)
#endif
    for (int64_t g = 0; g < groups; g++) {
        const int64_t r = g * GROUP_ROWS;
        const uint8_t *row0 = w + r * stride;
        int64_t step = stride;
        if (unit > 0) { /* the group lies in one half of a head: its file rows are two apart */
            const int64_t head = r / unit * unit, i = r % unit, half = unit / 2;
            row0 = w + (head + (i < half ? 2 * i : 2 * (i - half) + 1)) * stride;
            step = 2 * stride;
        }
        uint8_t *group = out + g * n_blocks * GROUP_ROWS * bytes;
        for (int64_t b = 0; b < n_blocks; b++) {
            uint8_t *block = group + b * GROUP_ROWS * bytes;
            if (type == Q4_1) interleave_block(Q4_1, row0, step, b, block);
            else interleave_block(Q4_0, row0, step, b, block);
            bad |= !halves_finite((const ggml_half *)block, scales);
        }
    }
    for (int64_t r = groups * GROUP_ROWS; r < rows; r++) { /* none when unit > 0: heads are whole groups */
        memcpy(out + r * row_bytes, w + r * stride, (size_t)row_bytes);
        bad |= !blocks_finite(type, out + r * row_bytes, n_blocks);
    }
    return bad ? NOT_FINITE : OK;
}

/* Attach part p's interleaved copy (llmt_interleave of that part's rows; NULL: none) to a described matrix. The
   caller keeps it alive with the matrix. Only an i8dot Q4_0/Q4_1 part reads one. */
int llmt_set_groups(Matrix *mat, int p, const uint8_t *groups) {
    if (p < 0 || p >= mat->parts) return BAD_SHAPE;
    if (groups != NULL && !(mat->acts[p] == INT8_X && grouped_type(mat->types[p]))) return BAD_TYPE;
    mat->groups[p] = groups;
    return OK;
}

/* Row r of a whole group (r < rows / 16 * 16) of an interleaved Q4_0/Q4_1 matrix at `groups`, gathered into out
   (row_bytes bytes): the bytes the file holds for it. */
static void group_row(int type, const uint8_t *groups, int64_t r, int64_t n_blocks, uint8_t *out) {
    const int64_t g = r / GROUP_ROWS, j = r % GROUP_ROWS;
    for (int64_t b = 0; b < n_blocks; b++) {
        if (type == Q4_1) {
            const group_q4_1 *g1 = (const group_q4_1 *)groups + g * n_blocks + b;
            block_q4_1 *b1 = (block_q4_1 *)out + b;
            b1->d = g1->d[j];
            b1->m = g1->m[j];
            for (int v = 0; v < 4; v++) memcpy(b1->qs + 4 * v, &g1->qs[v][4 * j], 4);
        } else {
            const group_q4_0 *g0 = (const group_q4_0 *)groups + g * n_blocks + b;
            block_q4_0 *b0 = (block_q4_0 *)out + b;
            b0->d = g0->d[j];
            for (int v = 0; v < 4; v++) memcpy(b0->qs + 4 * v, &g0->qs[v][4 * j], 4);
        }
    }
}

/* Row r of part p as the file stores it: at w + r * stride, or for a row of a whole group of a part with its
   interleaved copy, gathered from the copy into `scratch` (row_bytes[p] bytes): a part held in place has no other. */
const uint8_t *part_row(const Matrix *mat, int p, int64_t r, uint8_t *scratch) {
    if (mat->groups[p] == NULL || r >= mat->rows[p] / GROUP_ROWS * GROUP_ROWS) return mat->w[p] + r * mat->strides[p];
    group_row(mat->types[p], mat->groups[p], r, mat->k / 32, scratch);
    return scratch;
}

/* Rows ids[0..n) of a (rows x k) Q4_0/Q4_1 matrix held in place (its whole groups interleaved at w, the rows after
   them as stored: see the top of this file) into out (n x row_bytes), as the file stores them. */
int llmt_group_rows(int type, const uint8_t *w, int64_t rows, int64_t k, const int64_t *ids, int64_t n, uint8_t *out) {
    if (!grouped_type(type)) return BAD_TYPE;
    if (rows < 0 || k <= 0 || k % 32 || n < 0) return BAD_SHAPE;
    const int64_t n_blocks = k / 32, row_bytes = n_blocks * (type == Q4_1 ? sizeof(block_q4_1) : sizeof(block_q4_0));
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return BAD_SHAPE;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < rows / GROUP_ROWS * GROUP_ROWS) group_row(type, w, ids[i], n_blocks, out + i * row_bytes);
        else memcpy(out + i * row_bytes, w + ids[i] * row_bytes, (size_t)row_bytes);
    }
    return OK;
}
