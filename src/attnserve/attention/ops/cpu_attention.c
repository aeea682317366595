/* Paged attention of one layer on the CPU, float32, in one call: the step's new keys and values
 * go into their cache slots, then every new token t attends, per query head h, over the cached
 * positions p of its sequence with p <= pos_t (and pos_t - p < window when there is one):
 *   out[t, h] = sum_p softmax_p(s_p) v_p,  s_p = bias(cap(scale * q[t, h] . k_p), p - pos_t)
 * with cap(x) = c tanh(x / c) under a soft-cap c and bias(x, d) = x + slope_h d under ALiBi.
 * Keys and values are read in place through the block table (slot = table[seq][p / B] * B +
 * p % B), so nothing is gathered; the query heads sharing a KV head (h / (H / Hkv)) are done
 * together, each key and value read once for them. The (token, KV head) pairs are split over
 * OpenMP threads, each with its own score buffer.
 *
 * Caches: [slots, Hkv, D] floats each. q, k, v: rows of H*D / Hkv*D floats, `*_stride` floats
 * apart (splits of a fused qkv row). out: [T, H*D], contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q, *k, *v;
    int64_t q_stride, k_stride, v_stride;
    float *k_cache, *v_cache;
    const int64_t *slot_mapping, *token_seq, *token_pos, *block_table;
    int64_t table_width, block_size, num_tokens, num_heads, num_kv_heads, head_size;
    float scale, soft_cap;
    int64_t window;       /* 0: none */
    const float *alibi;   /* [H] slopes, or NULL */
    float *out;
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

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* The query heads of KV head `kvh` (a group sharing it) of token t: each key and value is
 * read once for the group, block by block through the table. `scores` holds [group, keys]. */
static void attend_group(const Step *s, int64_t t, int64_t kvh, float *scores) {
    const int64_t D = s->head_size, group = s->num_heads / s->num_kv_heads;
    const int64_t slot_width = s->num_kv_heads * D, bs = s->block_size;
    const int64_t pos = s->token_pos[t];
    const int64_t *table = s->block_table + s->token_seq[t] * s->table_width;
    const int64_t first = s->window > 0 && pos - s->window + 1 > 0 ? pos - s->window + 1 : 0;
    const int64_t keys = pos - first + 1;
    const float *q = s->q + t * s->q_stride + kvh * group * D;
    for (int64_t p = first; p <= pos;) {
        const float *k = s->k_cache + (table[p / bs] * bs) * slot_width + kvh * D;
        for (int64_t o = p % bs; o < bs && p <= pos; o++, p++)
            for (int64_t j = 0; j < group; j++)
                scores[j * keys + p - first] = s->scale * dot(q + j * D, k + o * slot_width, D);
    }
    for (int64_t j = 0; j < group; j++) {
        float *row = scores + j * keys;
        const int64_t h = kvh * group + j;
        float best = -INFINITY;
        for (int64_t i = 0; i < keys; i++) {
            if (s->soft_cap > 0.0f) row[i] = s->soft_cap * tanhf(row[i] / s->soft_cap);
            if (s->alibi != NULL) row[i] += s->alibi[h] * (float)(first + i - pos);
            best = row[i] > best ? row[i] : best;
        }
        float total = 0.0f;
        for (int64_t i = 0; i < keys; i++) {
            row[i] = expf(row[i] - best);
            total += row[i];
        }
        const float inverse = 1.0f / total;
        for (int64_t i = 0; i < keys; i++) row[i] *= inverse;
        memset(s->out + (t * s->num_heads + h) * D, 0, sizeof(float) * D);
    }
    for (int64_t p = first; p <= pos;) {
        const float *v = s->v_cache + (table[p / bs] * bs) * slot_width + kvh * D;
        for (int64_t o = p % bs; o < bs && p <= pos; o++, p++)
            for (int64_t j = 0; j < group; j++) {
                float *out = s->out + (t * s->num_heads + kvh * group + j) * D;
                const float weight = scores[j * keys + p - first];
                const float *vo = v + o * slot_width;
#pragma omp simd
                for (int64_t i = 0; i < D; i++) out[i] += weight * vo[i];
            }
    }
}

/* Returns 0, or -1 when out of memory. */
int cpu_paged_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                        const float *v, int64_t v_stride, float *k_cache, float *v_cache,
                        const int64_t *slot_mapping, const int64_t *token_seq,
                        const int64_t *token_pos, const int64_t *block_table,
                        int64_t table_width, int64_t block_size, int64_t num_tokens,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_size, float scale,
                        int64_t window, float soft_cap, const float *alibi, float *out) {
    const Step s = {q, k, v, q_stride, k_stride, v_stride, k_cache, v_cache, slot_mapping,
                    token_seq, token_pos, block_table, table_width, block_size, num_tokens,
                    num_heads, num_kv_heads, head_size, scale, soft_cap, window, alibi, out};
    write_new_tokens(&s);
    int64_t longest = 1;
    for (int64_t t = 0; t < num_tokens; t++)
        longest = token_pos[t] + 1 > longest ? token_pos[t] + 1 : longest;
    const int64_t group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * longest * group);
        failed = scores == NULL;
#pragma omp for collapse(2) schedule(static)
        for (int64_t t = 0; t < num_tokens; t++)
            for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)
                if (scores != NULL) attend_group(&s, t, kvh, scores);
        free(scores);
    }
    return failed ? -1 : 0;
}
