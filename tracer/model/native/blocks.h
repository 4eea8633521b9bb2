/* The GGUF block formats the native kernels read, as ggml writes them (ggml-common.h), and their scalar decoding.
 *
 * A matrix is N rows of K values, each row its blocks one after another. Per block (w: a value):
 *   Q4_0 (18 B / 32)   d, 16 B nibbles                          w = d * (q - 8)
 *   Q4_1 (20 B / 32)   d, m, 16 B nibbles                       w = d * q + m
 *   Q5_0 (22 B / 32)   d, 4 B fifth bits, 16 B nibbles          w = d * (q - 16)
 *   Q5_1 (24 B / 32)   d, m, 4 B fifth bits, 16 B nibbles       w = d * q + m
 *   Q8_0 (34 B / 32)   d, 32 int8                               w = q * d
 *   Q4_K (144 B / 256) d, dmin, 12 B 6-bit scales and mins, 128 B nibbles: per 32 values w = (d * sc) * q - dmin * m
 *   Q5_K (176 B / 256) as Q4_K plus 32 B of fifth bits
 *   Q6_K (210 B / 256) 128 B low nibbles, 64 B high 2 bits, 16 int8 scales, d: per 16 values w = (d * sc) * (q - 32)
 * In a 32-value block the low nibbles of the 16 bytes are values 0-15 and the high nibbles 16-31; in Q4_K/Q5_K bytes
 * 32p..32p+31 hold sub-block 2p in their low nibbles and 2p+1 in their high ones. d, m, dmin are fp16.
 *
 * Every kernel reads blocks through these structs (each the size ggml's is: the _Static_asserts), never by byte
 * offsets. Rows start at even addresses (row sizes are even, tensors aligned), so the fp16 fields are aligned.
 */

#ifndef LLMT_BLOCKS_H
#define LLMT_BLOCKS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMT_AVX2 1
#else
#define LLMT_AVX2 0
#endif

/* ggml type codes (ggml.h enum ggml_type) */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

typedef uint16_t ggml_half;

typedef struct { ggml_half d; uint8_t qs[16]; } block_q4_0;
typedef struct { ggml_half d, m; uint8_t qs[16]; } block_q4_1;
typedef struct { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; } block_q5_0;
typedef struct { ggml_half d, m; uint8_t qh[4]; uint8_t qs[16]; } block_q5_1;
typedef struct { ggml_half d; int8_t qs[32]; } block_q8_0;
typedef struct { ggml_half d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_K;
typedef struct { ggml_half d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } block_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; } block_q6_K;

_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0 is ggml's 18 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "block_q4_1 is ggml's 20 bytes");
_Static_assert(sizeof(block_q5_0) == 22, "block_q5_0 is ggml's 22 bytes");
_Static_assert(sizeof(block_q5_1) == 24, "block_q5_1 is ggml's 24 bytes");
_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0 is ggml's 34 bytes");
_Static_assert(sizeof(block_q4_K) == 144, "block_q4_K is ggml's 144 bytes");
_Static_assert(sizeof(block_q5_K) == 176, "block_q5_K is ggml's 176 bytes");
_Static_assert(sizeof(block_q6_K) == 210, "block_q6_K is ggml's 210 bytes");
_Static_assert(offsetof(block_q6_K, d) == 208, "Q6_K's d ends the block");

/* values and bytes of one block of `type`; 0 for a type the kernels do not read */
static inline int block_shape(int type, int64_t *values, int64_t *bytes) {
    switch (type) {
    case Q4_0: *values = 32; *bytes = sizeof(block_q4_0); return 1;
    case Q4_1: *values = 32; *bytes = sizeof(block_q4_1); return 1;
    case Q5_0: *values = 32; *bytes = sizeof(block_q5_0); return 1;
    case Q5_1: *values = 32; *bytes = sizeof(block_q5_1); return 1;
    case Q8_0: *values = 32; *bytes = sizeof(block_q8_0); return 1;
    case Q4_K: *values = 256; *bytes = sizeof(block_q4_K); return 1;
    case Q5_K: *values = 256; *bytes = sizeof(block_q5_K); return 1;
    case Q6_K: *values = 256; *bytes = sizeof(block_q6_K); return 1;
    default: return 0;
    }
}

/* fp16 -> fp32, exact (F16C's conversion, or the same by hand) */
static inline float half_to_float(ggml_half h) {
#if LLMT_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    float f;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in fp32 */
        f = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (exponent == 0x1F) bits = sign | 0x7F800000u | (mantissa << 13);
    else bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline uint32_t read_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Q4_K/Q5_K's 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes */
static inline void scale_min_k4(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* the same eight scales (sc) and mins (m) at once, as bytes 0..7 of two 64-bit words (the vector kernels' form) */
static inline void k4_scales(const uint8_t *packed, uint64_t *sc, uint64_t *m) {
    const uint32_t a = read_u32(packed), b = read_u32(packed + 4), c = read_u32(packed + 8);
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    const uint32_t m_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    *sc = (uint64_t)(a & 0x3F3F3F3Fu) | ((uint64_t)sc_hi << 32);
    *m = (uint64_t)(b & 0x3F3F3F3Fu) | ((uint64_t)m_hi << 32);
}

/* 32 values of the block at b (sub-block `sub` of a 256-value one) as codes and scales, w = a * c + off: codes c,
   the scale a0 of values 0-15 and a1 of 16-31 (they differ only in Q6_K), the offset off; a and off formed as the
   exact dequantization forms them. The scalar reference kernels (and the i8dot/i16dot ones' algebra) read this. */
static inline void block_codes(int type, const void *b, int sub, int c[32], float *a0, float *a1, float *off) {
    switch (type) {
    case Q4_0:
    case Q4_1: {
        const uint8_t *qs = type == Q4_1 ? ((const block_q4_1 *)b)->qs : ((const block_q4_0 *)b)->qs;
        const float d = half_to_float(*(const ggml_half *)b); /* d leads both */
        for (int j = 0; j < 16; j++) {
            c[j] = qs[j] & 0x0F;
            c[j + 16] = qs[j] >> 4;
        }
        *a0 = *a1 = d;
        *off = type == Q4_1 ? half_to_float(((const block_q4_1 *)b)->m) : -8.0f * d;
        return;
    }
    case Q5_0:
    case Q5_1: {
        const block_q5_0 *b0 = b;
        const block_q5_1 *b1 = b;
        const float d = half_to_float(b0->d);
        const uint32_t qh = read_u32(type == Q5_1 ? b1->qh : b0->qh);
        const uint8_t *qs = type == Q5_1 ? b1->qs : b0->qs;
        for (int j = 0; j < 16; j++) {
            c[j] = (qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            c[j + 16] = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
        }
        *a0 = *a1 = d;
        *off = type == Q5_1 ? half_to_float(b1->m) : -16.0f * d;
        return;
    }
    case Q8_0: {
        const block_q8_0 *q = b;
        for (int j = 0; j < 32; j++) c[j] = q->qs[j];
        *a0 = *a1 = half_to_float(q->d);
        *off = 0.0f;
        return;
    }
    case Q4_K:
    case Q5_K: {
        const block_q4_K *k4 = b;
        const block_q5_K *k5 = b;
        const float d = half_to_float(k4->d), dmin = half_to_float(k4->dmin);
        uint8_t sc, m;
        scale_min_k4(k4->scales, sub, &sc, &m);
        const uint8_t *qs = (type == Q4_K ? k4->qs : k5->qs) + 32 * (sub / 2);
        for (int l = 0; l < 32; l++) {
            c[l] = (qs[l] >> (4 * (sub & 1))) & 0x0F;
            if (type == Q5_K) c[l] |= ((k5->qh[l] >> sub) & 1) << 4;
        }
        *a0 = *a1 = d * (float)sc;
        *off = -(dmin * (float)m);
        return;
    }
    case Q6_K: {
        const block_q6_K *q = b;
        const float d = half_to_float(q->d);
        const int half = sub / 4, chunk = sub % 4;
        const uint8_t *ql = q->ql + 64 * half + (chunk & 1) * 32, *qh = q->qh + 32 * half;
        const int8_t *sc = q->scales + 8 * half + 2 * chunk;
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

#endif /* LLMT_BLOCKS_H */
