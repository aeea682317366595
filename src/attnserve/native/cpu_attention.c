/* Paged attention of one layer on the CPU, float32, in one call: the step's new keys and values
 * go into their cache slots, then every new token t attends, per query head h, over the cached
 * positions p of its sequence with p <= pos_t (and pos_t - p < window when there is one):
 *   out[t, h] = sum_p softmax_p(s_p) v_p,  s_p = bias(cap(scale * q[t, h] . k_p), p - pos_t)
 * with cap(x) = c tanh(x / c) under a soft-cap c and bias(x, d) = x + slope_h d under ALiBi.
 * Keys and values are read in place through the block table (slot = table[seq][p / B] * B +
 * p % B), so nothing is gathered; the query heads sharing a KV head (h / (H / Hkv)) are done
 * together, up to four at a time in AVX2 registers, so each key and value is loaded once for
 * them. The (token, KV head) pairs are chunks of work for `threads` threads of the shared pool
 * (native_pool.h), each with its own score buffer; a token's KV heads are one chunk, so its
 * cache rows are read while they are in cache. exp is native_math.h's polynomial (2 ulp).
 *
 * Caches: [slots, Hkv, D] floats each. q, k, v: rows of H*D / Hkv*D floats, `*_stride` floats
 * apart (splits of a fused qkv row). out: [T, H*D], contiguous.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_math.h"
#include "native_packed.h"
#include "native_pool.h"

#define HEADS_AT_ONCE 4

typedef struct {
    const float *q, *k, *v;
    int64_t q_stride, k_stride, v_stride;
    float *k_cache, *v_cache;
    const int64_t *slot_mapping, *token_seq, *token_pos, *block_table;
    int64_t table_width, block_size, num_tokens, num_heads, num_kv_heads, head_size;
    float scale, soft_cap;
    int64_t window;     /* 0: none */
    const float *alibi; /* [H] slopes, or NULL */
    float *out;
    int64_t longest; /* keys of the longest row of scores */
    atomic_int failed;
} Step;

static void write_new_tokens(const Step *s) {
    const int64_t width = s->num_kv_heads * s->head_size;
    for (int64_t t = 0; t < s->num_tokens; t++) {
        const int64_t slot = s->slot_mapping[t];
        if (slot < 0) continue; /* padding */
        memcpy(s->k_cache + slot * width, s->k + t * s->k_stride, sizeof(float) * width);
        memcpy(s->v_cache + slot * width, s->v + t * s->v_stride, sizeof(float) * width);
    }
}

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* The cache slots of key positions first..first+keys-1 of a sequence (its block table row),
 * walked block by block. */
static void key_slots(const int64_t *table, int64_t block_size, int64_t first, int64_t keys,
                      int64_t *slots) {
    for (int64_t i = 0, p = first; i < keys;) {
        const int64_t base = table[p / block_size] * block_size;
        for (int64_t o = p % block_size; o < block_size && i < keys; o++, p++, i++)
            slots[i] = base + o;
    }
}

#define INLINE static inline __attribute__((always_inline))
#define AHEAD 8 /* keys ahead whose K and V rows are prefetched */

/* Asks for the cache lines of `floats` floats at `row` (a key's K or V of one KV head). */
INLINE void prefetch_row(const float *row, int64_t floats) {
    for (int64_t f = 0; f < floats; f += 16) _mm_prefetch((const char *)(row + f), _MM_HINT_T0);
}

/* scores[j][i] = scale * q_j . k_i (key i at slots[i]) for `heads` (<= 4, a constant where
 * it is inlined: the accumulators stay in registers) query heads q_j, D apart; two
 * accumulators a head, 16 floats a step. The K and V rows AHEAD keys on are prefetched (the
 * rows of a decode step's many sequences come from memory). */
INLINE void head_scores(const int64_t *slots, int64_t slot_width, const float *k_cache,
                        const float *v_cache, const float *q, const int heads, int64_t D,
                        int64_t keys, float scale, float *scores, int64_t score_stride) {
    const int64_t pair_end = D / 16 * 16, vector_end = D / 8 * 8;
    for (int64_t i = 0; i < keys; i++) {
        const float *k = k_cache + slots[i] * slot_width;
        if (i + AHEAD < keys) {
            prefetch_row(k_cache + slots[i + AHEAD] * slot_width, D);
            prefetch_row(v_cache + slots[i + AHEAD] * slot_width, D);
        }
        __m256 acc[HEADS_AT_ONCE][2];
        for (int j = 0; j < heads; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d < pair_end; d += 16) {
            const __m256 k0 = _mm256_loadu_ps(k + d), k1 = _mm256_loadu_ps(k + d + 8);
            for (int j = 0; j < heads; j++) {
                acc[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + d), k0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + d + 8), k1, acc[j][1]);
            }
        }
        for (; d < vector_end; d += 8) {
            const __m256 k0 = _mm256_loadu_ps(k + d);
            for (int j = 0; j < heads; j++)
                acc[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + d), k0, acc[j][0]);
        }
        for (int j = 0; j < heads; j++) {
            float dot = hsum(_mm256_add_ps(acc[j][0], acc[j][1]));
            for (int64_t e = vector_end; e < D; e++) dot += q[j * D + e] * k[e];
            scores[j * score_stride + i] = scale * dot;
        }
    }
}

/* A row of scores in place: soft-cap, ALiBi bias (`offset` = first - pos), softmax. */
static void softmax_row(float *row, int64_t keys, float soft_cap, float slope, int has_slope,
                        int64_t offset) {
    float best = -INFINITY;
    for (int64_t i = 0; i < keys; i++) {
        if (soft_cap > 0.0f) row[i] = soft_cap * tanhf(row[i] / soft_cap);
        if (has_slope) row[i] += slope * (float)(offset + i);
        best = row[i] > best ? row[i] : best;
    }
    const __m256 shift = _mm256_set1_ps(best);
    __m256 total8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= keys; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), shift));
        _mm256_storeu_ps(row + i, e);
        total8 = _mm256_add_ps(total8, e);
    }
    float total = hsum(total8);
    for (; i < keys; i++) {
        row[i] = expf(row[i] - best);
        total += row[i];
    }
    const float inverse = 1.0f / total;
    for (int64_t j = 0; j < keys; j++) row[j] *= inverse;
}

/* out_j = sum_i weights[j][i] v_i (at slots[i]) for `heads` (<= 4, a constant where it is
 * inlined) heads, out rows D apart; 16 floats of every head at a time. */
INLINE void weighted_values(const int64_t *slots, int64_t slot_width, const float *v_cache,
                            const float *weights, int64_t weight_stride, const int heads,
                            int64_t D, int64_t keys, float *out) {
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 acc[HEADS_AT_ONCE][2];
        for (int j = 0; j < heads; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < keys; i++) {
            const float *v = v_cache + slots[i] * slot_width + d;
            const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
            for (int j = 0; j < heads; j++) {
                const __m256 w = _mm256_broadcast_ss(weights + j * weight_stride + i);
                acc[j][0] = _mm256_fmadd_ps(w, v0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(w, v1, acc[j][1]);
            }
        }
        for (int j = 0; j < heads; j++) {
            _mm256_storeu_ps(out + j * D + d, acc[j][0]);
            _mm256_storeu_ps(out + j * D + d + 8, acc[j][1]);
        }
    }
    for (; d < D; d++)
        for (int j = 0; j < heads; j++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < keys; i++)
                acc += weights[j * weight_stride + i] * v_cache[slots[i] * slot_width + d];
            out[j * D + d] = acc;
        }
}

/* Scores, softmax and weighted values of `heads` query heads from h0 (token t's). */
INLINE void attend_heads(const Step *s, int64_t t, int64_t h0, const int heads,
                         const int64_t *slots, int64_t first, int64_t keys, float *scores) {
    const int64_t D = s->head_size, slot_width = s->num_kv_heads * D;
    const int64_t kv_offset = h0 / (s->num_heads / s->num_kv_heads) * D;
    head_scores(slots, slot_width, s->k_cache + kv_offset, s->v_cache + kv_offset,
                s->q + t * s->q_stride + h0 * D, heads, D, keys, s->scale, scores, keys);
    for (int j = 0; j < heads; j++)
        softmax_row(scores + j * keys, keys, s->soft_cap,
                    s->alibi != NULL ? s->alibi[h0 + j] : 0.0f, s->alibi != NULL,
                    first - s->token_pos[t]);
    weighted_values(slots, slot_width, s->v_cache + kv_offset, scores, keys, heads, D, keys,
                    s->out + (t * s->num_heads + h0) * D);
}

/* The query heads of KV head `kvh` of token t (`scores`: [4, keys] floats, `slots`: keys). */
static void attend_group(const Step *s, int64_t t, int64_t kvh, float *scores,
                         int64_t *slots) {
    const int64_t group = s->num_heads / s->num_kv_heads, pos = s->token_pos[t];
    const int64_t first = s->window > 0 && pos - s->window + 1 > 0 ? pos - s->window + 1 : 0;
    const int64_t keys = pos - first + 1;
    key_slots(s->block_table + s->token_seq[t] * s->table_width, s->block_size, first, keys,
              slots);
    for (int64_t j0 = 0; j0 < group; j0 += HEADS_AT_ONCE) {
        const int64_t h0 = kvh * group + j0;
        switch (group - j0 < HEADS_AT_ONCE ? group - j0 : HEADS_AT_ONCE) {
            case 1: attend_heads(s, t, h0, 1, slots, first, keys, scores); break;
            case 2: attend_heads(s, t, h0, 2, slots, first, keys, scores); break;
            case 3: attend_heads(s, t, h0, 3, slots, first, keys, scores); break;
            default: attend_heads(s, t, h0, 4, slots, first, keys, scores);
        }
    }
}

/* Pool chunk: the (token, KV head) pairs first..end-1, token-major. */
static void attend_pairs(const void *job, int64_t first, int64_t end) {
    const Step *s = job;
    float *scores = malloc(sizeof(float) * s->longest * HEADS_AT_ONCE);
    int64_t *slots = malloc(sizeof(int64_t) * s->longest);
    if (scores == NULL || slots == NULL)
        atomic_store((atomic_int *)&s->failed, 1);
    else
        for (int64_t pair = first; pair < end; pair++)
            attend_group(s, pair / s->num_kv_heads, pair % s->num_kv_heads, scores, slots);
    free(scores);
    free(slots);
}

/* Returns 0, or -1 when out of memory. */
int cpu_paged_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                        const float *v, int64_t v_stride, float *k_cache, float *v_cache,
                        const int64_t *slot_mapping, const int64_t *token_seq,
                        const int64_t *token_pos, const int64_t *block_table,
                        int64_t table_width, int64_t block_size, int64_t num_tokens,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_size, float scale,
                        int64_t window, float soft_cap, const float *alibi, float *out,
                        int threads) {
    int64_t longest = 1;
    for (int64_t t = 0; t < num_tokens; t++)
        longest = token_pos[t] + 1 > longest ? token_pos[t] + 1 : longest;
    Step s = {q, k, v, q_stride, k_stride, v_stride, k_cache, v_cache, slot_mapping,
              token_seq, token_pos, block_table, table_width, block_size, num_tokens,
              num_heads, num_kv_heads, head_size, scale, soft_cap, window, alibi, out,
              longest, 0};
    write_new_tokens(&s);
    /* a token's KV heads together where there are tokens enough for every thread */
    const int64_t chunk = num_tokens >= 4 * (int64_t)threads ? num_kv_heads : 1;
    pool_run(threads, num_tokens * num_kv_heads, chunk, attend_pairs, &s);
    return atomic_load(&s.failed) ? -1 : 0;
}

int cpu_paged_attention_packed(const int64_t *a) {
    return cpu_paged_attention(
        SLOT_PTR(const float, a[0]), a[1], SLOT_PTR(const float, a[2]), a[3],
        SLOT_PTR(const float, a[4]), a[5], SLOT_PTR(float, a[6]), SLOT_PTR(float, a[7]),
        SLOT_PTR(const int64_t, a[8]), SLOT_PTR(const int64_t, a[9]),
        SLOT_PTR(const int64_t, a[10]), SLOT_PTR(const int64_t, a[11]), a[12], a[13], a[14],
        a[15], a[16], a[17], slot_float(a[18]), a[19], slot_float(a[20]),
        SLOT_PTR(const float, a[21]), SLOT_PTR(float, a[22]), (int)a[23]);
}
