/* What the GGUF kernels (gguf_cpu.c: AVX2, gguf_avx512.c: AVX-512 VNNI) share: the block types,
 * the activation rows rounded per block, and the size of a chunk of pool work. Both round the
 * activations here, so that they multiply the same integer codes.
 *
 * Each 32-block of an activation row becomes int16 codes with its own scale s = max|x| / 32767,
 * its float32 sum of x itself and the integer sum of its codes (for Q4_0's - 8). */
#ifndef ATTNSERVE_GGUF_ROWS_H
#define ATTNSERVE_GGUF_ROWS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_packed.h"

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
#define BLOCK 32

#define PAD(g) (((g) + 7) / 8 * 8) /* per-row length of the block arrays: whole eights */

static inline int code_bytes(int type) { return type == Q8_0 ? BLOCK : BLOCK / 2; }

/* Activation rows rounded per block. */
typedef struct {
    int16_t *codes; /* [M, K] */
    float *scale;   /* [M, PAD(G)], zero past G */
    float *sum;     /* [M, PAD(G)], of x itself, zero past G */
    int32_t *total; /* [M, PAD(G)], of the codes, zero past G */
} Rows;

static void free_rows(Rows *r) {
    free(r->codes);
    free(r->scale);
    free(r->sum);
    free(r->total);
}

/* Returns 0 (free_rows frees `r` after use), or -1 for no memory (`r` freed already). */
static int round_rows(const float *x, int64_t M, int64_t K, Rows *r) {
    const int64_t G = K / BLOCK, padded = PAD(G);
    r->codes = malloc(sizeof(int16_t) * M * K);
    r->scale = calloc((size_t)(M * padded), sizeof(float));
    r->sum = calloc((size_t)(M * padded), sizeof(float));
    r->total = calloc((size_t)(M * padded), sizeof(int32_t));
    if (r->codes == NULL || r->scale == NULL || r->sum == NULL || r->total == NULL) {
        free_rows(r);
        return -1;
    }
    for (int64_t b = 0; b < M * G; b++) {
        const float *xb = x + b * BLOCK;
        const int64_t at = b / G * padded + b % G;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < BLOCK; j++) {
            const float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
            sum += xb[j];
        }
        const float scale = amax / 32767.0f;
        const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        int32_t total = 0;
        for (int j = 0; j < BLOCK; j++) {
            r->codes[b * BLOCK + j] = (int16_t)lrintf(xb[j] * inverse);
            total += r->codes[b * BLOCK + j];
        }
        r->scale[at] = scale;
        r->sum[at] = sum;
        r->total[at] = total;
    }
    return 0;
}

/* Whether rows `row_ids[0..R-1]` (or first..first+R-1 without ids) are all in 0..N-1. */
static inline int rows_inside(int64_t N, int64_t first, const int64_t *row_ids, int64_t R) {
    if (row_ids == NULL) return first >= 0 && first + R <= N;
    for (int64_t i = 0; i < R; i++)
        if (row_ids[i] < 0 || row_ids[i] >= N) return 0;
    return 1;
}

#define CHUNK_PRODUCTS 32768 /* weights x activation rows per chunk of pool work, about */

/* Weight rows per chunk of pool work for M activation rows, at least `least`. */
static inline int64_t chunk_rows(int64_t K, int64_t M, int64_t least) {
    const int64_t rows = CHUNK_PRODUCTS / (K * M);
    return rows < least ? least : rows;
}

/* The entry points each GGUF library defines (see gguf_cpu.c), and their packed forms. */
int gguf_mm(int type, const uint8_t *codes, const uint16_t *d, const uint16_t *c, int64_t N,
            int64_t K, const float *x, int64_t M, float *out, int threads);
int gguf_dequantize(int type, const uint8_t *codes, const uint16_t *d, const uint16_t *c,
                    int64_t N, int64_t K, int64_t first, const int64_t *row_ids, int64_t R,
                    float *out, int threads);

int gguf_mm_packed(const int64_t *a) {
    return gguf_mm((int)a[0], SLOT_PTR(const uint8_t, a[1]), SLOT_PTR(const uint16_t, a[2]),
                   SLOT_PTR(const uint16_t, a[3]), a[4], a[5], SLOT_PTR(const float, a[6]), a[7],
                   SLOT_PTR(float, a[8]), (int)a[9]);
}

int gguf_dequantize_packed(const int64_t *a) {
    return gguf_dequantize((int)a[0], SLOT_PTR(const uint8_t, a[1]), SLOT_PTR(const uint16_t, a[2]),
                           SLOT_PTR(const uint16_t, a[3]), a[4], a[5], a[6],
                           SLOT_PTR(const int64_t, a[7]), a[8], SLOT_PTR(float, a[9]), (int)a[10]);
}

#endif
