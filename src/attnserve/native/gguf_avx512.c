/* GGUF Q4_0 / Q4_1 / Q8_0 weights multiplied with AVX-512 (F, BW, VL, VNNI), from a tiled copy
 * of the file's blocks: chosen at run time where the CPU has them (gguf_cpu.py), else gguf_cpu.c.
 *
 * The weight's rows go in tiles of 16 (the last one padded with zero rows), and a tile holds
 * block g of its 16 rows together, so that one vector holds two codes of each of 16 rows:
 * `codes` [T, G, units, 16, 2] bytes, where a block's units are its 2-byte pairs in order (Q4:
 * 8, bytes 2u and 2u + 1: codes 2u, 2u + 1 in the low nibbles, 2u + 16, 2u + 17 in the high;
 * Q8_0: 16, codes 2u and 2u + 1); `d` and `c` [T, G, 16] float16 (c: Q4_1's m only).
 *
 * `gguf_mm` multiplies the activation rows rounded as gguf_cpu.c rounds them (gguf_rows.h),
 * with the same integer and float sums in the same order, so its results are bit-identical to
 * gguf_cpu.c's: a unit's 32 int16 words (lane i: row i's two codes) times the activation's two
 * matching int16 codes broadcast to every lane, summed by `vpdpwssd` (exact int32, no
 * saturation) over the block's units, gives the 16 rows' integer block sums x_g . q_g in one
 * vector, with no horizontal sum (Q4's high nibbles are kept as 16 q, their sum shifted back;
 * Q4_0's - 8 is - 8 times the sum of the activation's codes). Those are scaled by d s (plus
 * Q4_1's m sum(x_g)) into eight accumulators per activation row, block g into g mod 8, added
 * at the end as gguf_cpu.c's horizontal sum adds its eight lanes. A tile's block is decoded once
 * for every activation row (up to ROW_GROUP of them: more make more passes), and each row's sums
 * are the same whatever the number of rows, so a row's result does not depend on M.
 * `gguf_dequantize` writes float32 rows, rounded as gguf.quants.dequantize rounds them.
 * Both split their work into chunks for `threads` threads of the shared pool (native_pool.h).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "gguf_rows.h"
#include "native_pool.h"

#define TILE 16      /* weight rows a tile, one a lane */
#define ROW_GROUP 16 /* activation rows that share one decoding of a tile's block */

typedef struct {
    int type;
    const uint8_t *codes;  /* [T, G, TILE * code bytes] */
    const uint16_t *d, *c; /* [T, G, TILE] float16 */
    int64_t rows, groups;  /* N (rows past it, in the last tile, are never written), G */
} Tiled;

/* Whether this CPU runs the kernels (AVX512F, BW, VL and VNNI). */
int gguf_avx512_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* A tile's block decoded: word vector k pairs with the activation's codes 2k and 2k + 1 (Q4:
 * k < 8, the low nibbles; k >= 8, 16 times the high ones). */
static inline void tile_words(int type, const uint8_t *at, __m512i words[16]) {
    if (type == Q8_0) {
        for (int k = 0; k < 16; k++)
            words[k] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(at + 32 * k)));
        return;
    }
    for (int k = 0; k < 8; k++) {
        const __m512i bytes =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(at + 32 * k)));
        words[k] = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
        words[8 + k] = _mm512_and_si512(bytes, _mm512_set1_epi16(0xF0));
    }
}

static inline __m512i pair(const int16_t *x) {
    int32_t bits;
    memcpy(&bits, x, sizeof bits);
    return _mm512_set1_epi32(bits);
}

/* The 16 rows' integer sums x_g . q'_g of one block, `x` its 32 activation codes and `total`
 * their sum. Four chains of products (|sum| < 2^31: |q| <= 240, |x| <= 32767). */
static inline __m512i block_sums(int type, const __m512i words[16], const int16_t *x,
                                 int32_t total) {
    __m512i low[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    __m512i high[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int k = 0; k < 8; k++) {
        low[k & 1] = _mm512_dpwssd_epi32(low[k & 1], words[k], pair(x + 2 * k));
        high[k & 1] = _mm512_dpwssd_epi32(high[k & 1], words[8 + k], pair(x + 16 + 2 * k));
    }
    const __m512i lows = _mm512_add_epi32(low[0], low[1]);
    const __m512i highs = _mm512_add_epi32(high[0], high[1]);
    if (type == Q8_0) return _mm512_add_epi32(lows, highs);
    const __m512i sums = _mm512_add_epi32(lows, _mm512_srai_epi32(highs, 4));
    return type == Q4_0 ? _mm512_sub_epi32(sums, _mm512_set1_epi32(8 * total)) : sums;
}

/* Tile t's 16 rows . activation rows m0..m0+rows-1 (rows <= ROW_GROUP), into `out` [M, N]. */
static inline __attribute__((always_inline)) void tile_dots(int type, const Tiled *w, int64_t t,
                                                            const Rows *x, int64_t m0, int rows,
                                                            float *out) {
    const int64_t G = w->groups, padded = PAD(G), bytes = TILE * code_bytes(type);
    __m512 acc[ROW_GROUP][8];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 8; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int64_t at = t * G + g;
        __m512i words[16];
        tile_words(type, w->codes + at * bytes, words);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->d + at * TILE)));
        const __m512 c = type == Q4_1
                             ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->c + at * TILE)))
                             : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const int64_t m = m0 + r, b = m * padded + g;
            const __m512i sums = block_sums(type, words, x->codes + (m * G + g) * BLOCK, x->total[b]);
            const __m512 scales = _mm512_mul_ps(d, _mm512_set1_ps(x->scale[b]));
            __m512 a = _mm512_fmadd_ps(scales, _mm512_cvtepi32_ps(sums), acc[r][g & 7]);
            if (type == Q4_1) a = _mm512_fmadd_ps(c, _mm512_set1_ps(x->sum[b]), a);
            acc[r][g & 7] = a;
        }
    }
    const int64_t n0 = t * TILE, live = w->rows - n0 < TILE ? w->rows - n0 : TILE;
    const __mmask16 mask = (__mmask16)((1u << live) - 1);
    for (int r = 0; r < rows; r++) {
        const __m512 *a = acc[r]; /* gguf_cpu.c's hsum of lanes 0..7 */
        const __m512 even = _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6]));
        const __m512 odd = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
        _mm512_mask_storeu_ps(out + (m0 + r) * w->rows + n0, mask, _mm512_add_ps(even, odd));
    }
}

static inline __attribute__((always_inline)) void typed_tile(int type, const Tiled *w, int64_t t,
                                                             const Rows *x, int64_t M,
                                                             float *out) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_GROUP)
        tile_dots(type, w, t, x, m0, M - m0 < ROW_GROUP ? (int)(M - m0) : ROW_GROUP, out);
}

typedef struct {
    Tiled w;
    Rows rows;
    int64_t M;
    float *out;
} Product;

static void product_tiles(const void *job, int64_t first, int64_t end) {
    const Product *p = job;
    for (int64_t t = first; t < end; t++) switch (p->w.type) { /* the compiler specialises each */
            case Q4_0: typed_tile(Q4_0, &p->w, t, &p->rows, p->M, p->out); break;
            case Q4_1: typed_tile(Q4_1, &p->w, t, &p->rows, p->M, p->out); break;
            default: typed_tile(Q8_0, &p->w, t, &p->rows, p->M, p->out);
        }
}

/* out [M, N] = x [M, K] times the weight [N, K] transposed, on `threads` threads. Returns 0,
 * or -1 for a bad type or K, or no memory. */
int gguf_mm(int type, const uint8_t *codes, const uint16_t *d, const uint16_t *c, int64_t N,
               int64_t K, const float *x, int64_t M, float *out, int threads) {
    if (type < Q4_0 || type > Q8_0 || K % BLOCK) return -1;
    Product p = {{type, codes, d, c, N, K / BLOCK}, {NULL, NULL, NULL, NULL}, M, out};
    if (round_rows(x, M, K, &p.rows) != 0) return -1;
    pool_run(threads, (N + TILE - 1) / TILE, chunk_rows(K, M, TILE) / TILE, product_tiles, &p);
    free_rows(&p.rows);
    return 0;
}

typedef struct {
    Tiled w;
    int64_t first;
    const int64_t *row_ids;
    float *out;
} Dequantization;

/* Row n's block g as the file stores it (Q4: 16 bytes; Q8_0: 32), into `raw`: its 2-byte units
 * gathered from the tile, 32 bytes apart (each read as the aligned 4 bytes holding it). */
static inline void gather_block(int type, const Tiled *w, int64_t n, int64_t g, uint8_t *raw) {
    const int lane = (int)(n % TILE);
    const uint8_t *at = w->codes + ((n / TILE) * w->groups + g) * TILE * code_bytes(type);
    const __m512i offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(2 * TILE));
    const __mmask16 units_here = type == Q8_0 ? 0xFFFF : 0x00FF; /* none past the block */
    __m512i units = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), units_here, offsets,
                                                at + 2 * (lane & ~1), 1);
    if (lane & 1) units = _mm512_srli_epi32(units, 16);
    if (type == Q8_0)
        _mm256_storeu_si256((__m256i *)raw, _mm512_cvtepi32_epi16(units));
    else
        _mm_storeu_si128((__m128i *)raw, _mm256_cvtepi32_epi16(_mm512_castsi512_si256(units)));
}

static void dequantize_rows(const void *job, int64_t first, int64_t end) {
    const Dequantization *dq = job;
    const Tiled *w = &dq->w;
    const int type = w->type;
    const int64_t G = w->groups, K = G * BLOCK;
    for (int64_t i = first; i < end; i++) {
        const int64_t n = dq->row_ids == NULL ? dq->first + i : dq->row_ids[i];
        for (int64_t g = 0; g < G; g++) {
            uint8_t raw[BLOCK];
            gather_block(type, w, n, g, raw);
            const int64_t at = ((n / TILE) * G + g) * TILE + n % TILE;
            const __m512 scale = _mm512_set1_ps(_cvtsh_ss(w->d[at]));
            const __m512 low = _mm512_set1_ps(type == Q4_1 ? _cvtsh_ss(w->c[at]) : 0.0f);
            __m512i q[2];
            if (type == Q8_0) {
                q[0] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)raw));
                q[1] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(raw + 16)));
            } else {
                const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)raw));
                q[0] = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F));
                q[1] = _mm512_srli_epi32(bytes, 4);
            }
            for (int h = 0; h < 2; h++) {
                if (type == Q4_0) q[h] = _mm512_sub_epi32(q[h], _mm512_set1_epi32(8));
                /* the reference's rounding: d * (q - 8), d * q + m, d * q */
                const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(q[h]), scale);
                _mm512_storeu_ps(dq->out + i * K + g * BLOCK + 16 * h, _mm512_add_ps(v, low));
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
