/* Attention for a few new tokens per row over a slot KV cache, in one call: rotary on the new queries and
 * keys, the new keys and values written at their positions, then each query attends to its row's cache up to
 * and including its own position (the causal rule CachedLM's masks encode). torch spends a dozen ops per
 * layer on this (slices, rotary, scatter, SDPA, transposes: ~80 us at one token); here it is a few us.
 *   qkv        (n, q, heads + 2 kv_heads, d), as the fused QKV projection writes it
 *   cos, sin   (n, q, d); positions (n, q)
 *   keys, values  this layer's (slots, kv_heads, capacity, d) buffers; the rows are slots first .. first + n - 1
 *   out        (n, q, heads, d), as the output projection reads it */
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(16 * sizeof(float))));

static inline v16 load(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

/* transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin */
static void rotate(const float *x, const float *cos, const float *sin, long d, float *dst) {
    long half = d / 2;
    for (long i = 0; i < d; ++i) {
        float rotated = i < half ? -x[i + half] : x[i - half];
        dst[i] = x[i] * cos[i] + rotated * sin[i];
    }
}

static inline float dot(const float *a, const float *b, long d) {
    v16 acc = {0};
    long i = 0;
    for (; i + 16 <= d; i += 16) acc += load(a + i) * load(b + i);
    float sum = 0;
    for (int j = 0; j < 16; ++j) sum += acc[j];
    for (; i < d; ++i) sum += a[i] * b[i];
    return sum;
}

void decode_attention(const float *qkv, long n, long q, long heads, long kv_heads, long d, const float *cos,
                      const float *sin, const long *positions, float *keys, float *values, long capacity,
                      long first, float *out, int threads) {
    long width = (heads + 2 * kv_heads) * d, slot = kv_heads * capacity * d;
    for (long r = 0; r < n; ++r)
        for (long t = 0; t < q; ++t) {
            long token = r * q + t, at = positions[token];
            const float *row = qkv + token * width;
            for (long h = 0; h < kv_heads; ++h) {
                long offset = (first + r) * slot + (h * capacity + at) * d;
                rotate(row + (heads + h) * d, cos + token * d, sin + token * d, d, keys + offset);
                memcpy(values + offset, row + (heads + kv_heads + h) * d, d * sizeof(float));
            }
        }
    float scale = 1.0f / sqrtf((float)d);
    long group = heads / kv_heads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long task = 0; task < n * q * heads; ++task) {
        long token = task / heads, h = task % heads, r = token / q, visible = positions[token] + 1;
        float query[d], *o = out + (token * heads + h) * d;
        rotate(qkv + token * width + h * d, cos + token * d, sin + token * d, d, query);
        const float *k = keys + (first + r) * slot + (h / group) * capacity * d;
        const float *v = values + (first + r) * slot + (h / group) * capacity * d;
        float *scores = malloc(visible * sizeof(float)), top = -INFINITY, total = 0;
        for (long j = 0; j < visible; ++j) {
            scores[j] = dot(query, k + j * d, d) * scale;
            top = scores[j] > top ? scores[j] : top;
        }
        memset(o, 0, d * sizeof(float));
        for (long j = 0; j < visible; ++j) {
            float p = expf(scores[j] - top);
            total += p;
            for (long i = 0; i < d; ++i) o[i] += p * v[j * d + i];
        }
        for (long i = 0; i < d; ++i) o[i] /= total;
        free(scores);
    }
}
