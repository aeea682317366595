/* The model's small float32 ops on the CPU, one call each instead of a chain of torch kernels:
 * RMSNorm (optionally after adding the residual), NeoX rotary embedding of q and k, and
 * SiLU-and-mul. Each computes what the plain-torch layer computes, in float32, up to the order
 * of a row's sum of squares (and SiLU's exp: native_math.h's, within 2 ulp). Rows are chunks
 * of work for `threads` threads of the shared pool (native_pool.h). Row arguments have unit
 * inner stride; `*_stride` is in floats.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "native_math.h"
#include "native_packed.h"
#include "native_pool.h"

#define ROW_FLOATS 16384 /* floats of rows a chunk of pool work takes, about */

static int64_t chunk_rows(int64_t width) { return width >= ROW_FLOATS ? 1 : ROW_FLOATS / width; }

/* out = weight * x * 1/sqrt(mean(x^2) + eps), per row of n; with `residual` (not NULL), x is
 * first replaced by x + residual, which is also written to `summed`. x's rows come in groups of
 * `group` consecutive rows of n (a token's heads, Qwen3's q/k norm), groups x_stride apart
 * (group 1: rows x_stride apart); residual and the outputs are rows as usual. */
typedef struct {
    const float *x, *residual, *weight;
    int64_t x_stride, group, residual_stride, n;
    float eps;
    float *out, *summed;
} Norm;

static void norm_rows(const void *job, int64_t first, int64_t end) {
    const Norm *j = job;
    const float *x = j->x, *residual = j->residual, *weight = j->weight;
    const int64_t x_stride = j->x_stride, residual_stride = j->residual_stride, n = j->n;
    const float eps = j->eps;
    float *out = j->out, *summed = j->summed;
    for (int64_t r = first; r < end; r++) {
        const float *xr = x + r / j->group * x_stride + r % j->group * n;
        float *o = out + r * n;
        float squares = 0.0f;
        if (residual != NULL) {
            const float *res = residual + r * residual_stride;
            float *sum = summed + r * n;
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < n; i++) {
                sum[i] = xr[i] + res[i];
                squares += sum[i] * sum[i];
            }
            xr = sum;
        } else {
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < n; i++) squares += xr[i] * xr[i];
        }
        const float inverse = 1.0f / sqrtf(squares / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = weight[i] * (xr[i] * inverse);
    }
}

void rms_norm(const float *x, int64_t x_stride, int64_t group, const float *residual,
              int64_t residual_stride, const float *weight, float eps, int64_t rows, int64_t n,
              float *out, float *summed, int threads) {
    const Norm job = {x, residual, weight, x_stride, group, residual_stride, n, eps, out, summed};
    pool_run(threads, rows, chunk_rows(n), norm_rows, &job);
}

/* Rotate `heads` heads of `size` (one token's, at src) by cos/sin [size / 2] into dst. */
static inline void rotate(const float *src, float *dst, int64_t heads, int64_t size,
                          const float *cos, const float *sin) {
    const int64_t half = size / 2;
    for (int64_t h = 0; h < heads; h++) {
        const float *a = src + h * size, *b = a + half;
        float *da = dst + h * size, *db = da + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            da[i] = a[i] * cos[i] - b[i] * sin[i];
            db[i] = b[i] * cos[i] + a[i] * sin[i];
        }
    }
}

/* "Rotate half" rotary embedding: q [T, qh * size] and k [T, kh * size] (rows q_stride /
 * k_stride apart) by their tokens' positions, into contiguous q_out / k_out; cos_sin
 * [positions, size]: cos then sin, size / 2 each. With v (not NULL), its rows [T, v_width]
 * (v_stride apart) are copied into contiguous v_out too. */
typedef struct {
    const int64_t *positions;
    const float *q, *k, *v, *cos_sin;
    int64_t q_stride, q_heads, k_stride, k_heads, v_stride, v_width, size;
    float *q_out, *k_out, *v_out;
} Rotary;

static void rotate_tokens(const void *job, int64_t first, int64_t end) {
    const Rotary *j = job;
    const int64_t size = j->size;
    for (int64_t t = first; t < end; t++) {
        const float *cos = j->cos_sin + j->positions[t] * size, *sin = cos + size / 2;
        rotate(j->q + t * j->q_stride, j->q_out + t * j->q_heads * size, j->q_heads, size, cos,
               sin);
        rotate(j->k + t * j->k_stride, j->k_out + t * j->k_heads * size, j->k_heads, size, cos,
               sin);
        if (j->v != NULL)
            memcpy(j->v_out + t * j->v_width, j->v + t * j->v_stride, sizeof(float) * j->v_width);
    }
}

void rotary_embedding(const int64_t *positions, int64_t tokens, const float *q, int64_t q_stride,
                      int64_t q_heads, const float *k, int64_t k_stride, int64_t k_heads,
                      const float *v, int64_t v_stride, int64_t v_width, int64_t size,
                      const float *cos_sin, float *q_out, float *k_out, float *v_out,
                      int threads) {
    const Rotary job = {positions, q,        k,       v,      cos_sin, q_stride, q_heads,
                        k_stride,  k_heads,  v_stride, v_width, size,   q_out,    k_out,
                        v_out};
    const int64_t width = (q_heads + k_heads) * size + (v != NULL ? v_width : 0);
    pool_run(threads, tokens, chunk_rows(width), rotate_tokens, &job);
}

typedef struct {
    const float *x;
    int64_t x_stride, inter;
    float *out;
} Gate;

static void gate_rows(const void *job, int64_t first, int64_t end) {
    const Gate *j = job;
    const int64_t inter = j->inter;
    for (int64_t r = first; r < end; r++) {
        const float *gate = j->x + r * j->x_stride, *up = gate + inter;
        float *o = j->out + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
        for (; i < inter; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* out [rows, inter] = silu(gate) * up, x = [gate | up] rows `x_stride` apart. */
void silu_and_mul(const float *x, int64_t x_stride, int64_t rows, int64_t inter, float *out,
                  int threads) {
    const Gate job = {x, x_stride, inter, out};
    pool_run(threads, rows, chunk_rows(inter), gate_rows, &job);
}

int rms_norm_packed(const int64_t *a) {
    rms_norm(SLOT_PTR(const float, a[0]), a[1], a[2], SLOT_PTR(const float, a[3]), a[4],
             SLOT_PTR(const float, a[5]), slot_float(a[6]), a[7], a[8], SLOT_PTR(float, a[9]),
             SLOT_PTR(float, a[10]), (int)a[11]);
    return 0;
}

int rotary_embedding_packed(const int64_t *a) {
    rotary_embedding(SLOT_PTR(const int64_t, a[0]), a[1], SLOT_PTR(const float, a[2]), a[3], a[4],
                     SLOT_PTR(const float, a[5]), a[6], a[7], SLOT_PTR(const float, a[8]), a[9],
                     a[10], a[11], SLOT_PTR(const float, a[12]), SLOT_PTR(float, a[13]),
                     SLOT_PTR(float, a[14]), SLOT_PTR(float, a[15]), (int)a[16]);
    return 0;
}

int silu_and_mul_packed(const int64_t *a) {
    silu_and_mul(SLOT_PTR(const float, a[0]), a[1], a[2], a[3], SLOT_PTR(float, a[4]), (int)a[5]);
    return 0;
}
