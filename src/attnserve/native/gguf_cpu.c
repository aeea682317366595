/* GGUF Q4_0 / Q4_1 / Q8_0 weights multiplied on x86-64 with AVX2, from a repacked copy of the
 * file's blocks: the same bytes, split by kind so that eight blocks' scales load at once.
 *
 * A weight row of K = 32 G inputs is, for block g: `codes` (Q4: 16 bytes, code j in the low
 * nibble of byte j and code j + 16 in the high one; Q8_0: 32 int8), `d[g]` and `c[g]` (float16;
 * these rows are padded with zeros to whole eights of blocks).
 * A weight is d (q - 8) (Q4_0), d q + m (Q4_1) or d q (Q8_0), so
 *   x . w = sum_g  d_g (x_g . q'_g)  +  c_g sum(x_g),
 * with q' = q - 8 (Q4_0) or q, and c = m (Q4_1) or 0 (c unused).
 *
 * `gguf_mm` rounds each 32-block of an activation row to int16 codes with its own scale s (s =
 * max|x| / 32767: a relative rounding of 1.5e-5 of the block's largest value, where llama.cpp's
 * int8 blocks round to 4e-3) and computes x_g . q_g as s (xq_g . q_g) in integers (madd_epi16),
 * the sums sum(x_g) in float32 from x itself (the rounding is gguf_rows.h's, which the AVX-512
 * kernels of gguf_avx512.c share: they compute the same sums in the same order). Eight blocks' integer sums are reduced together
 * (hadd), converted and scaled by one vector of their d s, so the float work is per eight blocks.
 * With three or more activation rows, a Q4 weight row's codes are decoded once per eight blocks
 * for four rows at a time (Q8_0's codes and two rows are cheaper to decode again than to keep);
 * every row's sums run in the same order either way, so a row's result does not depend on M.
 * `gguf_dequantize` writes float32 rows, rounded as gguf.quants.dequantize rounds them.
 * Both split the weight rows into chunks for `threads` threads of the shared pool
 * (native_pool.h), which degrades gracefully where another process takes a core.
 */
#include <immintrin.h>
#include <stdint.h>

#include "gguf_rows.h"
#include "native_pool.h"

typedef struct {
    int type;
    const uint8_t *codes;  /* [N, G * code bytes] */
    const uint16_t *d, *c; /* [N, PAD(G)] float16, zero past G (c: Q4_1 only) */
    int64_t rows, groups;
} Weight;

static inline float half(uint16_t bits) { return _cvtsh_ss(bits); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 codes of a block as int16 in element order, [0..15] and [16..31]. A Q4 byte j holds
 * code j (low nibble) and code j + 16 (high): widened to a word, they are w & 15 and w >> 4. */
static inline void code_words(int type, const uint8_t *codes, __m256i words[2]) {
    if (type == Q8_0) {
        words[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)codes));
        words[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16)));
        return;
    }
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)codes));
    words[0] = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    words[1] = _mm256_srli_epi16(bytes, 4);
    if (type == Q4_0) { /* q - 8 in integers: no c term to cancel against in float */
        words[0] = _mm256_sub_epi16(words[0], _mm256_set1_epi16(8));
        words[1] = _mm256_sub_epi16(words[1], _mm256_set1_epi16(8));
    }
}

/* Eight int32 partial sums of a block's 32 code x activation products (|q| <= 128, |x| <=
 * 32767: the block's total stays below 2^31), from its decoded code words. */
static inline __m256i word_products(const __m256i words[2], const int16_t *x) {
    const __m256i low = _mm256_madd_epi16(words[0], _mm256_loadu_si256((const __m256i *)x));
    const __m256i high =
        _mm256_madd_epi16(words[1], _mm256_loadu_si256((const __m256i *)(x + 16)));
    return _mm256_add_epi32(low, high);
}

static inline __m256i block_products(int type, const uint8_t *codes, const int16_t *x) {
    __m256i words[2];
    code_words(type, codes, words);
    return word_products(words, x);
}

/* The totals of eight blocks' partial sums, block i in lane i. */
static inline __m256i eight_totals(const __m256i p[8]) {
    const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]),
                                          _mm256_hadd_epi32(p[2], p[3]));
    const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]),
                                           _mm256_hadd_epi32(p[6], p[7]));
    /* each 128-bit half holds half of every block's sum: add the halves across */
    return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                            _mm256_permute2x128_si256(low, high, 0x31));
}

/* acc plus eight blocks' totals (`p`, block i in lane i) scaled by their d (`d8`) times the
 * activation scales at `scale`, plus, for Q4_1, their m (`c8`) times the sums at `sum`. */
static inline __m256 add_scaled(int type, __m256 acc, const __m256i p[8], __m256 d8, __m256 c8,
                                const float *scale, const float *sum) {
    const __m256 scales = _mm256_mul_ps(d8, _mm256_loadu_ps(scale));
    acc = _mm256_fmadd_ps(scales, _mm256_cvtepi32_ps(eight_totals(p)), acc);
    return type == Q4_1 ? _mm256_fmadd_ps(c8, _mm256_loadu_ps(sum), acc) : acc;
}

static inline __m256 half8(const uint16_t *bits) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)bits));
}

/* Weight row n . activation row m, eight blocks at a time (the last eight padded with zero
 * sums and zero scales). */
static inline __attribute__((always_inline)) float row_dot(int type, const Weight *w,
                                                           int64_t n, const Rows *x, int64_t m) {
    const int64_t G = w->groups, padded = PAD(G), bytes = code_bytes(type);
    const uint8_t *codes = w->codes + n * G * bytes;
    const uint16_t *d = w->d + n * padded, *c = w->c + n * padded;
    const int16_t *xq = x->codes + m * G * BLOCK;
    const float *scale = x->scale + m * padded, *sum = x->sum + m * padded;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g += 8) {
        __m256i p[8];
        if (g + 8 <= G) {
            for (int i = 0; i < 8; i++)
                p[i] = block_products(type, codes + (g + i) * bytes, xq + (g + i) * BLOCK);
        } else {
            for (int i = 0; i < 8; i++) p[i] = _mm256_setzero_si256();
            for (int64_t i = 0; i < G - g; i++)
                p[i] = block_products(type, codes + (g + i) * bytes, xq + (g + i) * BLOCK);
        }
        const __m256 c8 = type == Q4_1 ? half8(c + g) : _mm256_setzero_ps();
        acc = add_scaled(type, acc, p, half8(d + g), c8, scale + g, sum + g);
    }
    return hsum(acc);
}

#define ROW_TILE 4 /* activation rows that share one decoding of a weight row's codes */

/* Weight row n . activation rows m0..m0+rows-1 (rows <= ROW_TILE): each eight blocks' codes are
 * decoded once (16 vectors, kept in L1) and dotted with every row, so a verify step's few rows
 * cost less than that many single-row products. */
static inline __attribute__((always_inline)) void tile_dots(int type, const Weight *w, int64_t n,
                                                            const Rows *x, int64_t m0, int rows,
                                                            float *out) {
    const int64_t G = w->groups, padded = PAD(G), bytes = code_bytes(type);
    const uint8_t *codes = w->codes + n * G * bytes;
    const uint16_t *d = w->d + n * padded, *c = w->c + n * padded;
    __m256 acc[ROW_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g += 8) {
        const int64_t blocks = G - g < 8 ? G - g : 8;
        __m256i words[16];
        for (int64_t i = 0; i < blocks; i++)
            code_words(type, codes + (g + i) * bytes, words + 2 * i);
        const __m256 d8 = half8(d + g), c8 = type == Q4_1 ? half8(c + g) : _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const int64_t m = m0 + r;
            const int16_t *xq = x->codes + (m * G + g) * BLOCK;
            __m256i p[8];
            for (int i = 0; i < 8; i++)
                p[i] = i < blocks ? word_products(words + 2 * i, xq + i * BLOCK)
                                  : _mm256_setzero_si256();
            acc[r] = add_scaled(type, acc[r], p, d8, c8, x->scale + m * padded + g,
                                x->sum + m * padded + g);
        }
    }
    for (int r = 0; r < rows; r++) out[(m0 + r) * w->rows] = hsum(acc[r]);
}

static inline __attribute__((always_inline)) void typed_rows_times_row(int type, const Weight *w,
                                                                       int64_t n, const Rows *x,
                                                                       int64_t M, float *out) {
    if (type == Q8_0 || M < 3) { /* decoding Q8_0 codes (or for two rows) is cheaper than a copy */
        for (int64_t m = 0; m < M; m++) out[m * w->rows] = row_dot(type, w, n, x, m);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE)
        tile_dots(type, w, n, x, m0, M - m0 < ROW_TILE ? (int)(M - m0) : ROW_TILE, out);
}

static void rows_times_row(const Weight *w, int64_t n, const Rows *x, int64_t M, float *out) {
    /* a constant type in each call: the compiler specialises the products */
    switch (w->type) {
        case Q4_0: typed_rows_times_row(Q4_0, w, n, x, M, out); break;
        case Q4_1: typed_rows_times_row(Q4_1, w, n, x, M, out); break;
        default: typed_rows_times_row(Q8_0, w, n, x, M, out);
    }
}

typedef struct {
    Weight w;
    Rows rows;
    int64_t M;
    float *out;
} Product;

static void product_rows(const void *job, int64_t first, int64_t end) {
    const Product *p = job;
    for (int64_t n = first; n < end; n++) rows_times_row(&p->w, n, &p->rows, p->M, p->out + n);
}

/* out [M, N] = x [M, K] times the weight [N, K] transposed, on `threads` threads. Returns 0,
 * or -1 for a bad type or K, or no memory. */
int gguf_mm(int type, const uint8_t *codes, const uint16_t *d, const uint16_t *c, int64_t N,
            int64_t K, const float *x, int64_t M, float *out, int threads) {
    if (type < Q4_0 || type > Q8_0 || K % BLOCK) return -1;
    Product p = {{type, codes, d, c, N, K / BLOCK}, {NULL, NULL, NULL, NULL}, M, out};
    if (round_rows(x, M, K, &p.rows) != 0) return -1;
    pool_run(threads, N, chunk_rows(K, M, 4), product_rows, &p);
    free_rows(&p.rows);
    return 0;
}

typedef struct {
    Weight w;
    int64_t first;
    const int64_t *row_ids;
    float *out;
} Dequantization;

static void dequantize_rows(const void *job, int64_t first, int64_t end) {
    const Dequantization *dq = job;
    const int type = dq->w.type;
    const uint8_t *codes = dq->w.codes;
    const uint16_t *d = dq->w.d, *c = dq->w.c;
    const int64_t G = dq->w.groups, K = G * BLOCK, padded = PAD(G), bytes = code_bytes(type);
    float *out = dq->out;
    for (int64_t i = first; i < end; i++) {
        const int64_t n = dq->row_ids == NULL ? dq->first + i : dq->row_ids[i];
        for (int64_t g = 0; g < G; g++) {
            __m256i words[2];
            code_words(type, codes + (n * G + g) * bytes, words);
            const __m256 scale = _mm256_set1_ps(half(d[n * padded + g]));
            const __m256 low = _mm256_set1_ps(type == Q4_1 ? half(c[n * padded + g]) : 0.0f);
            float *dst = out + i * K + g * BLOCK;
            for (int h = 0; h < 2; h++) {
                const __m128i lanes[2] = {_mm256_castsi256_si128(words[h]),
                                          _mm256_extracti128_si256(words[h], 1)};
                for (int j = 0; j < 2; j++) {
                    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(lanes[j]));
                    /* the reference's rounding: d * (q - 8), d * q + m, d * q */
                    const __m256 v = _mm256_mul_ps(q, scale);
                    _mm256_storeu_ps(dst + 16 * h + 8 * j, _mm256_add_ps(v, low));
                }
            }
        }
    }
}

/* out [R, K] = float32 rows `row_ids[i]` (or rows first..first+R-1 without ids) of the weight
 * [N, K], on `threads` threads. Returns 0, -1 for a bad type or K, or -2 for a row outside
 * 0..N-1. */
int gguf_dequantize(int type, const uint8_t *codes, const uint16_t *d, const uint16_t *c,
                    int64_t N, int64_t K, int64_t first, const int64_t *row_ids, int64_t R,
                    float *out, int threads) {
    if (type < Q4_0 || type > Q8_0 || K % BLOCK) return -1;
    if (!rows_inside(N, first, row_ids, R)) return -2;
    const Dequantization job = {{type, codes, d, c, N, K / BLOCK}, first, row_ids, out};
    pool_run(threads, R, chunk_rows(K, 1, 4), dequantize_rows, &job);
    return 0;
}
