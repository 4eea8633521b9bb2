/* Q4_0/Q4_1 rows interleaved in groups of eight for the i8dot kernel's one-row (decode) product.
 *
 * #included by int8_dot.c (after i8_q4_row, which it falls back on): the layout, the entry points that make and
 * attach it, and the kernel that reads it.
 *
 * Why: in the GGUF's own layout a row's block is its 2 or 4 bytes of fp16 scales, then 16 code bytes; eight rows
 * multiplied together (each block of x loaded once for the eight) spend more instructions gathering each row's
 * scales and codes into vectors (scalar loads, inserts, permutes, a tree of hadds) than on the dot products. At
 * load the matrix is copied once into the order the kernel reads, so a group's block is whole vectors:
 *
 *   group g = rows 8g..8g+7 (only whole groups: a matrix's last rows % 8 stay in its rows), at
 *   groups + 8g * row_bytes, its blocks one after another, block b (8 * 18 or 8 * 20 bytes, as stored):
 *     d[0..7]      the eight rows' fp16 d, row order            (one vcvtph2ps)
 *     m[0..7]      Q4_1: the eight rows' fp16 m, row order      (one vcvtph2ps)
 *     codes        4 x 32 bytes: vector v holds, for row j = 0..7, bytes 4v..4v+3 of row j's 16 code bytes
 *
 * so with x's codes broadcast 4 at a time, one maddubs of vector v's low nibbles (values 4v..4v+3 of each row) and
 * one of its high ones (16+4v..) add to every row's sum in its own 32-bit lane: 8 maddubs and one madd give the
 * eight rows' integer sums, in row order, with no horizontal adds. The copy holds the same bytes as the rows
 * (stored_bytes, and the bytes a step reads, are the file's). Per row the float math is i8_q4_row's:
 * acc = fma(d_w * d_x, sum(c*q), acc), off = fma(b, s_x, off) block by block, result acc + off, and the integer sums
 * are exact, so every row's value is bit for bit the same whether its group, i8_q4_row, a thread split or no
 * interleaved copy at all computed it.
 */

static int grouped_type(int type) { return type == Q4_0 || type == Q4_1; }

/* Rows 8g..8g+7 of a (rows x k) Q4_0/Q4_1 matrix (row r at w + r * stride) interleaved into out, for every whole
   group: out holds (rows / 8 * 8) * row_bytes bytes. Plain byte moves: builds with or without AVX2 write the same. */
int llmt_interleave(int type, const uint8_t *w, int64_t stride, int64_t rows, int64_t k, uint8_t *out) {
    if (!grouped_type(type)) return BAD_TYPE;
    const int64_t bytes = type == Q4_1 ? 20 : 18, head = bytes - 16; /* head: d (and m) */
    if (rows < 0 || k <= 0 || k % 32 || stride < k / 32 * bytes) return BAD_SHAPE;
    const int64_t n_blocks = k / 32;
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t b = 0; b < n_blocks; b++) {
            uint8_t *o = out + (g * n_blocks + b) * 8 * bytes;
            for (int j = 0; j < 8; j++) {
                const uint8_t *blk = w + (8 * g + j) * stride + b * bytes;
                for (int h = 0; h < head; h += 2) memcpy(o + 8 * h + 2 * j, blk + h, 2);
                for (int v = 0; v < 4; v++) memcpy(o + 8 * head + 32 * v + 4 * j, blk + head + 4 * v, 4);
            }
        }
    }
    return OK;
}

/* Attach part p's interleaved copy (llmt_interleave of that part's rows; NULL: none) to a described matrix. The
   caller keeps it alive with the matrix. Only an i8dot Q4_0/Q4_1 part reads one. */
int llmt_set_groups(Matrix *mat, int p, const uint8_t *groups) {
    if (p < 0 || p >= mat->parts) return BAD_SHAPE;
    if (groups != NULL && !(mat->acts[p] == INT8_X && grouped_type(mat->types[p]))) return BAD_TYPE;
    mat->groups[p] = groups;
    return OK;
}

#if LLMT_AVX2

/* How far ahead the group kernel (and the K-quant rows below) fetch along their run of memory (the eight rows'
   blocks are one contiguous run). At a few cycles a row's block eight rows eat 2 KB in well under a DRAM access:
   with PREFETCH_BYTES' distance the eight-row kernel over the file's rows took 9.6 ms a decode step (p10), slower
   than one row at a time (7.4); 4 KB ahead 7.1, 8 KB 6.3, 16 KB 6.4 (BENCHMARKS "The i8dot kernel's eight rows"). */
#ifndef I8_AHEAD
#define I8_AHEAD 8192
#endif

/* one group of eight rows (its interleaved blocks at g) times one activation row, into out[0..8) */
static inline __attribute__((always_inline)) void i8_q4_group(int type, const uint8_t *g, int64_t n_blocks,
                                                              const XBlock *x, float *out) {
    const int64_t bytes = 8 * q32_bytes(type), codes = type == Q4_1 ? 32 : 16;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps(), off = acc;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = g + b * bytes;
        _mm_prefetch((const char *)blk + I8_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + I8_AHEAD + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + I8_AHEAD + 128, _MM_HINT_T0);
        /* each int16 at most 2 * 15 * 127 per maddubs, eight added 30480: no saturation */
        __m256i sum = _mm256_setzero_si256();
        for (int v = 0; v < 4; v++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(blk + codes + 32 * v));
            const __m256i xl = _mm256_set1_epi32((int)read_u32((const uint8_t *)x[b].q + 4 * v));
            const __m256i xh = _mm256_set1_epi32((int)read_u32((const uint8_t *)x[b].q + 16 + 4 * v));
            sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(_mm256_and_si256(c, low4), xl));
            sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 4), low4), xh));
        }
        const __m256i total = _mm256_madd_epi16(sum, ones);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[b].d)), _mm256_cvtepi32_ps(total), acc);
        const __m256 offset = type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                                           : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        off = _mm256_fmadd_ps(offset, _mm256_set1_ps(x[b].s), off);
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc, off));
}

/* rows first..last of a Q4_0/Q4_1 part times one activation row: the whole groups inside the range from the
   interleaved copy (when there is one), the rows before the first and after the last whole group one by one */
static inline __attribute__((always_inline)) void i8_q4_rows(int type, const uint8_t *w, int64_t stride,
                                                             const uint8_t *groups, int64_t first, int64_t last,
                                                             int64_t n_blocks, const XBlock *x, float *out) {
    int64_t r = first;
    if (groups != NULL) {
        const int64_t row_bytes = n_blocks * q32_bytes(type);
        for (; r < last && r % 8; r++) out[r] = i8_q4_row(type, w + r * stride, n_blocks, x);
        for (; r + 8 <= last; r += 8) i8_q4_group(type, groups + r * row_bytes, n_blocks, x, out + r);
    }
    for (; r < last; r++) out[r] = i8_q4_row(type, w + r * stride, n_blocks, x);
}

#endif /* LLMT_AVX2 */
