/* llmtrace's native decode step: one token of one sequence through every layer, the final norm and the LM head,
 * in one call and one OpenMP parallel region.
 *
 * One unit of the native library (kernels.h): the step reuses the products' row kernels as they are (gguf_matmul.c's
 * prepare_x, x_order, dot_rows, int8_dot.c's quantize_x and i8_dot_rows for the i8dot parts, int16_dot.c's
 * quantize_x16 and i16_dot_rows for the i16dot ones, the Matrix description and a byte-balanced split of a matrix's
 * rows between threads as llmt_matmul's). Compiled with the same flags (-O3 -march=native -fopenmp
 * -ffp-contract=off) and linked with -lm.
 *
 * Why: a decode step of a small model on a CPU is ~120 weight-streaming products and ~1,000 small tensor ops. Called
 * one by one from Python each product costs a ctypes call, an output allocation and a wake-up of the other OpenMP
 * threads, and each small op a torch dispatch, so per-call costs outweighed the weight streaming itself. Here the
 * threads are woken once per step and meet at a barrier between dependent phases instead.
 *
 * The math and stage order are the packed path's (the stage modules' forwards as tracer/model/fused.py runs
 * them), in fp32:
 *   h = x / sqrt(mean(x^2) + eps) * w                      attention RMSNorm (as hypot(||x||, sqrt(dim*eps))/sqrt(dim))
 *   qkv = Wqkv h (+ b)                                     one product over the packed Q|K|V rows
 *   q, k = q / rms(q) * wq, k / rms(k) * wk per head         QK-norm, where the layers have it (Qwen3)
 *   q, k = x*cos + roll(x, R/2)*sin                         RoPE on q and k heads (sin signed: first half negated)
 *                                                          over each head's first R values (R = D but for a partial
 *                                                          rotary: Phi-4-mini's 96 of 128; the rest pass through)
 *   cache[k|v, position] = k, v                            this layer's K|V rows of the shared cache tensor
 *   s = (q . k) * scale over keys first..position          per query head, against the KV head it shares (GQA)
 *   p = softmax(s)                                         fp32
 *   o = sum p * v                                          (H*D,)
 *   a = Wo o (+ b); x = a + x                              product, residual (Gemma: x = rmsnorm(a) + x)
 *   h = rmsnorm(x); gu = W13 h (+ b)                       FFN RMSNorm, packed gate|up product
 *   act = silu(gate) * up; d = W2 act (+ b); x = d + x     (Gemma: gelu_tanh(gate) * up; x = rmsnorm(d) + x)
 * or for a mixture of experts (the plan's n_experts > 0) in place of the last two lines:
 *   r = Wr h; p = softmax(r); the k largest of p (renormalised to sum 1 where the family does)   router, route
 *   per chosen expert e, in ascending order: act = silu(gate_e h) * up_e h; o_e = W2_e act        its products
 *   x = sum over the k slots of w_j * o_j + x                                                   weighted sum, residual
 * and with a shared expert (Qwen2-MoE: the plan's shared_ffn_dim > 0), first, on the same h:
 *   gu = Ws13 h; act = silu(gate) * up; s = Ws2 act; g = ws . h     its gate|up, silu*up, down, its gate's logit
 *   then after the weighted sum: sum + sigmoid(g) * s               before the residual add
 * after the token's embedding row (dequantized exactly, as native_kernel.dequantize does; Gemma: times sqrt(dim)),
 * then the final RMSNorm and the LM head (+ bias) into `logits` (Gemma: soft-capped, cap * tanh(logits / cap)).
 * Gemma's twists are the same loop's, switched on by the plan: its (1 + w) norms are rmsnorm with the weight 1 + w
 * (native_step.py passes that vector), each layer has its own RoPE tables and window (the windowed layers' local
 * base, the global layers' none), and `scale` is query_pre_attn_scalar^-1/2. A model without them pays one test of
 * a NULL pointer or a 0 per layer.
 * Sums run in another order than torch's (so results agree within fp32 summation error, not bit for bit).
 *
 * Threads. Products split their rows with `share` (byte-balanced) and add their own rows' bias; attention splits
 * positions, heads and (KV head, chunk) pieces (its section); silu*up splits F. Norms, RoPE, the cache write and
 * residual adds are a few thousand values: they run on thread 0 while the others wait at the next barrier (waking
 * them costs more than the work). One barrier per dependency, none per op.
 *
 * Tracing. With `stamps` not NULL, thread 0 reads CLOCK_MONOTONIC (what Python's time.perf_counter_ns reads on
 * Linux; native_step.py checks) at the step's start and after each stage of the fused path's order
 * (contract.fused_stages: the embedding; per layer attention norm, Q|K|V, QK-norm (Qwen3's, where the layers have
 * it), RoPE, KV write, scores, softmax, values, wo, residual, FFN norm, gate|up, silu*up, w2, residual; then final
 * norm, LM head), after the barrier that ends a parallel stage. Attention's three stages each end at a barrier,
 * traced or not (each splits its own work: the attention section), so each stage's time is the slowest thread's.
 * With `stamps` NULL no clock is read.
 *
 * Staged (`staged` not 0: `llmtrace run --staged` on a model this step can run). The stages of the staged path
 * (contract.staged_stages, the stage modules of tracer/model/transformer.py) run apart, each its own phase ended by a
 * barrier and thread 0's stamp: per layer attention norm, Q, K, V (three products, each over its own row block of
 * the packed Q|K|V matrix), QK-norm (Qwen3), RoPE, KV write, scores, softmax, values, wo, residual, FFN norm,
 * gate, up (each over its rows of gate|up), silu*up, w2, residual; the final norm ends at a barrier too. It is the
 * same loop as the fused order's (llmt_decode_step's one layer loop): a staged step only cuts the two packed products
 * at their row blocks and waits at every stage's end (end_stage). Every row of every product is the same dot_rows call
 * on the same prepared input either way, and every other stage the same code, so the logits and the KV cache are bit
 * for bit the fused step's.
 */

#include "kernels.h"

#include <time.h>

#define LLMT_STEP_ABI 10 /* bump with StepLayer/StepPlan below (native_plan.py mirrors them) or a signature */
#define FUSED_STAMPS_PER_LAYER 14 /* a traced step's stamps per layer (the tests' oracle: stamp_count.py), */
                                  /* one more with QK-norm, two with Gemma's norms after attention and FFN, */
                                  /* 3k more with k experts, 5 more with a shared expert */
                                  /* (fused_stamps_per_layer) */

/* the attention's (its section below) */
#define ATTN_GROUP 4    /* query heads of one KV head processed together (Llama 3 repeats 4; more run in turns) */
#define ATTN_CHUNK 64   /* positions per piece of the values' sums */
#ifndef ATTN_PREFETCH
#define ATTN_PREFETCH 2048 /* bytes ahead of the key and value rows read that are prefetched */
#endif

/* One layer: its described matrices (llmt_describe), norm weights (dim,), biases (NULL: none), QK-norm's q and k
   weights (head_dim,) (Qwen3; NULL: none, in every layer alike), the norms after attention and after the FFN
   (Gemma; NULL: none, in every layer alike), its RoPE tables (S_max, R) (cos and signed sin: Gemma 3's windowed
   layers turn by their own base) and its sliding window (0: none; Gemma 3's global layers have none). A mixture
   of experts' layer (the plan's n_experts > 0) has no w13, w2, b13, b2: its router (E rows: described, or dense
   (E, dim) fp32 in router_dense) and, per expert, its gate|up and down descriptions, each pointing at that expert's
   rows of the file's 3-D tensors (as llama.cpp's mul_mat_id points each chosen expert's product at its slice).
   A shared expert beside them (Qwen2-MoE; NULL: none, in every layer alike): its gate|up (2Fs rows) and down
   described, its gate's (dim,) fp32 weights. */
typedef struct {
    const Matrix *wqkv, *wo, *w13, *w2;
    const float *attention_norm, *ffn_norm;
    const float *bqkv, *bo, *b13, *b2;
    const float *q_norm, *k_norm;
    const Matrix *router;
    const float *router_dense;
    const Matrix *const *expert_w13, *const *expert_w2; /* E each */
    const float *post_attention_norm, *post_ffn_norm;
    const float *cos, *sin;
    const Matrix *shared_w13, *shared_w2;
    const float *shared_gate;
    int64_t window;
} StepLayer;

/* Everything a step reads and writes, built once by native_plan.py (which holds every tensor it points into). */
typedef struct {
    int64_t layers, dim, heads, kv_heads, head_dim, ffn_dim, vocab, max_seq;
    float norm_floor;   /* sqrt(dim * eps) */
    float scale;        /* attention scores' scale */
    const StepLayer *layer;
    const float *final_norm;
    const Matrix *head;
    const float *head_bias;
    float *kv; /* (L, 2*Hkv, S_max, D) fp32: layer l's K head g at kv + l*kv_layer + g*kv_head, V heads after */
    int64_t kv_layer, kv_head; /* strides in floats; a position's row is D floats, contiguous */
    float *scratch;     /* llmt_step_scratch_floats(plan, threads) floats */
    int64_t scratch_floats;
    const Matrix *embedding;       /* the token table held as stored (its rows dequantized exactly), or NULL and */
    const float *embedding_dense;  /* the table as (vocab rows, dim) fp32 */
    int64_t embedding_rows;
    float qk_norm_floor; /* sqrt(head_dim * eps): QK-norm's, when the layers have it */
    int64_t n_experts, top_k; /* a mixture of experts in every layer: E experts, k a token; 0, 0: a dense FFN */
    int64_t renormalise;      /* the k weights rescaled to sum 1 (Mixtral, Qwen3-MoE), or softmax's (OLMoE) */
    int64_t qk_norm_whole;    /* OLMoE's QK-norm: over each token's whole q (H*D) and whole k (Hkv*D), q_norm and */
    float qk_norm_floor_k;    /* k_norm that wide, the floors sqrt(H*D*eps) (qk_norm_floor) and sqrt(Hkv*D*eps) */
    float embed_scale;        /* Gemma's: the embedding row times this (sqrt(dim) in fp32); 0: none */
    float softcap;            /* Gemma's: the logits l as cap * tanh(l / cap); 0: none */
    int64_t gelu;             /* the FFN's gating gelu_tanh(gate) * up (Gemma), not silu(gate) * up */
    int64_t rotary;           /* R: the values of each head RoPE turns, the tables' row width (head_dim, or a */
                              /* partial rotary's first R: Phi-4-mini's 96 of 128; the rest pass through) */
    int64_t shared_ffn_dim;   /* a mixture of experts' shared expert's width Fs (Qwen2-MoE); 0: none */
} StepPlan;

enum {
    STEP_OK = 0, STEP_BAD_SHAPE = 2, STEP_UNSUPPORTED = 4, STEP_SCRATCH = 5, STEP_BAD_TOKEN = 6, STEP_NOT_CHOSEN = 7
};

int64_t llmt_step_abi(void) { return LLMT_STEP_ABI; }
int64_t llmt_step_layer_size(void) { return (int64_t)sizeof(StepLayer); }
int64_t llmt_step_plan_size(void) { return (int64_t)sizeof(StepPlan); }

/* 1 when the step can run in this build (its products use the AVX2 one-row kernels). */
int llmt_step_supported(void) { return LLMT_AVX2; }

/* a traced fused step's stamps per layer: the fused stages, QK-norm's and the norms after attention and FFN among
   them where the layers have them; a mixture of experts' FFN stamps router, route, then gate|up, silu*up, down for
   each of the k experts, and the weighted sum, where a dense one stamps gate|up, silu*up, down; a shared expert
   its gate|up, silu*up, down and gate logit before the router, and its gated add after the weighted sum */
static int64_t fused_stamps_per_layer(const StepPlan *p) {
    return FUSED_STAMPS_PER_LAYER + (p->layers > 0 && p->layer[0].q_norm != NULL) +
           2 * (p->layers > 0 && p->layer[0].post_attention_norm != NULL) + 3 * p->top_k +
           5 * (p->shared_ffn_dim > 0);
}

/* a traced fused step's stamps: its start, the embedding (and Gemma's scale), the layers', the final norm and the
   LM head (and Gemma's soft-cap) */
static int64_t fused_stamps(const StepPlan *p) {
    return fused_stamps_per_layer(p) * p->layers + 4 + (p->embed_scale != 0.0f) + (p->softcap != 0.0f);
}

/* The readings a traced step writes into its stamps buffer, fused or `staged` (Q|K|V as Q, K, V: two more a layer;
   gate|up as gate, up: one more, or one more per chosen expert and for a shared expert). The caller sizes the
   buffer by this count (native_step.py); tests hold it to an independent count of the contract's stages. */
int64_t llmt_step_stamps(const StepPlan *p, int staged) {
    return fused_stamps(p) +
           (staged ? p->layers * (2 + (p->top_k ? p->top_k : 1) + (p->shared_ffn_dim > 0)) : 0);
}

/* the FFN's widest product: F, or a shared expert's Fs where wider */
static inline int64_t widest_ffn(const StepPlan *p) {
    return p->shared_ffn_dim > p->ffn_dim ? p->shared_ffn_dim : p->ffn_dim;
}

static int64_t widest_input(const StepPlan *p) {
    int64_t k = p->dim;
    if (p->heads * p->head_dim > k) k = p->heads * p->head_dim;
    if (widest_ffn(p) > k) k = widest_ffn(p);
    return k;
}

/* Shared vectors (products' outputs, the attention's scores), then each thread's own: its copy of the residual
   stream x and of the norm's output h (every thread computes them, so no barrier waits for one thread's norm), its
   silu(gate)*up, its prepared activation row (x in three orders + its sums per 32 values) and the same row
   quantized for the i8dot parts (int8_dot.c's XBlocks) and the i16dot ones (int16_dot.c's X16Blocks): each thread
   quantizes the product's input itself, rather than all waiting at a barrier for one thread to do it. */
/* how many chunks of ATTN_CHUNK positions n positions make (the last one partial) */
static inline int64_t chunks_of(int64_t n) { return (n + ATTN_CHUNK - 1) / ATTN_CHUNK; }

/* a mixture of experts' shared vectors: the k chosen experts and the order they run in (int64, two floats each),
   their weights, the router's E logits, each chosen expert's output (k, dim) and a shared expert's output (dim) */
static int64_t experts_floats(const StepPlan *p) {
    return p->n_experts > 0 ? 2 + p->n_experts + 5 * p->top_k + p->top_k * p->dim +
                                  (p->shared_ffn_dim > 0 ? p->dim : 0)
                            : 0; /* 2: the alignment */
}

static int64_t shared_floats(const StepPlan *p) {
    const int64_t qkv = (p->heads + 2 * p->kv_heads) * p->head_dim;
    const int64_t chunks = chunks_of(p->max_seq);
    return 2 * p->dim + qkv + p->heads * p->head_dim + 2 * widest_ffn(p) + p->heads * p->max_seq +
           chunks * p->heads * p->head_dim + experts_floats(p);
}

static int64_t thread_floats(const StepPlan *p) {
    const int64_t k = widest_input(p);
    const int64_t blocks = k / 32; /* x's sums, then its int8 and its int16 blocks */
    const int64_t floats = 2 * p->dim + widest_ffn(p) + 3 * k + blocks +
                           blocks * (int64_t)((sizeof(XBlock) + sizeof(X16Block)) / sizeof(float));
    return (floats + 15) / 16 * 16 + 16; /* whole cache lines, one apart: threads never share a line */
}

int64_t llmt_step_scratch_floats(const StepPlan *p, int threads) {
    return shared_floats(p) + (threads < 1 ? 1 : threads) * thread_floats(p) + 16;
}

/* CLOCK_MONOTONIC in ns: what time.perf_counter_ns reads on Linux */
static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Everything below up to llmt_decode_ahead runs only in a build with the AVX2 row kernels (the step's products are
   them): without them llmt_step_supported() says 0, llmt_decode_step returns STEP_UNSUPPORTED and Python runs the
   torch fused path. */
#if LLMT_AVX2

/* ---- the stages' pieces ------------------------------------------------------------------------------------ */

static inline void barrier(void) {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

/* Where a stage ends, traced or not, fused or staged. A stage's stamp is thread 0's clock reading at
   stamps[n_stamps++] (when the step is traced: stamps not NULL). `wait`: every thread must be done with it before
   anyone goes on (a product, whose rows each thread writes), so a barrier comes first; a stage thread 0 runs alone
   or every thread runs whole (a norm, RoPE, a residual) ends without one, except in a staged step, whose every
   stage ends at a barrier. */
typedef struct {
    int t, staged;
    int64_t *stamps, n_stamps;
} Stages;

static inline void end_stage(Stages *s, int wait) {
    if (wait || s->staged) barrier();
    if (s->t == 0 && s->stamps != NULL) s->stamps[s->n_stamps++] = now_ns();
}

/* out = x / sqrt(mean(x^2) + eps) * w, the mean's root as hypot(||x||, sqrt(dim*eps)) / sqrt(dim) (functional.py);
   the squares summed in 16 fp32 lanes, as torch's vectorised norm does (n is a multiple of 32 here) */
static void rms_norm(const float *x, const float *w, int64_t n, float floor, float *out) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        s0 = _mm256_fmadd_ps(a, a, s0);
        s1 = _mm256_fmadd_ps(b, b, s1);
    }
    float squares = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) squares += x[i] * x[i];
    const float rms = hypotf(sqrtf(squares), floor) * (float)(1.0 / sqrt((double)n));
    for (int64_t i = 0; i < n; i++) out[i] = x[i] / rms * w[i];
}

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

/* gelu's tanh approximation as a sigmoid: 0.5 g (1 + tanh(y)) = g / (1 + e^-2y), y = sqrt(2/pi) (g + 0.044715 g^3) */
#define GELU_2_SQRT_2_OVER_PI 1.5957691216057308f
#define GELU_CUBE 0.044715f

/* act[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i]; with `gelu` (Gemma's GeGLU)
   gelu_tanh(gate[i]) * up[i] = gate[i] / (1 + e^-2y) * up[i] (within a few ulp of torch's 0.5 g (1 + tanh(y))) */
static void gated(const float *gate, const float *up, int64_t n, int gelu, float *act) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256 c = _mm256_set1_ps(GELU_2_SQRT_2_OVER_PI), cube = _mm256_set1_ps(GELU_CUBE);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 z = gelu ? _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(cube, g), _mm256_mul_ps(g, g), g)) : g;
        const __m256 e = exp8(_mm256_xor_ps(z, sign));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) {
        const float g = gate[i], z = gelu ? GELU_2_SQRT_2_OVER_PI * (GELU_CUBE * g * (g * g) + g) : g;
        act[i] = g / (1.0f + expf(-z)) * up[i];
    }
}

/* Gemma's final soft-cap, in place: l = cap * tanh(l / cap), tanh(y) = 1 - 2 / (1 + e^2y) (within ~1e-7 of tanhf,
   absolute: what the soft-cap keeps of it is cap times that) */
static void soft_cap(float *logits, int64_t n, float cap) {
    const __m256 c = _mm256_set1_ps(cap), one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 y = _mm256_div_ps(_mm256_loadu_ps(logits + i), c);
        const __m256 e = exp8(_mm256_add_ps(y, y));
        const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, e)));
        _mm256_storeu_ps(logits + i, _mm256_mul_ps(c, t));
    }
    for (; i < n; i++) logits[i] = cap * tanhf(logits[i] / cap);
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
   (quantized to int8 blocks for the i8dot parts, int16 ones for the i16dot parts, in the orders the exact kernels
   need for the others), then
   `share_rows`' rows, each part's rows plus their bias, written at their row of `out` (a row's value does not
   depend on the range or the thread that computes it: every row is one dot_rows call over the same prepared x). */
static void product_rows(const Matrix *mat, const float *x, float *xs, const float *bias, float *out, int64_t lo,
                         int64_t hi, int t, int count) {
    const int64_t k = mat->k;
    float *sx = xs + 3 * k;
    XBlock *xq = (XBlock *)(sx + k / 32);
    X16Block *x16 = (X16Block *)(xq + k / 32);
    int64_t first[MAX_PARTS], last[MAX_PARTS];
    int made[3] = {0, 0, 0}, any = 0, quantized = 0, quantized16 = 0;
    for (int p = 0; p < mat->parts; p++) {
        share_rows(mat, p, lo, hi, t, count, &first[p], &last[p]);
        any |= first[p] < last[p];
    }
    if (!any) return;
    for (int p = 0; p < mat->parts; p++) {
        if (first[p] >= last[p]) continue;
        if (mat->acts[p] == INT8_X) {
            if (!quantized) quantize_x(x, k, xq);
            quantized = 1;
            continue;
        }
        if (mat->acts[p] == INT16_X) {
            if (!quantized16) quantize_x16(x, k, x16);
            quantized16 = 1;
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
        if (mat->acts[p] == INT8_X)
            i8_dot_rows(mat, p, first[p], last[p], xq, 1, o, 0);
        else if (mat->acts[p] == INT16_X)
            i16_dot_rows(mat, p, first[p], last[p], x16, 1, o, 0);
        else
            dot_rows(mat->types[p], mat->w[p], mat->strides[p], first[p], last[p], k / mat->block_values[p],
                     xs + x_order(mat->types[p]) * k, sx, o);
        if (bias != NULL) {
            const float *b = bias + mat->column[p];
            for (int64_t r = first[p]; r < last[p]; r++) o[r] += b[r];
        }
    }
}

/* QK-norm (Qwen3): each of the H query and Hkv key heads at the front of qkv RMS-normalised over its D values, in
   place, times the layer's q or k weight (rms_norm reads every value of a head before writing it) */
static void qk_norm(const StepPlan *p, const StepLayer *layer, float *qkv) {
    const int64_t d = p->head_dim;
    if (p->qk_norm_whole) { /* OLMoE: the whole q, then the whole k, each one RMSNorm */
        rms_norm(qkv, layer->q_norm, p->heads * d, p->qk_norm_floor, qkv);
        rms_norm(qkv + p->heads * d, layer->k_norm, p->kv_heads * d, p->qk_norm_floor_k, qkv + p->heads * d);
        return;
    }
    for (int64_t h = 0; h < p->heads + p->kv_heads; h++)
        rms_norm(qkv + h * d, h < p->heads ? layer->q_norm : layer->k_norm, d, p->qk_norm_floor, qkv + h * d);
}


/* RoPE on the first r values of `heads` heads of D values in place: x*cos + roll(x, r/2)*sin (sin signed) over
   them, as rope.py's tables (r wide) mean it; the other D - r values pass through (r = D: the whole head) */
static void rope(float *x, int64_t heads, int64_t d, int64_t r, const float *cos, const float *sin) {
    const int64_t half = r / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * d;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] + b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* this token's K and V heads (after Q's in qkv) into the layer's cache rows at `position`: K heads then V heads,
   as the cache holds them (keys: the layer's first K head) */
static void write_kv(const StepPlan *p, const float *qkv, float *keys, int64_t position) {
    const int64_t d = p->head_dim;
    for (int64_t g = 0; g < 2 * p->kv_heads; g++)
        memcpy(keys + g * p->kv_head + position * d, qkv + (p->heads + g) * d, sizeof(float) * (size_t)d);
}

/* The query heads [*first, *last) thread t of `count` attends (contiguous runs, sizes differing by at most one). */
static void split(int64_t n, int t, int count, int64_t *first, int64_t *last) {
    *first = n * t / count;
    *last = n * (t + 1) / count;
}

/* ---- attention ---------------------------------------------------------------------------------------------
 * Per query head: s = (q . k) * scale over the cached keys, p = softmax(s), o = sum_s p[s] v[s]. Query heads that
 * share a KV head (GQA) run together, up to ATTN_GROUP at a time, so each key and value row is read once for all
 * of them. Every value a head gets is the same function of its q and the cache whichever group, thread, split or
 * stage order computes it (the staged step is bit for bit the fused one, 1 thread's step is 2 threads'):
 * - a score sums q*k in 8 lanes (one fma per 8 of D, the last 8 masked) folded as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7));
 *   four positions fold at once (hadd, hadd, the halves), each in its own lanes;
 * - a value lane is, per chunk of ATTN_CHUNK positions (counted from the first key attended), an fma chain over the
 *   chunk's positions in order from 0, and the chunks' sums are added in order.
 * Split between threads evenly (`balanced_*`): scores by positions, softmax by heads, values by (KV head, chunk)
 * pieces whose sums then meet; a barrier between the three.
 * Measured (BENCHMARKS.md, "Native step attention"): faster than one dot per position and head only while the cache
 * is in L2/L3; streamed from DRAM, as the bundled model's decode step reads it, the bytes set the time. */

/* lanes [0, n) all ones, the rest zero (n in 0..8): maskload's mask for a row's last partial 8 */
static inline __m256i lanes_below(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* the four 8-lane sums of a, b, c, e as (sum a, sum b, sum c, sum e), each folded in the same order */
static inline __m128 fold4(__m256 a, __m256 b, __m256 c, __m256 e) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, e));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* scores of `n` query heads (rows of d at q + h*d) against keys [0, seen) (rows of d), head h's at
   scores + h*stride; n a constant where it is inlined, so the accumulators stay in registers */
static inline __attribute__((always_inline)) void scores_group(const float *q, int n, int64_t d, const float *keys,
                                                               int64_t seen, float scale, float *scores,
                                                               int64_t stride) {
    const __m128 sc = _mm_set1_ps(scale);
    const int64_t whole = d / 8 * 8;
    const __m256i tail = lanes_below(d - whole);
    for (int64_t s = 0; s < seen; s += 4) {
        const int64_t m = seen - s < 4 ? seen - s : 4; /* positions this round; the rest reread row s, unstored */
        const float *k0 = keys + s * d, *k1 = m > 1 ? k0 + d : k0, *k2 = m > 2 ? k0 + 2 * d : k0,
                    *k3 = m > 3 ? k0 + 3 * d : k0;
        for (int64_t b = 0; b < 4 * d; b += 16) _mm_prefetch((const char *)(k0 + b) + ATTN_PREFETCH, _MM_HINT_T0);
        __m256 acc[ATTN_GROUP][4];
        for (int h = 0; h < n; h++)
            for (int j = 0; j < 4; j++) acc[h][j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            const int part = i == whole;
            const __m256 a0 = part ? _mm256_maskload_ps(k0 + i, tail) : _mm256_loadu_ps(k0 + i),
                         a1 = part ? _mm256_maskload_ps(k1 + i, tail) : _mm256_loadu_ps(k1 + i),
                         a2 = part ? _mm256_maskload_ps(k2 + i, tail) : _mm256_loadu_ps(k2 + i),
                         a3 = part ? _mm256_maskload_ps(k3 + i, tail) : _mm256_loadu_ps(k3 + i);
            for (int h = 0; h < n; h++) {
                const __m256 x = part ? _mm256_maskload_ps(q + h * d + i, tail) : _mm256_loadu_ps(q + h * d + i);
                acc[h][0] = _mm256_fmadd_ps(x, a0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(x, a1, acc[h][1]);
                acc[h][2] = _mm256_fmadd_ps(x, a2, acc[h][2]);
                acc[h][3] = _mm256_fmadd_ps(x, a3, acc[h][3]);
            }
        }
        for (int h = 0; h < n; h++) {
            const __m128 r = _mm_mul_ps(fold4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), sc);
            if (m == 4) {
                _mm_storeu_ps(scores + h * stride + s, r);
            } else {
                float out[4];
                _mm_storeu_ps(out, r);
                for (int64_t j = 0; j < m; j++) scores[h * stride + s + j] = out[j];
            }
        }
    }
}

/* lanes [i, i + 8*v) of the values of `n` query heads (probabilities at probs + h*stride) over rows [0, seen) of
   `values` into out + h*d: one chunk, seen <= ATTN_CHUNK (balanced_values cuts the positions into chunks); v (1..4)
   and n constants where inlined; `tail`: the mask of the 8 lanes when v is 1 */
static inline __attribute__((always_inline)) void values_lanes(const float *probs, int64_t stride, int n, int64_t d,
                                                               const float *values, int64_t seen, int64_t i, int v,
                                                               __m256i tail, float *out) {
    __m256 acc[ATTN_GROUP][4];
    for (int h = 0; h < n; h++)
        for (int j = 0; j < v; j++) acc[h][j] = _mm256_setzero_ps();
    const float *row = values + i;
    for (int64_t s = 0; s < seen; s++, row += d) {
        for (int j = 0; j < v; j += 2) _mm_prefetch((const char *)(row + 8 * j) + ATTN_PREFETCH, _MM_HINT_T0);
        __m256 r[4];
        for (int j = 0; j < v; j++) r[j] = v == 1 ? _mm256_maskload_ps(row, tail) : _mm256_loadu_ps(row + 8 * j);
        for (int h = 0; h < n; h++) {
            const __m256 w = _mm256_broadcast_ss(probs + h * stride + s);
            for (int j = 0; j < v; j++) acc[h][j] = _mm256_fmadd_ps(w, r[j], acc[h][j]);
        }
    }
    for (int h = 0; h < n; h++)
        for (int j = 0; j < v; j++) {
            float *o = out + h * d + i + 8 * j;
            if (v == 1) _mm256_maskstore_ps(o, tail, acc[h][0]);
            else _mm256_storeu_ps(o, acc[h][j]);
        }
}

/* lanes [0, d) */
static inline __attribute__((always_inline)) void values_group(const float *probs, int64_t stride, int n, int64_t d,
                                                               const float *values, int64_t seen, float *out) {
    const __m256i all = _mm256_set1_epi32(-1);
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) values_lanes(probs, stride, n, d, values, seen, i, 4, all, out);
    for (; i < d; i += 8) values_lanes(probs, stride, n, d, values, seen, i, 1, lanes_below(d - i), out);
}

/* max, e^(s - max), their total in 8 lanes, then each times 1/total */
static void softmax(float *s, int64_t n) {
    float top = s[0];
    int64_t i = 0;
    if (n >= 8) {
        __m256 most = _mm256_loadu_ps(s);
        for (i = 8; i + 8 <= n; i += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(s + i));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    }
    for (; i < n; i++) top = s[i] > top ? s[i] : top;
    i = 0;
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
        _mm256_storeu_ps(s + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum(sum);
    for (; i < n; i++) {
        s[i] = expf(s[i] - top);
        total += s[i];
    }
    const float inverse = 1.0f / total;
    for (i = 0; i < n; i++) s[i] *= inverse;
}

/* The query heads [lo, hi) in runs of at most ATTN_GROUP that share a KV head: *n heads from *hq, of KV head *g.
   Returns 0 when none are left. */
static inline int next_group(int64_t *hq, int64_t *n, int64_t *g, int64_t hi, int64_t rep) {
    *hq += *n;
    if (*hq >= hi) return 0;
    *g = *hq / rep;
    const int64_t end = (*g + 1) * rep < hi ? (*g + 1) * rep : hi;
    *n = end - *hq < ATTN_GROUP ? end - *hq : ATTN_GROUP;
    return 1;
}

#define FOR_GROUPS(hq, n, g, lo, hi, rep) for (int64_t hq = (lo), n = 0, g = 0; next_group(&hq, &n, &g, (hi), (rep));)

/* `call(c)` for the run's n (1..ATTN_GROUP) with c a constant, so each size gets its own registers */
#define BY_GROUP_SIZE(n, call)                                                                                       \
    do {                                                                                                             \
        switch (n) {                                                                                                 \
        case 1: call(1); break;                                                                                      \
        case 2: call(2); break;                                                                                      \
        case 3: call(3); break;                                                                                      \
        default: call(4); break;                                                                                     \
        }                                                                                                            \
    } while (0)

/* scores of query heads [lo, hi) (q at qkv + hq*D) against `seen` keys from `first`, into scores + hq*S_max */
static void attention_scores(const StepPlan *p, const float *qkv, const float *keys, int64_t first, int64_t seen,
                             float *scores, int64_t lo, int64_t hi) {
    const int64_t d = p->head_dim, rep = p->heads / p->kv_heads;
    FOR_GROUPS(hq, n, g, lo, hi, rep) {
        const float *k = keys + g * p->kv_head + first * d;
#define SCORES(c) scores_group(qkv + hq * d, c, d, k, seen, p->scale, scores + hq * p->max_seq, p->max_seq)
        BY_GROUP_SIZE(n, SCORES);
#undef SCORES
    }
}

static void attention_softmax(const StepPlan *p, float *scores, int64_t seen, int64_t lo, int64_t hi) {
    for (int64_t hq = lo; hq < hi; hq++) softmax(scores + hq * p->max_seq, seen);
}

/* Thread t of `count`'s even shares. Scores: positions [seen*t/count, seen*(t+1)/count) of every head. */
static void balanced_scores(const StepPlan *p, const float *qkv, const float *keys, int64_t first, int64_t seen,
                            float *scores, int t, int count) {
    int64_t lo, hi;
    split(seen, t, count, &lo, &hi);
    if (lo < hi) attention_scores(p, qkv, keys, first + lo, hi - lo, scores + lo, 0, p->heads);
}

/* Values: a run of the (KV head, chunk of ATTN_CHUNK positions) pieces, each for all its query heads, into
   `pieces` (chunk c's sums of head h at pieces + (c*H + h)*D); at a barrier, each thread adds up its `split` of
   the heads' chunks in order into `attended`. One chunk: straight into `attended`, no barrier. */
static void balanced_values(const StepPlan *p, const float *scores, const float *values, int64_t first, int64_t seen,
                            float *pieces, float *attended, int t, int count) {
    const int64_t d = p->head_dim, heads = p->heads, rep = heads / p->kv_heads;
    const int64_t chunks = chunks_of(seen), units = p->kv_heads * chunks;
    float *out = chunks == 1 ? attended : pieces;
    int64_t u_first, u_last;
    split(units, t, count, &u_first, &u_last);
    for (int64_t u = u_first; u < u_last; u++) {
        const int64_t g = u / chunks, c = u % chunks, from = c * ATTN_CHUNK;
        const int64_t rows = from + ATTN_CHUNK < seen ? ATTN_CHUNK : seen - from;
        const float *v = values + g * p->kv_head + (first + from) * d;
        FOR_GROUPS(hq, n, kv, g * rep, (g + 1) * rep, rep) {
            (void)kv;
#define VALUES(k) values_group(scores + hq * p->max_seq + from, p->max_seq, k, d, v, rows, out + (c * heads + hq) * d)
            BY_GROUP_SIZE(n, VALUES);
#undef VALUES
        }
    }
    if (chunks == 1) return;
    barrier();
    int64_t lo, hi;
    split(heads, t, count, &lo, &hi);
    for (int64_t hq = lo; hq < hi; hq++) {
        float *o = attended + hq * d;
        memcpy(o, pieces + hq * d, sizeof(float) * (size_t)d);
        for (int64_t c = 1; c < chunks; c++) {
            const float *piece = pieces + (c * heads + hq) * d;
            for (int64_t i = 0; i < d; i++) o[i] = o[i] + piece[i];
        }
    }
}

/* The attention's three stages: scores, softmax (thread t's share of the heads), values, each ended at a barrier. */
static void attend(const StepPlan *p, const float *qkv, const float *keys, const float *values, int64_t first,
                   int64_t seen, float *scores, float *pieces, float *attended, int t, int count, Stages *stages) {
    int64_t head_first, head_last;
    split(p->heads, t, count, &head_first, &head_last);
    balanced_scores(p, qkv, keys, first, seen, scores, t, count);
    end_stage(stages, 1);
    attention_softmax(p, scores, seen, head_first, head_last);
    end_stage(stages, 1);
    balanced_values(p, scores, values, first, seen, pieces, attended, t, count);
    end_stage(stages, 1);
}

/* ---- a mixture of experts -----------------------------------------------------------------------------------
 * route: softmax over the E router logits in fp32 (max, e^(l - max) with expf, their sum, each divided by it, as
 * torch.softmax does), the k largest kept, largest first (the first of equal ones), and where the model renormalises
 * each divided by their sum (functional.route_top_k). The chosen experts then run in ascending order (as the stage
 * modules run them: MixtureOfExperts.forward's unique()), each its gate|up product, silu*up and down product into its
 * slot's row of `outputs`; the weighted sum adds the slots in order, each output times its weight, in fp32
 * (functional.combine_experts). */

static void route(const StepPlan *p, float *logits, int64_t *chosen, float *weights, int64_t *order) {
    const int64_t e = p->n_experts, k = p->top_k;
    float top = logits[0], total = 0.0f;
    for (int64_t i = 1; i < e; i++) top = logits[i] > top ? logits[i] : top;
    for (int64_t i = 0; i < e; i++) {
        logits[i] = expf(logits[i] - top);
        total += logits[i];
    }
    for (int64_t i = 0; i < e; i++) logits[i] = logits[i] / total;
    float kept = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < e; i++) {
            int taken = 0;
            for (int64_t q = 0; q < j; q++) taken |= chosen[q] == i;
            if (!taken && (best < 0 || logits[i] > logits[best])) best = i;
        }
        chosen[j] = best;
        weights[j] = logits[best];
        kept += logits[best];
    }
    if (p->renormalise)
        for (int64_t j = 0; j < k; j++) weights[j] = weights[j] / kept;
    for (int64_t j = 0; j < k; j++) order[j] = j; /* slots by ascending expert (k is a handful: insertion sort) */
    for (int64_t j = 1; j < k; j++)
        for (int64_t q = j; q > 0 && chosen[order[q]] < chosen[order[q - 1]]; q--) {
            const int64_t swap = order[q];
            order[q] = order[q - 1];
            order[q - 1] = swap;
        }
}

/* this thread's rows of the router's logits: a described (stored) router through product_rows, a dense one as
   fp32 dot products over its rows */
static void router_rows(const StepPlan *p, const StepLayer *layer, const float *h, float *xs, float *logits, int t,
                        int count) {
    if (layer->router != NULL) {
        product_rows(layer->router, h, xs, NULL, logits, 0, p->n_experts, t, count);
        return;
    }
    int64_t lo, hi;
    split(p->n_experts, t, count, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const float *w = layer->router_dense + r * p->dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < p->dim; i++) sum += w[i] * h[i];
        logits[r] = sum;
    }
}

/* ---- the step ---------------------------------------------------------------------------------------------- */

/* A sub-block's output `out` (dim,) into this thread's residual stream x: normalised first into h where the layer
   has a norm after the sub-block (Gemma's post-attention and post-FFN norms; `norm` NULL: none), each its stage */
static void add_residual(const StepPlan *p, const float *norm, const float *out, float *h, float *x, Stages *s) {
    if (norm != NULL) {
        rms_norm(out, norm, p->dim, p->norm_floor, h); /* every thread its own h, as the norms before */
        end_stage(s, 0);
        out = h;
    }
    for (int64_t i = 0; i < p->dim; i++) x[i] = out[i] + x[i];
    end_stage(s, 0);
}

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
        if (row >= 0 && row < m->rows[p]) { /* a tied Q4_0/Q4_1 table on i8dot is held interleaved: part_row */
            uint8_t *scratch = m->groups[p] != NULL ? malloc((size_t)m->row_bytes[p]) : NULL;
            if (m->groups[p] != NULL && scratch == NULL) return; /* no memory for one row: x stays as it was */
            dequantize_row(m->types[p], part_row(m, p, row, scratch), m->k / m->block_values[p], x);
            free(scratch);
            return;
        }
    }
}

/* token: the token's id, looked up in the embedding table here; it sits at `position`, and each layer attends keys
   first..position, first > 0 past its sliding window (first_attended_position), its RoPE tables' row `position`;
   logits (vocab,) out; stamps: NULL, or room for a traced step's readings (ns; fused_stamps(plan), or with
   `staged` one more per layer and Q|K|V, three more per expert): the step's start, then the end of each stage from
   the embedding to the LM head (Gemma's scale after the embedding, its soft-cap after the head). `staged`: run the
   staged path's stages apart (the header comment). routed, routed_weights: NULL, or room for layers * k of each: a
   mixture of experts' choice in every layer (its k experts, largest weight first, and their weights), the route
   stage's. Returns STEP_OK or a status. */
int llmt_decode_step(const StepPlan *plan, int64_t token, int64_t position, float *logits, int64_t *stamps,
                     int threads, int staged, int64_t *routed, float *routed_weights) {
    if (position < 0 || position >= plan->max_seq) return STEP_BAD_SHAPE;
    if (token < 0 || token >= plan->embedding_rows) return STEP_BAD_TOKEN;
    int team = threads < 1 ? 1 : threads;
    if (llmt_step_scratch_floats(plan, team) > plan->scratch_floats) return STEP_SCRATCH;
    const int64_t dim = plan->dim, heads = plan->heads, kv_heads = plan->kv_heads, d = plan->head_dim;
    const int64_t ffn = plan->ffn_dim;
    const int64_t q_rows = heads * d, kv_rows = kv_heads * d; /* Q|K|V's row blocks */
    float *embedding = plan->scratch;               /* (dim,) the token's row */
    float *branch = embedding + dim;                /* (dim,) wo's or w2's output */
    float *qkv = branch + dim;                      /* ((H+2Hkv)*D,) */
    float *attended = qkv + (heads + 2 * kv_heads) * d; /* (H*D,) */
    float *gate_up = attended + heads * d;          /* (2F,), or a shared expert's (2Fs,) where wider */
    float *scores = gate_up + 2 * widest_ffn(plan); /* (H, S_max) */
    float *pieces = scores + heads * plan->max_seq; /* (S_max/ATTN_CHUNK, H, D) the values' sums per chunk */
    /* a mixture of experts': its choice (k,) and the slots by ascending expert (k,), 8-byte aligned, then the
       choice's weights (k,), the router's logits (E,), each chosen expert's output (k, dim) and a shared
       expert's output (dim,) */
    int64_t *chosen = (int64_t *)(((uintptr_t)(pieces + chunks_of(plan->max_seq) * heads * d) + 7) & ~(uintptr_t)7);
    int64_t *order = chosen + plan->top_k;
    float *chosen_weights = (float *)(order + plan->top_k);
    float *router = chosen_weights + plan->top_k;
    float *outputs = router + plan->n_experts;
    float *shared_out = outputs + plan->top_k * dim;
    const int64_t shared_ffn = plan->shared_ffn_dim;
    float *own = (float *)(((uintptr_t)(pieces + chunks_of(plan->max_seq) * heads * d + experts_floats(plan)) +
                            63) & ~(uintptr_t)63);
    const int traced = stamps != NULL;
    int64_t before_layers = 2; /* stamps[0]: the start; [1]: the embedding; [2]: Gemma's scale */
    if (traced) stamps[0] = now_ns();
    embed(plan, token, embedding);
    if (traced) stamps[1] = now_ns();
    if (plan->embed_scale != 0.0f) {
        for (int64_t i = 0; i < dim; i++) embedding[i] = embedding[i] * plan->embed_scale;
        if (traced) stamps[before_layers] = now_ns();
        before_layers++;
    }

#ifdef _OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
    {
        int count;
        const int t = current_thread(&count);
        float *x = own + t * thread_floats(plan); /* (dim,) this thread's copy of the residual stream */
        float *h = x + dim;                       /* (dim,) a norm's output */
        float *act = h + dim;                     /* (F,) silu(gate) * up (a shared expert's: Fs) */
        float *xs = act + widest_ffn(plan);       /* the prepared activation row */
        memcpy(x, embedding, sizeof(float) * (size_t)dim);
        Stages stages = {t, staged, stamps, before_layers}; /* thread 0's stamps: after the start and the embedding */
        /* a staged step's packed products over their row blocks apart (Q, K, V; gate, up), a fused step's whole */
        int64_t qkv_cut[4] = {0, q_rows, q_rows + kv_rows, q_rows + 2 * kv_rows}, ffn_cut[3] = {0, ffn, 2 * ffn};
        int64_t shared_cut[3] = {0, shared_ffn, 2 * shared_ffn};
        const int qkv_blocks = staged ? 3 : 1, ffn_blocks = staged ? 2 : 1;
        qkv_cut[qkv_blocks] = qkv_cut[3];
        ffn_cut[ffn_blocks] = ffn_cut[2];
        shared_cut[ffn_blocks] = shared_cut[2];
        for (int64_t l = 0; l < plan->layers; l++) {
            const StepLayer *layer = plan->layer + l;
            float *keys = plan->kv + l * plan->kv_layer;       /* K head g at keys + g*kv_head */
            float *values = keys + kv_heads * plan->kv_head; /* V head g at values + g*kv_head */
            const int64_t window = layer->window;
            const int64_t first = window > 0 && position + 1 > window ? position + 1 - window : 0;
            rms_norm(x, layer->attention_norm, dim, plan->norm_floor, h);
            end_stage(&stages, 0);
            /* OLMoE's whole-q, whole-k norm runs between K and V when staged, where the stage modules run it */
            const int norm_after_k = staged && plan->qk_norm_whole && layer->q_norm != NULL;
            for (int b = 0; b < qkv_blocks; b++) {
                product_rows(layer->wqkv, h, xs, layer->bqkv, qkv, qkv_cut[b], qkv_cut[b + 1], t, count);
                end_stage(&stages, 1);
                if (norm_after_k && b == 1) {
                    if (t == 0) qk_norm(plan, layer, qkv);
                    end_stage(&stages, 0);
                }
            }
            if (layer->q_norm != NULL && !norm_after_k) {
                if (t == 0) qk_norm(plan, layer, qkv);
                end_stage(&stages, 0);
            }
            if (t == 0) {
                const int64_t r = plan->rotary;
                rope(qkv, heads + kv_heads, d, r, layer->cos + position * r, layer->sin + position * r);
            }
            end_stage(&stages, 0);
            if (t == 0) write_kv(plan, qkv, keys, position);
            end_stage(&stages, 0);
            if (!staged) barrier(); /* the scores read the cache row thread 0 wrote */
            attend(plan, qkv, keys, values, first, position + 1 - first, scores, pieces, attended, t, count, &stages);
            product_rows(layer->wo, attended, xs, layer->bo, branch, 0, layer->wo->total_rows, t, count);
            end_stage(&stages, 1);
            add_residual(plan, layer->post_attention_norm, branch, h, x, &stages);
            rms_norm(x, layer->ffn_norm, dim, plan->norm_floor, h);
            end_stage(&stages, 0);
            float shared_logit = 0.0f; /* this thread's: every thread takes the shared expert's gate itself */
            if (plan->n_experts > 0 && shared_ffn > 0) { /* Qwen2-MoE's shared expert, on h, before the router */
                for (int b = 0; b < ffn_blocks; b++) {
                    product_rows(layer->shared_w13, h, xs, NULL, gate_up, shared_cut[b], shared_cut[b + 1], t,
                                 count);
                    end_stage(&stages, 1);
                }
                gated(gate_up, gate_up + shared_ffn, shared_ffn, 0, act);
                end_stage(&stages, 0);
                product_rows(layer->shared_w2, act, xs, NULL, shared_out, 0, dim, t, count);
                end_stage(&stages, 1);
                for (int64_t i = 0; i < dim; i++) shared_logit += layer->shared_gate[i] * h[i];
                end_stage(&stages, 0);
            }
            if (plan->n_experts > 0) {
                router_rows(plan, layer, h, xs, router, t, count);
                end_stage(&stages, 1);
                if (t == 0) route(plan, router, chosen, chosen_weights, order);
                end_stage(&stages, 1); /* every thread reads the choice */
                for (int64_t j = 0; j < plan->top_k; j++) {
                    const int64_t slot = order[j], e = chosen[slot];
                    for (int b = 0; b < ffn_blocks; b++) {
                        product_rows(layer->expert_w13[e], h, xs, NULL, gate_up, ffn_cut[b], ffn_cut[b + 1], t,
                                     count);
                        end_stage(&stages, 1);
                    }
                    gated(gate_up, gate_up + ffn, ffn, 0, act);
                    end_stage(&stages, 0);
                    product_rows(layer->expert_w2[e], act, xs, NULL, outputs + slot * dim, 0, dim, t, count);
                    end_stage(&stages, 1);
                }
                for (int64_t i = 0; i < dim; i++) { /* the weighted sum into this thread's h: h is read no more */
                    float sum = 0.0f;
                    for (int64_t j = 0; j < plan->top_k; j++) sum += outputs[j * dim + i] * chosen_weights[j];
                    h[i] = sum;
                }
                end_stage(&stages, 0);
                if (shared_ffn > 0) { /* + sigmoid(logit) * the shared expert's output */
                    const float scale = 1.0f / (1.0f + expf(-shared_logit));
                    for (int64_t i = 0; i < dim; i++) h[i] = h[i] + scale * shared_out[i];
                    end_stage(&stages, 0);
                }
                add_residual(plan, layer->post_ffn_norm, h, h, x, &stages);
                if (t == 0 && routed != NULL)
                    for (int64_t j = 0; j < plan->top_k; j++) {
                        routed[l * plan->top_k + j] = chosen[j];
                        routed_weights[l * plan->top_k + j] = chosen_weights[j];
                    }
                continue;
            }
            for (int b = 0; b < ffn_blocks; b++) {
                product_rows(layer->w13, h, xs, layer->b13, gate_up, ffn_cut[b], ffn_cut[b + 1], t, count);
                end_stage(&stages, 1);
            }
            gated(gate_up, gate_up + ffn, ffn, (int)plan->gelu, act); /* every thread all of it: w2 reads all of act */
            end_stage(&stages, 0);
            product_rows(layer->w2, act, xs, layer->b2, branch, 0, layer->w2->total_rows, t, count);
            end_stage(&stages, 1);
            add_residual(plan, layer->post_ffn_norm, branch, h, x, &stages);
        }
        rms_norm(x, plan->final_norm, dim, plan->norm_floor, h);
        end_stage(&stages, 0);
        product_rows(plan->head, h, xs, plan->head_bias, logits, 0, plan->head->total_rows, t, count);
        end_stage(&stages, 1);
        if (plan->softcap != 0.0f) { /* each thread its share of the logits, all of them written (the barrier) */
            int64_t lo, hi;
            split(plan->vocab, t, count, &lo, &hi);
            soft_cap(logits + lo, hi - lo, plan->softcap);
            end_stage(&stages, 1);
        }
    }
    return STEP_OK;
}

#else /* !LLMT_AVX2 */
int llmt_decode_step(const StepPlan *plan, int64_t token, int64_t position, float *logits, int64_t *stamps,
                     int threads, int staged, int64_t *routed, float *routed_weights) {
    (void)plan, (void)token, (void)position, (void)logits, (void)stamps;
    (void)threads, (void)staged, (void)routed, (void)routed_weights;
    return STEP_UNSUPPORTED;
}
#endif /* LLMT_AVX2 */

/* Decode steps back to back in one call (native_step.py's NativeStep.run_ahead), each next token chosen by
   `choose(i)`, called after step i wrote its logits: the caller's sampler (tracer/run/sampling.py, the one every
   run uses) reading them from `logits`. Why: between two steps called from Python a decode token spends ~0.3 ms in
   Python besides its sampling (the loop, the step's call, the records), every line of it cold after the step
   streamed the weights; here only the choice runs between two steps, and the records are made after the call.
   Stops after `steps` steps or after the step that chose `stop_token`. Step i writes chosen[i]; clock [3 * i ..]:
   its start, its logits' end and its choice's end (CLOCK_MONOTONIC ns); when `stamps` is not NULL its stage stamps
   at stamps + i * fused_stamps(plan), as llmt_decode_step's, and when `routed` is not NULL its choice at
   routed + i * layers * k (routed_weights alike). `logits` (vocab,) holds the last step's.
   Returns the steps completed; *status: STEP_OK, or the status of the step that failed (its KV rows unwritten but
   for STEP_NOT_CHOSEN: `choose` answered no token in [0, vocab): the caller's sampler refused the logits).
   In every build: without the AVX2 row kernels the first step answers STEP_UNSUPPORTED. */
typedef int64_t (*llmt_choose_fn)(int64_t step); /* the next token after step `step`, or -1: none */

int64_t llmt_decode_ahead(const StepPlan *plan, int64_t token, int64_t position, int64_t steps, int64_t stop_token,
                          llmt_choose_fn choose, float *logits, int64_t *chosen, int64_t *clock, int64_t *stamps,
                          int threads, int *status, int64_t *routed, float *routed_weights) {
    const int64_t per_step = fused_stamps(plan);
    *status = STEP_OK;
    if (steps < 0 || choose == NULL) {
        *status = STEP_BAD_SHAPE;
        return 0;
    }
    for (int64_t i = 0; i < steps; i++) {
        const int64_t at = position + i;
        int64_t *times = clock + 3 * i;
        times[0] = now_ns();
        const int64_t route = i * plan->layers * plan->top_k;
        *status = llmt_decode_step(plan, token, at, logits, stamps == NULL ? NULL : stamps + i * per_step, threads, 0,
                                   routed == NULL ? NULL : routed + route,
                                   routed_weights == NULL ? NULL : routed_weights + route);
        times[1] = now_ns();
        if (*status != STEP_OK) return i;
        token = choose(i);
        if (token < 0 || token >= plan->vocab) {
            *status = STEP_NOT_CHOSEN;
            return i;
        }
        chosen[i] = token;
        times[2] = now_ns();
        if (token == stop_token) return i + 1;
    }
    return steps;
}
