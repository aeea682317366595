/* GGUF Q4_0 / Q4_1 / Q8_0 weights multiplied as llama.cpp stores them, on x86-64 with AVX2.
 *
 * A weight row is K/32 blocks of the file's own layout: float16 d, [float16 m (Q4_1),] then the
 * codes (Q4: 16 bytes, code j in the low nibble of byte j and code j + 16 in its high nibble;
 * Q8_0: 32 int8). A weight is d * (q - 8) (Q4_0), d * q + m (Q4_1) or d * q (Q8_0), so
 *   x . w = sum_g  d_g * (x_g . q_g)  +  c_g * sum(x_g),   c_g = -8 d_g, m_g or 0.
 *
 * `gguf_mm` (few activation rows: decode steps) rounds each 32-block of an activation row to
 * int16 with its own scale s (s = max|x| / 32767: a relative rounding of 1.5e-5 of the block's
 * largest value, where llama.cpp's int8 blocks round to 4e-3) and computes x_g . q_g as
 * s * (xq_g . q_g) in integers (madd_epi16: 16 products an instruction), the block sums sum(x_g)
 * in float32 from x itself; tiles of up to 4 activation rows share each widened weight block.
 * `gguf_dequantize` writes rows of the float32 weight, rounded as the reference dequantizer
 * rounds them (for large batches, which multiply it with the BLAS, and for lookups).
 * Both split the weight rows over OpenMP threads: built with -fopenmp against libgomp.so.1,
 * they share torch's own OpenMP runtime.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
#define BLOCK 32
#define TILE 4

static int block_bytes(int type) { return type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34; }

static inline float half_at(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 codes of a block as float32, elements 0-7, 8-15, 16-23, 24-31. */
static inline void widen_codes(int type, const uint8_t *codes, __m256 w[4]) {
    if (type == Q8_0) {
        for (int i = 0; i < 4; i++) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(codes + 8 * i));
            w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        }
        return;
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)codes);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(packed, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
}

/* The 32 codes of a block as int16 in element order, [0..15] and [16..31]. */
static inline void code_words(int type, const uint8_t *codes, __m256i words[2]) {
    if (type == Q8_0) {
        words[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)codes));
        words[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16)));
        return;
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)codes);
    const __m128i mask = _mm_set1_epi8(0x0F);
    words[0] = _mm256_cvtepu8_epi16(_mm_and_si128(packed, mask));
    words[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
}

/* Eight float32 partial sums of 32 int16 products (each pair sum fits int32: |q| <= 128). */
static inline __m256 word_dot(const __m256i words[2], const int16_t *x) {
    const __m256i low = _mm256_madd_epi16(words[0], _mm256_loadu_si256((const __m256i *)x));
    const __m256i high =
        _mm256_madd_epi16(words[1], _mm256_loadu_si256((const __m256i *)(x + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(low, high));
}

/* c_g of the module comment: the factor of a block's activation sum. */
static inline float sum_factor(int type, const uint8_t *block, float d) {
    return type == Q4_0 ? -8.0f * d : type == Q4_1 ? half_at(block + 2) : 0.0f;
}

/* Activation rows, quantized per block (see the module comment). */
typedef struct {
    int16_t *codes; /* [M, K] */
    float *scale;   /* [M, K/32] */
    float *sum;     /* [M, K/32], of x itself */
} QuantizedRows;

static int quantize_rows(const float *x, int64_t M, int64_t K, QuantizedRows *q) {
    const int64_t blocks = M * (K / BLOCK);
    q->codes = malloc(sizeof(int16_t) * M * K);
    q->scale = malloc(sizeof(float) * blocks);
    q->sum = malloc(sizeof(float) * blocks);
    if (q->codes == NULL || q->scale == NULL || q->sum == NULL) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * BLOCK;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < BLOCK; j++) {
            const float a = xb[j] < 0 ? -xb[j] : xb[j];
            amax = a > amax ? a : amax;
            sum += xb[j];
        }
        const float scale = amax / 32767.0f;
        const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int j = 0; j < BLOCK; j++) q->codes[b * BLOCK + j] = (int16_t)lrintf(xb[j] * inverse);
        q->scale[b] = scale;
        q->sum[b] = sum;
    }
    return 0;
}

static void free_rows(QuantizedRows *q) {
    free(q->codes);
    free(q->scale);
    free(q->sum);
}

/* out[m * ldo] = activation row m . weight row, for the `rows` (1..TILE) rows of a tile. */
static inline __attribute__((always_inline)) void tile_dot(
    int type, const uint8_t *row, int64_t groups, const int16_t *xq, const float *xscale,
    const float *xsum, int rows, float *out, int64_t ldo) {
    const int bytes = block_bytes(type);
    const int code_offset = type == Q4_1 ? 4 : 2;
    const int64_t K = groups * BLOCK;
    __m256 acc[TILE];
    float offset[TILE];
    for (int m = 0; m < rows; m++) {
        acc[m] = _mm256_setzero_ps();
        offset[m] = 0.0f;
    }
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *block = row + g * bytes;
        const float d = half_at(block);
        const float c = sum_factor(type, block, d);
        __m256i words[2];
        code_words(type, block + code_offset, words);
        for (int m = 0; m < rows; m++) {
            const __m256 scale = _mm256_set1_ps(d * xscale[m * groups + g]);
            const __m256 dot = word_dot(words, xq + m * K + g * BLOCK);
            acc[m] = _mm256_fmadd_ps(scale, dot, acc[m]);
            if (type != Q8_0) offset[m] += c * xsum[m * groups + g];
        }
    }
    for (int m = 0; m < rows; m++) out[m * ldo] = hsum(acc[m]) + offset[m];
}

static void row_times_tiles(int type, const uint8_t *row, int64_t groups,
                            const QuantizedRows *x, int64_t M, float *out, int64_t N) {
    const int64_t K = groups * BLOCK;
    for (int64_t m0 = 0; m0 < M; m0 += TILE) {
        const int rows = M - m0 < TILE ? (int)(M - m0) : TILE;
        const int16_t *xt = x->codes + m0 * K;
        const float *st = x->scale + m0 * groups;
        const float *sum = x->sum + m0 * groups;
        float *ot = out + m0 * N;
        /* constant `type` and `rows` in each call: the compiler specialises the loops */
        switch (type * 8 + rows) {
#define CASE(T, R) \
    case T * 8 + R: tile_dot(T, row, groups, xt, st, sum, R, ot, N); break;
            CASE(Q4_0, 1) CASE(Q4_0, 2) CASE(Q4_0, 3) CASE(Q4_0, 4)
            CASE(Q4_1, 1) CASE(Q4_1, 2) CASE(Q4_1, 3) CASE(Q4_1, 4)
            CASE(Q8_0, 1) CASE(Q8_0, 2) CASE(Q8_0, 3) CASE(Q8_0, 4)
#undef CASE
        }
    }
}

/* out [M, N] = x [M, K] times the weight [N, K] (rows of `row_stride` bytes) transposed.
 * Returns 0, or -1 for a bad type or K, or no memory. */
int gguf_mm(int type, const float *x, int64_t M, int64_t K, const uint8_t *weight, int64_t N,
            int64_t row_stride, float *out) {
    if (type < Q4_0 || type > Q8_0 || K % BLOCK) return -1;
    QuantizedRows xq;
    if (quantize_rows(x, M, K, &xq) != 0) {
        free_rows(&xq);
        return -1;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        row_times_tiles(type, weight + n * row_stride, K / BLOCK, &xq, M, out + n, N);
    }
    free_rows(&xq);
    return 0;
}

/* out [N, K] = the float32 weight. Returns 0, or -1 for a bad type or K. */
int gguf_dequantize(int type, const uint8_t *weight, int64_t N, int64_t K, int64_t row_stride,
                    float *out) {
    if (type < Q4_0 || type > Q8_0 || K % BLOCK) return -1;
    const int64_t groups = K / BLOCK;
    const int bytes = block_bytes(type);
    const int code_offset = type == Q4_1 ? 4 : 2;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *block = weight + n * row_stride + g * bytes;
            const float d = half_at(block);
            const float m = type == Q4_1 ? half_at(block + 2) : 0.0f;
            const __m256 scale = _mm256_set1_ps(d);
            const __m256 shift = _mm256_set1_ps(type == Q4_0 ? -8.0f : 0.0f);
            const __m256 low = _mm256_set1_ps(m);
            __m256 w[4];
            widen_codes(type, block + code_offset, w);
            float *dst = out + n * K + g * BLOCK;
            for (int i = 0; i < 4; i++) {
                /* the reference's rounding: d * (q - 8), d * q + m, d * q */
                __m256 v = _mm256_mul_ps(_mm256_add_ps(w[i], shift), scale);
                _mm256_storeu_ps(dst + 8 * i, _mm256_add_ps(v, low));
            }
        }
    }
    return 0;
}
