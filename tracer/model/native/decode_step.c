/* llmtrace's native decode step: one token of one sequence through every layer, the final norm and the LM head,
 * in one call and one OpenMP parallel region.
 *
 * Unity build: this file #includes gguf_matmul.c, so the one library native_kernel.py compiles holds both, and the
 * step reuses that file's row kernels as they are (prepare_x, x_order, dot_rows, int8_dot.c's quantize_x and
 * i8_dot_rows for the i8dot parts, the Matrix description and
 * `share`'s byte-balanced split of a matrix's rows between threads). Compiled with the same flags
 * (-O3 -march=native -fopenmp -ffp-contract=off) and linked with -lm.
 *
 * Why: a decode step of a small model on a CPU is ~120 weight-streaming products and ~1,000 small tensor ops. Called
 * one by one from Python each product costs a ctypes call, an output allocation and a wake-up of the other OpenMP
 * threads, and each small op a torch dispatch, so per-call costs outweighed the weight streaming itself. Here the
 * threads are woken once per step and meet at a barrier between dependent phases instead.
 *
 * The math and stage order are the fused path's (tracer/model/fused.py, FusedLayer.decode_one), in fp32:
 *   h = x / sqrt(mean(x^2) + eps) * w                      attention RMSNorm (as hypot(||x||, sqrt(dim*eps))/sqrt(dim))
 *   qkv = Wqkv h (+ b)                                     one product over the packed Q|K|V rows
 *   q, k = x*cos + roll(x, D/2)*sin                         RoPE on q and k heads (sin signed: first half negated)
 *   cache[k|v, position] = k, v                            this layer's K|V rows of the shared cache tensor
 *   s = (q . k) * scale over keys first..position          per query head, against the KV head it shares (GQA)
 *   p = softmax(s)                                         fp32
 *   o = sum p * v                                          (H*D,)
 *   a = Wo o (+ b); x = a + x                              product, residual
 *   h = rmsnorm(x); gu = W13 h (+ b)                       FFN RMSNorm, packed gate|up product
 *   act = silu(gate) * up; d = W2 act (+ b); x = d + x
 * after the token's embedding row (dequantized exactly, as native_kernel.dequantize does), then the final RMSNorm
 * and the LM head (+ bias) into `logits`.
 * Sums run in another order than torch's (so results agree within fp32 summation error, not bit for bit).
 *
 * Threads. Products split their rows with `share` (byte-balanced) and add their own rows' bias; attention splits the
 * query heads; silu*up splits F. Norms, RoPE, the cache write and residual adds are a few thousand values: they run
 * on thread 0 while the others wait at the next barrier (waking them costs more than the work). One barrier per
 * dependency, none per op.
 *
 * Tracing. With `stamps` not NULL, thread 0 reads CLOCK_MONOTONIC (what Python's time.perf_counter_ns reads on
 * Linux; native_step.py checks) at the step's start and after each stage of the fused path's order
 * (contract.fused_stages: the embedding; per layer attention norm, Q|K|V, RoPE, KV write, scores, softmax, values,
 * wo, residual, FFN norm, gate|up, silu*up, w2, residual; then final norm, LM head), after the barrier that ends a
 * parallel stage. Traced, attention meets at a
 * barrier after its scores and after its softmax too (so each stage's time is the slowest thread's); untraced, each
 * thread runs its heads' three stages back to back. With `stamps` NULL no clock is read.
 *
 * Staged (`staged` not 0: `llmtrace run --staged` on a model this step can run). The stages of the staged path
 * (contract.staged_stages, the stage modules of tracer/model/transformer.py) run apart, each its own phase ended by a
 * barrier and thread 0's stamp: per layer attention norm, Q, K, V (three products, each over its own row block of
 * the packed Q|K|V matrix), RoPE, KV write, scores, softmax, values, wo, residual, FFN norm, gate, up (each over
 * its rows of gate|up), silu*up, w2, residual; the final norm ends at a barrier too. Every row of every product is
 * the same dot_rows call on the same prepared input as in the fused order, and every other stage the same code, so
 * the logits and the KV cache are bit for bit the fused step's; only the waits between stages are added.
 */

#include "gguf_matmul.c"
#include "top_values.c" /* the sampler's selection (native_top.py) */

#include <math.h>
#include <time.h>

#define LLMT_STEP_ABI 4 /* bump with StepLayer/StepPlan below: native_step.py mirrors them */

/* One layer: its described matrices (llmt_describe), norm weights (dim,), biases (NULL: none). */
typedef struct {
    const Matrix *wqkv, *wo, *w13, *w2;
    const float *attention_norm, *ffn_norm;
    const float *bqkv, *bo, *b13, *b2;
} StepLayer;

/* Everything a step reads and writes, built once by native_step.py (which holds every tensor it points into). */
typedef struct {
    int64_t layers, dim, heads, kv_heads, head_dim, ffn_dim, vocab, max_seq;
    float norm_floor;   /* sqrt(dim * eps) */
    float scale;        /* attention scores' scale */
    const StepLayer *layer;
    const float *final_norm;
    const Matrix *head;
    const float *head_bias;
    float *kv;          /* (L, 2*Hkv, S_max, D) fp32: layer l's K head g at kv + l*kv_layer + g*kv_head, V heads after */
    int64_t kv_layer, kv_head; /* strides in floats; a position's row is D floats, contiguous */
    float *scratch;     /* llmt_step_scratch_floats(plan, threads) floats */
    int64_t scratch_floats;
    const Matrix *embedding;       /* the token table held as stored (its rows dequantized exactly), or NULL and */
    const float *embedding_dense;  /* the table as (vocab rows, dim) fp32 */
    int64_t embedding_rows;
} StepPlan;

int64_t llmt_step_abi(void) { return LLMT_STEP_ABI; }
int64_t llmt_step_layer_size(void) { return (int64_t)sizeof(StepLayer); }
int64_t llmt_step_plan_size(void) { return (int64_t)sizeof(StepPlan); }

/* 1 when the step can run in this build (its products use the AVX2 one-row kernels). */
int llmt_step_supported(void) { return LLMT_AVX2; }

static int64_t widest_input(const StepPlan *p) {
    int64_t k = p->dim;
    if (p->heads * p->head_dim > k) k = p->heads * p->head_dim;
    if (p->ffn_dim > k) k = p->ffn_dim;
    return k;
}

/* Shared vectors (products' outputs, the attention's scores), then each thread's own: its copy of the residual
   stream x and of the norm's output h (every thread computes them, so no barrier waits for one thread's norm), its
   silu(gate)*up, its prepared activation row (x in three orders + its sums per 32 values) and the same row
   quantized for the i8dot parts (int8_dot.c's XBlocks: each thread quantizes the product's input itself, rather than
   all waiting at a barrier for one thread to do it). */
static int64_t shared_floats(const StepPlan *p) {
    const int64_t qkv = (p->heads + 2 * p->kv_heads) * p->head_dim;
    return 2 * p->dim + qkv + p->heads * p->head_dim + 2 * p->ffn_dim + p->heads * p->max_seq;
}

static int64_t thread_floats(const StepPlan *p) {
    const int64_t k = widest_input(p);
    const int64_t floats = 2 * p->dim + p->ffn_dim + 3 * k + k / 32 + k / 32 * (int64_t)(sizeof(XBlock) / sizeof(float));
    return (floats + 15) / 16 * 16 + 16; /* whole cache lines, one apart: threads never share a line */
}

int64_t llmt_step_scratch_floats(const StepPlan *p, int threads) {
    return shared_floats(p) + (threads < 1 ? 1 : threads) * thread_floats(p) + 16;
}

/* ---- the stages' pieces ------------------------------------------------------------------------------------ */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#define STAMP()                                                                                                      \
    do {                                                                                                             \
        if (stamps != NULL) stamps[n_stamps++] = now_ns();                                                           \
    } while (0)

static inline void barrier(void) {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

/* the end of a stage of the staged step: every thread done with it, then thread 0's clock reading */
#define END_STAGE()                                                                                                  \
    do {                                                                                                             \
        barrier();                                                                                                   \
        if (t == 0) STAMP();                                                                                         \
    } while (0)

/* out = x / sqrt(mean(x^2) + eps) * w, the mean's root as hypot(||x||, sqrt(dim*eps)) / sqrt(dim) (functional.py);
   the squares summed in 16 fp32 lanes, as torch's vectorised norm does (n is a multiple of 32 here) */
static void rms_norm(const float *x, const float *w, int64_t n, float floor, float *out) {
    float squares;
#if LLMT_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        s0 = _mm256_fmadd_ps(a, a, s0);
        s1 = _mm256_fmadd_ps(b, b, s1);
    }
    squares = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) squares += x[i] * x[i];
#else
    squares = 0.0f;
    for (int64_t i = 0; i < n; i++) squares += x[i] * x[i];
#endif
    const float rms = hypotf(sqrtf(squares), floor) * (float)(1.0 / sqrt((double)n));
    for (int64_t i = 0; i < n; i++) out[i] = x[i] / rms * w[i];
}

#if LLMT_AVX2
/* e^x in 8 lanes, within ~2 ulp of expf (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial in r,
   times 2^n); 0 below -87.3 (where expf's results are subnormal or 0), and x clamped at 88.37 (e^x ~ 2.4e38). */
static inline __m256 exp8(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.3365447504019f), high = _mm256_set1_ps(88.3762626647949f);
    const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, low), high);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts: n*ln2 exact enough */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}
#endif

/* act[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i] */
static void swiglu(const float *gate, const float *up, int64_t n, float *act) {
    int64_t i = 0;
#if LLMT_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_xor_ps(g, sign));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static inline float dot(const float *a, const float *b, int64_t n) {
#if LLMT_AVX2
    int64_t i = 0;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
#else
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
#endif
}

/* The rows of part p within the matrix's rows [lo, hi) that thread t of `count` takes: `share`'s byte-balanced
   split applied to those rows alone (over all rows it is `share`'s split). */
static void share_rows(const Matrix *mat, int p, int64_t lo, int64_t hi, int t, int count, int64_t *first,
                       int64_t *last) {
    int64_t before = 0, total = 0, from = 0, to = 0;
    for (int q = 0; q < mat->parts; q++) {
        int64_t a = lo - mat->column[q], b = hi - mat->column[q];
        a = a < 0 ? 0 : a > mat->rows[q] ? mat->rows[q] : a;
        b = b < a ? a : b > mat->rows[q] ? mat->rows[q] : b;
        if (q < p) before += (b - a) * mat->row_bytes[q];
        if (q == p) from = a, to = b;
        total += (b - a) * mat->row_bytes[q];
    }
    const int64_t start = (int64_t)((double)total * t / count);
    const int64_t stop = t + 1 == count ? total : (int64_t)((double)total * (t + 1) / count);
    const int64_t row = mat->row_bytes[p], n = to - from;
    const int64_t a = start <= before ? 0 : (start - before + row - 1) / row;
    const int64_t b = stop <= before ? 0 : (stop - before + row - 1) / row;
    *first = from + (a < n ? a : n);
    *last = from + (b < n ? b : n);
}

/* This thread's rows of `mat` among rows [lo, hi) times x (k values): x prepared into the thread's own buffer
   (quantized to int8 blocks for the i8dot parts, in the orders the exact kernels need for the others), then
   `share_rows`' rows, each part's rows plus their bias, written at their row of `out` (a row's value does not
   depend on the range or the thread that computes it: every row is one dot_rows call over the same prepared x). */
static void product_rows(const Matrix *mat, const float *x, float *xs, const float *bias, float *out, int64_t lo,
                         int64_t hi, int t, int count) {
#if LLMT_AVX2
    const int64_t k = mat->k;
    float *sx = xs + 3 * k;
    XBlock *xq = (XBlock *)(sx + k / 32);
    int64_t first[MAX_PARTS], last[MAX_PARTS];
    int made[3] = {0, 0, 0}, any = 0, quantized = 0;
    for (int p = 0; p < mat->parts; p++) {
        share_rows(mat, p, lo, hi, t, count, &first[p], &last[p]);
        any |= first[p] < last[p];
    }
    if (!any) return;
    for (int p = 0; p < mat->parts; p++) {
        if (first[p] >= last[p]) continue;
        if (mat->int8[p]) {
            if (!quantized) quantize_x(x, k, xq);
            quantized = 1;
            continue;
        }
        const int order = x_order(mat->types[p]);
        if (!made[order]) {
            prepare_x(mat->types[p], x, k, xs + order * k, sx);
            made[order] = 1;
        }
    }
    for (int p = 0; p < mat->parts; p++) {
        if (first[p] >= last[p]) continue;
        float *o = out + mat->column[p];
        if (mat->int8[p])
            i8_dot_rows(mat, p, first[p], last[p], xq, 1, o, 0);
        else
            dot_rows(mat->types[p], mat->w[p], mat->strides[p], first[p], last[p], k / mat->block_values[p],
                     xs + x_order(mat->types[p]) * k, sx, o);
        if (bias != NULL) {
            const float *b = bias + mat->column[p];
            for (int64_t r = first[p]; r < last[p]; r++) o[r] += b[r];
        }
    }
#else
    (void)mat; (void)x; (void)xs; (void)bias; (void)out; (void)lo; (void)hi; (void)t; (void)count;
#endif
}

/* This thread's rows of the whole of `mat` times x */
static void product(const Matrix *mat, const float *x, float *xs, const float *bias, float *out, int t, int count) {
    product_rows(mat, x, xs, bias, out, 0, mat->total_rows, t, count);
}

/* RoPE on `heads` heads of D values in place: x*cos + roll(x, D/2)*sin (sin signed), as rope.py's tables mean it */
static void rope(float *x, int64_t heads, int64_t d, const float *cos, const float *sin) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * d;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] + b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* The query heads [*first, *last) thread t of `count` attends (contiguous runs, sizes differing by at most one). */
static void split(int64_t n, int t, int count, int64_t *first, int64_t *last) {
    *first = n * t / count;
    *last = n * (t + 1) / count;
}

static void scores_of(const StepPlan *p, const float *q, const float *keys, int64_t seen, float *scores) {
    const int64_t d = p->head_dim;
    for (int64_t s = 0; s < seen; s++) scores[s] = dot(q, keys + s * d, d) * p->scale;
}

static void softmax(float *s, int64_t n) {
    float top = s[0];
    for (int64_t i = 1; i < n; i++) top = s[i] > top ? s[i] : top;
    float total = 0.0f;
    int64_t i = 0;
#if LLMT_AVX2
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
        _mm256_storeu_ps(s + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    total = hsum(sum);
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - top);
        total += s[i];
    }
    const float inverse = 1.0f / total;
    for (i = 0; i < n; i++) s[i] *= inverse;
}

static void values_of(const StepPlan *p, const float *probs, const float *values, int64_t seen, float *out) {
    const int64_t d = p->head_dim;
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t s = 0; s < seen; s++) {
        const float w = probs[s];
        const float *v = values + s * d;
        for (int64_t i = 0; i < d; i++) out[i] += w * v[i];
    }
}

/* ---- the step ---------------------------------------------------------------------------------------------- */

enum { STEP_OK = 0, STEP_BAD_SHAPE = 2, STEP_UNSUPPORTED = 4, STEP_SCRATCH = 5, STEP_BAD_TOKEN = 6 };

/* x = row `token` of the embedding table: exactly dequantize_row's values (those of gguf.quants.dequantize, as
   native_kernel.dequantize gives them), or the dense row */
static void embed(const StepPlan *plan, int64_t token, float *x) {
    const Matrix *m = plan->embedding;
    if (m == NULL) {
        memcpy(x, plan->embedding_dense + token * plan->dim, sizeof(float) * (size_t)plan->dim);
        return;
    }
    for (int p = 0; p < m->parts; p++) {
        const int64_t row = token - m->column[p];
        if (row >= 0 && row < m->rows[p]) {
            dequantize_row(m->types[p], m->w[p] + row * m->strides[p], m->k / m->block_values[p],
                           m->block_values[p], m->block_bytes[p], x);
            return;
        }
    }
}

/* token: the token's id, looked up in the embedding table here; cos, sin (D,): the rope tables' rows of
   `position`; keys first..position are attended (first > 0 under a sliding window); logits (vocab,) out; stamps:
   NULL, or room for 14 * layers + 4 readings (17 * layers + 4 when `staged`) (ns): the step's start, then the end
   of each stage from the embedding to the LM head. `staged`: run the staged path's stages apart (the header
   comment). Returns STEP_OK or a status. */
int llmt_decode_step(const StepPlan *plan, int64_t token, const float *cos, const float *sin, int64_t position,
                     int64_t first, float *logits, int64_t *stamps, int threads, int staged) {
    if (!LLMT_AVX2) return STEP_UNSUPPORTED;
    if (position < 0 || position >= plan->max_seq || first < 0 || first > position) return STEP_BAD_SHAPE;
    if (token < 0 || token >= plan->embedding_rows) return STEP_BAD_TOKEN;
    int team = threads < 1 ? 1 : threads;
    if (llmt_step_scratch_floats(plan, team) > plan->scratch_floats) return STEP_SCRATCH;
    const int64_t dim = plan->dim, heads = plan->heads, kv_heads = plan->kv_heads, d = plan->head_dim;
    const int64_t ffn = plan->ffn_dim, rep = heads / kv_heads, seen = position + 1 - first;
    const int64_t q_rows = heads * d, kv_rows = kv_heads * d; /* Q|K|V's row blocks */
    float *embedding = plan->scratch;               /* (dim,) the token's row */
    float *branch = embedding + dim;                /* (dim,) wo's or w2's output */
    float *qkv = branch + dim;                      /* ((H+2Hkv)*D,) */
    float *attended = qkv + (heads + 2 * kv_heads) * d; /* (H*D,) */
    float *gate_up = attended + heads * d;          /* (2F,) */
    float *scores = gate_up + 2 * ffn;              /* (H, S_max) */
    float *own = (float *)(((uintptr_t)(scores + heads * plan->max_seq) + 63) & ~(uintptr_t)63);
    const int traced = stamps != NULL;
    if (traced) stamps[0] = now_ns();
    embed(plan, token, embedding);
    if (traced) stamps[1] = now_ns();

#ifdef _OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
    {
        int count;
        const int t = current_thread(&count);
        float *x = own + t * thread_floats(plan); /* (dim,) this thread's copy of the residual stream */
        float *h = x + dim;                       /* (dim,) a norm's output */
        float *act = h + dim;                     /* (F,) silu(gate) * up */
        float *xs = act + ffn;                    /* the prepared activation row */
        int64_t n_stamps = 2;                     /* thread 0's, after the start and the embedding */
        int64_t head_first, head_last;
        split(heads, t, count, &head_first, &head_last);
        memcpy(x, embedding, sizeof(float) * (size_t)dim);
        for (int64_t l = 0; l < plan->layers; l++) {
            const StepLayer *layer = plan->layer + l;
            float *keys = plan->kv + l * plan->kv_layer;       /* K head g at keys + g*kv_head */
            float *values = keys + kv_heads * plan->kv_head; /* V head g at values + g*kv_head */
            if (staged) { /* contract.staged_stages' 17 layer stages, each ended by a barrier and thread 0's stamp */
                rms_norm(x, layer->attention_norm, dim, plan->norm_floor, h);
                END_STAGE();
                product_rows(layer->wqkv, h, xs, layer->bqkv, qkv, 0, q_rows, t, count); /* Q's rows */
                END_STAGE();
                product_rows(layer->wqkv, h, xs, layer->bqkv, qkv, q_rows, q_rows + kv_rows, t, count); /* K's */
                END_STAGE();
                product_rows(layer->wqkv, h, xs, layer->bqkv, qkv, q_rows + kv_rows, q_rows + 2 * kv_rows, t,
                             count); /* V's */
                END_STAGE();
                if (t == 0) rope(qkv, heads + kv_heads, d, cos, sin);
                END_STAGE();
                if (t == 0)
                    for (int64_t g = 0; g < 2 * kv_heads; g++)
                        memcpy(keys + g * plan->kv_head + position * d, qkv + (heads + g) * d,
                               sizeof(float) * (size_t)d);
                END_STAGE();
                for (int64_t hq = head_first; hq < head_last; hq++)
                    scores_of(plan, qkv + hq * d, keys + (hq / rep) * plan->kv_head + first * d, seen,
                              scores + hq * plan->max_seq);
                END_STAGE();
                for (int64_t hq = head_first; hq < head_last; hq++) softmax(scores + hq * plan->max_seq, seen);
                END_STAGE();
                for (int64_t hq = head_first; hq < head_last; hq++)
                    values_of(plan, scores + hq * plan->max_seq, values + (hq / rep) * plan->kv_head + first * d,
                              seen, attended + hq * d);
                END_STAGE();
                product(layer->wo, attended, xs, layer->bo, branch, t, count);
                END_STAGE();
                for (int64_t i = 0; i < dim; i++) x[i] = branch[i] + x[i];
                END_STAGE();
                rms_norm(x, layer->ffn_norm, dim, plan->norm_floor, h);
                END_STAGE();
                product_rows(layer->w13, h, xs, layer->b13, gate_up, 0, ffn, t, count); /* gate's rows */
                END_STAGE();
                product_rows(layer->w13, h, xs, layer->b13, gate_up, ffn, 2 * ffn, t, count); /* up's rows */
                END_STAGE();
                swiglu(gate_up, gate_up + ffn, ffn, act);
                END_STAGE();
                product(layer->w2, act, xs, layer->b2, branch, t, count);
                END_STAGE();
                for (int64_t i = 0; i < dim; i++) x[i] = branch[i] + x[i];
                END_STAGE();
                continue;
            }
            rms_norm(x, layer->attention_norm, dim, plan->norm_floor, h);
            if (t == 0) STAMP();
            product(layer->wqkv, h, xs, layer->bqkv, qkv, t, count);
            barrier();
            if (t == 0) {
                STAMP();
                rope(qkv, heads + kv_heads, d, cos, sin);
                STAMP();
                for (int64_t g = 0; g < 2 * kv_heads; g++) /* K heads then V heads, as the cache holds them */
                    memcpy(keys + g * plan->kv_head + position * d, qkv + (heads + g) * d, sizeof(float) * (size_t)d);
                STAMP();
            }
            barrier();
            if (traced) {
                for (int64_t hq = head_first; hq < head_last; hq++)
                    scores_of(plan, qkv + hq * d, keys + (hq / rep) * plan->kv_head + first * d, seen,
                              scores + hq * plan->max_seq);
                barrier();
                if (t == 0) STAMP();
                for (int64_t hq = head_first; hq < head_last; hq++) softmax(scores + hq * plan->max_seq, seen);
                barrier();
                if (t == 0) STAMP();
                for (int64_t hq = head_first; hq < head_last; hq++)
                    values_of(plan, scores + hq * plan->max_seq, values + (hq / rep) * plan->kv_head + first * d,
                              seen, attended + hq * d);
            } else {
                for (int64_t hq = head_first; hq < head_last; hq++) {
                    float *s = scores + hq * plan->max_seq;
                    scores_of(plan, qkv + hq * d, keys + (hq / rep) * plan->kv_head + first * d, seen, s);
                    softmax(s, seen);
                    values_of(plan, s, values + (hq / rep) * plan->kv_head + first * d, seen, attended + hq * d);
                }
            }
            barrier();
            if (t == 0) STAMP();
            product(layer->wo, attended, xs, layer->bo, branch, t, count);
            barrier();
            if (t == 0) STAMP();
            for (int64_t i = 0; i < dim; i++) x[i] = branch[i] + x[i];
            if (t == 0) STAMP();
            rms_norm(x, layer->ffn_norm, dim, plan->norm_floor, h);
            if (t == 0) STAMP();
            product(layer->w13, h, xs, layer->b13, gate_up, t, count);
            barrier();
            if (t == 0) STAMP();
            swiglu(gate_up, gate_up + ffn, ffn, act); /* every thread all of it: w2's rows each need all of act */
            if (t == 0) STAMP();
            product(layer->w2, act, xs, layer->b2, branch, t, count);
            barrier();
            if (t == 0) STAMP();
            for (int64_t i = 0; i < dim; i++) x[i] = branch[i] + x[i];
            if (t == 0) STAMP();
        }
        rms_norm(x, plan->final_norm, dim, plan->norm_floor, h);
        if (staged) barrier();
        if (t == 0) STAMP();
        product(plan->head, h, xs, plan->head_bias, logits, t, count);
        barrier();
        if (t == 0) STAMP();
    }
    return STEP_OK;
}
