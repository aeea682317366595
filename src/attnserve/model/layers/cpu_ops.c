/* The model's small float32 ops on the CPU, one call each instead of a chain of torch kernels:
 * RMSNorm (optionally after adding the residual), NeoX rotary embedding of q and k, and
 * SiLU-and-mul. Each computes what the plain-torch layer computes, in float32, up to the order
 * of a row's sum of squares. Rows are split over OpenMP threads (torch's runtime: see
 * attnserve.native). Row arguments have unit inner stride; `*_stride` is in floats.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* out = weight * x * 1/sqrt(mean(x^2) + eps), per row of n; with `residual` (not NULL), x is
 * first replaced by x + residual, which is also written to `summed`. */
void rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
              const float *weight, float eps, int64_t rows, int64_t n, float *out,
              float *summed) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
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
 * [positions, size]: cos then sin, size / 2 each. */
void rotary_embedding(const int64_t *positions, int64_t tokens, const float *q, int64_t q_stride,
                      int64_t q_heads, const float *k, int64_t k_stride, int64_t k_heads,
                      int64_t size, const float *cos_sin, float *q_out, float *k_out) {
#pragma omp parallel for schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cos = cos_sin + positions[t] * size, *sin = cos + size / 2;
        rotate(q + t * q_stride, q_out + t * q_heads * size, q_heads, size, cos, sin);
        rotate(k + t * k_stride, k_out + t * k_heads * size, k_heads, size, cos, sin);
    }
}

/* out [rows, inter] = silu(gate) * up, x = [gate | up] rows `x_stride` apart. */
void silu_and_mul(const float *x, int64_t x_stride, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
