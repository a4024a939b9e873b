/* Attention for a few new tokens per row over a slot KV cache, in one call: rotary on the new queries and
 * keys, the new keys and values written at their positions, then each query attends to its row's cache up to
 * and including its own position (the causal rule CachedLM's masks encode). torch spends a dozen ops per
 * layer on this (slices, rotary, scatter, SDPA, transposes: ~80 us at one token); here it is a few us.
 *   qkv        (n, q, heads + 2 kv_heads, d), as the fused QKV projection writes it
 *   cos, sin   (n, q, d); positions (n, q)
 *   keys, values  this layer's (slots, kv_heads, capacity, d) buffers; the rows are slots first .. first + n - 1
 *   out        (n, q, heads, d), as the output projection reads it
 * One task per (new token, KV head): the query heads that share a KV head read each cached key and value once
 * between them. Dot products sum their lanes as a tree, exp runs a vector of scores at a time and values accumulate in
 * vectors; a query's arithmetic is the same whatever tokens, rows or heads run beside it. */
#include <math.h>
#include <stdlib.h>

#include "vector.h"

typedef int ivec __attribute__((vector_size(WIDTH * sizeof(int))));

/* transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin */
static void rotate(const float *x, const float *cos, const float *sin, long d, float *dst) {
    long half = d / 2;
    for (long i = 0; i < d; ++i) {
        float rotated = i < half ? -x[i + half] : x[i - half];
        dst[i] = x[i] * cos[i] + rotated * sin[i];
    }
}

/* The lanes summed pairwise (halves added until one is left): log2(WIDTH) dependent adds, not WIDTH. */
static inline float sum_lanes(vec v) {
    float lanes[WIDTH];
    store(lanes, v);
    for (int width = WIDTH / 2; width > 0; width /= 2)
        for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
    return lanes[0];
}

static inline float dot(const float *a, const float *b, long d) {
    vec acc = {0};
    long i = 0;
    for (; i + WIDTH <= d; i += WIDTH) acc += load(a + i) * load(b + i);
    float sum = sum_lanes(acc);
    for (; i < d; ++i) sum += a[i] * b[i];
    return sum;
}

/* exp(x) of WIDTH scores minus their maximum (x <= 0): x = n ln2 + y with |y| <= ln2 / 2 (Cody-Waite's two-part
 * ln2), e^y by its Taylor series to y^7 (truncation below 2e-9, relative), times 2^n set in the exponent bits.
 * Below -87 (where 2^n would leave the normal range) it is 0: next to the maximum's 1 such terms vanish. */
static inline vec exp_scores(vec x) {
    const vec zero = {0};
    ivec kept = x >= zero - 87.0f;
    x = (vec)((ivec)x & kept);                                          /* dropped lanes compute exp(0) */
    ivec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, ivec);  /* round(x / ln2), x <= 0 */
    vec nf = __builtin_convertvector(n, vec);
    vec y = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-6f;
    vec p = zero + 1.0f / 5040;
    p = p * y + 1.0f / 720;
    p = p * y + 1.0f / 120;
    p = p * y + 1.0f / 24;
    p = p * y + 1.0f / 6;
    p = p * y + 0.5f;
    p = p * y + 1.0f;
    p = p * y + 1.0f;
    vec scale = (vec)((n + 127) << 23);
    return (vec)((ivec)(p * scale) & kept);
}

/* Softmax-weighted sum of one KV head's values for `group` query heads; queries (group, d) already rotated. */
static void attend(const float *queries, long group, long d, const float *k, const float *v, long visible,
                   float scale, float *scores, float *out) {
    for (long h = 0; h < group; ++h) {
        float *s = scores + h * visible, top = -INFINITY;
        for (long j = 0; j < visible; ++j) {
            s[j] = dot(queries + h * d, k + j * d, d) * scale;
            top = s[j] > top ? s[j] : top;
        }
        long j = 0;
        for (; j + WIDTH <= visible; j += WIDTH) store(s + j, exp_scores(load(s + j) - top));
        if (j < visible) {
            float tail[WIDTH] = {0};
            memcpy(tail, s + j, (visible - j) * sizeof(float));
            vec e = exp_scores(load(tail) - top);
            memcpy(s + j, &e, (visible - j) * sizeof(float));
        }
    }
    for (long h = 0; h < group; ++h) {
        const float *s = scores + h * visible;
        float *o = out + h * d, total = 0;
        for (long j = 0; j < visible; ++j) total += s[j];
        long i = 0;
        for (; i + 4 * WIDTH <= d; i += 4 * WIDTH) {  /* four independent sums per key, kept in registers */
            vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (long j = 0; j < visible; ++j) {
                const float *vj = v + j * d + i;
                a0 += load(vj) * s[j];
                a1 += load(vj + WIDTH) * s[j];
                a2 += load(vj + 2 * WIDTH) * s[j];
                a3 += load(vj + 3 * WIDTH) * s[j];
            }
            store(o + i, a0 / total);
            store(o + i + WIDTH, a1 / total);
            store(o + i + 2 * WIDTH, a2 / total);
            store(o + i + 3 * WIDTH, a3 / total);
        }
        for (; i < d; ++i) {
            float a = 0;
            for (long j = 0; j < visible; ++j) a += v[j * d + i] * s[j];
            o[i] = a / total;
        }
    }
}

void decode_attention(const float *qkv, long n, long q, long heads, long kv_heads, long d, const float *cos,
                      const float *sin, const long *positions, float *keys, float *values, long capacity,
                      long first, float *out, int threads) {
    long width = (heads + 2 * kv_heads) * d, slot = kv_heads * capacity * d, group = heads / kv_heads;
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
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long task = 0; task < n * q * kv_heads; ++task) {
        long token = task / kv_heads, g = task % kv_heads, r = token / q, visible = positions[token] + 1;
        float *queries = malloc(group * d * sizeof(float)), *scores = malloc(group * visible * sizeof(float));
        for (long h = 0; h < group; ++h)
            rotate(qkv + token * width + (g * group + h) * d, cos + token * d, sin + token * d, d, queries + h * d);
        long base = (first + r) * slot + g * capacity * d;
        attend(queries, group, d, keys + base, values + base, visible, scale, scores, out + (token * heads + g * group) * d);
        free(queries);
        free(scores);
    }
}
