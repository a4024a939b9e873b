/* y = f(x) @ w.T (+ bias) (+ residual) for a few fp32 rows, with w laid out in tiles of 16 outputs:
 * tiled[b, i, j] = w[16 b + j, i]. Each weight vector is loaded once and multiplied into every row of a block,
 * so a few rows stream the weights at close to the memory's read bandwidth. Every row is summed in the same
 * order whatever the row count, so a row's result does not depend on the rows beside it. f is the identity,
 * an RMS norm (norm != NULL) or a SiLU gate (gated: x holds [gate | up], f = silu(gate) * up): done here, on
 * a few rows, they cost nothing next to the weights, where torch's own ops cost ~30 us each per layer.
 * Plain C with GCC vector extensions: AVX-512, AVX2 or NEON, whichever -march=native finds, in vectors of the
 * CPU's own width (a 16-float vector on AVX2 is two registers, and a block of 12 rows spilled to the stack: 2-6x
 * slower there). */
#include <math.h>
#include <stdlib.h>

#include "vector.h"

#define TILE 16
/* Accumulators live in registers only if they fit the register file: rows x STEP x TILE / WIDTH vectors of
 * WIDTH floats, plus the weights of a step. STEP > 1 sums alternate inputs into separate accumulators (two
 * chains of FMAs a row), worth it where 32 wide registers leave room for them. */
#if defined(__AVX512F__)
#define STEP 2
#define BLOCK_ROWS 12  /* 32 registers: 12 rows x 2 inputs x 1 vector, 2 weight vectors */
#elif defined(__AVX__) || defined(__ARM_NEON)
#define STEP 1
#define BLOCK_ROWS 6   /* AVX2's 16 registers: 6 rows x 2 vectors, 2 weights; NEON's 32: 6 x 4, 4 weights */
#else
#define STEP 1
#define BLOCK_ROWS 3   /* SSE's 16 registers: 3 rows x 4 vectors, 4 weight vectors */
#endif
#define PARTS (TILE / WIDTH)

static inline __attribute__((always_inline)) void rows_block(int rows, const float *x, long in, const float *w,
                                                             const float *next, float *acc) {
    vec sum[STEP][BLOCK_ROWS][PARTS];
    for (int s = 0; s < STEP; ++s)
        for (int r = 0; r < rows; ++r)
            for (int p = 0; p < PARTS; ++p) sum[s][r][p] = (vec){0};
    long i = 0;
    for (; i + STEP <= in; i += STEP) {
        vec wv[STEP][PARTS];
        for (int s = 0; s < STEP; ++s) {
            for (int p = 0; p < PARTS; ++p) wv[s][p] = load(w + (i + s) * TILE + p * WIDTH);
            if (next) __builtin_prefetch(next + (i + s) * TILE, 0, 1);  /* the next tile, into L2, while this one computes */
        }
        for (int r = 0; r < rows; ++r)
            for (int s = 0; s < STEP; ++s) {
                float xi = x[r * in + i + s];
                for (int p = 0; p < PARTS; ++p) sum[s][r][p] += wv[s][p] * xi;
            }
    }
    for (; i < in; ++i)
        for (int r = 0; r < rows; ++r)
            for (int p = 0; p < PARTS; ++p) sum[0][r][p] += load(w + i * TILE + p * WIDTH) * x[r * in + i];
    for (int r = 0; r < rows; ++r)
        for (int p = 0; p < PARTS; ++p) {
            vec total = sum[0][r][p];
            for (int s = 1; s < STEP; ++s) total += sum[s][r][p];
            memcpy(acc + r * TILE + p * WIDTH, &total, sizeof total);
        }
}

/* transformers' RMSNorm: norm * (x * rsqrt(mean(x^2) + eps)) */
static void rms_norm(const float *x, long n, long in, const float *norm, float eps, float *dst) {
    for (long r = 0; r < n; ++r) {
        const float *xr = x + r * in;
        float squares = 0;
        for (long i = 0; i < in; ++i) squares += xr[i] * xr[i];
        float scale = 1.0f / sqrtf(squares / (float)in + eps);
        for (long i = 0; i < in; ++i) dst[r * in + i] = norm[i] * (xr[i] * scale);
    }
}

static void silu_gate(const float *x, long n, long in, float *dst) {
    for (long r = 0; r < n; ++r)
        for (long i = 0; i < in; ++i) {
            float gate = x[r * 2 * in + i];
            dst[r * in + i] = gate / (1.0f + expf(-gate)) * x[r * 2 * in + in + i];
        }
}

void tiled_linear(const float *x, long n, long in, const float *tiled, long out, const float *bias,
                  const float *residual, const float *norm, float eps, int gated, float *y, int threads) {
    float *prepared = (norm || gated) ? malloc(n * in * sizeof(float)) : 0;
    if (norm) rms_norm(x, n, in, norm, eps, prepared);
    if (gated) silu_gate(x, n, in, prepared);
    if (prepared) x = prepared;
    long blocks = (out + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; ++b) {
        const float *w = tiled + b * in * TILE;
        long width = out - b * TILE < TILE ? out - b * TILE : TILE;
        int rows;
        for (long r0 = 0, left = (n + BLOCK_ROWS - 1) / BLOCK_ROWS; r0 < n; r0 += rows, --left) {
            float acc[BLOCK_ROWS * TILE];
            rows = (int)((n - r0 + left - 1) / left);  /* blocks of even size: 16 rows are 8 + 8, not 12 + 4 */
            const float *xr = x + r0 * in;
            /* The last block of rows prefetches the next tile into L2, so memory streams while rows compute: 1.3-1.6x
             * at 4-16 rows; below 4 rows the loads alone keep memory busy, and the prefetches only cost. */
            const float *next = r0 + rows == n && rows >= 4 && b + 1 < blocks ? w + in * TILE : 0;
            switch (rows) {  /* constant row counts, so each case keeps its accumulators in registers */
#define ROWS(n) case n: rows_block(n < BLOCK_ROWS ? n : BLOCK_ROWS, xr, in, w, next, acc); break;
                ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11)
                default: rows_block(BLOCK_ROWS, xr, in, w, next, acc); break;
#undef ROWS
            }
            for (int r = 0; r < rows; ++r) {
                float *yr = y + (r0 + r) * out + b * TILE;
                const float *res = residual ? residual + (r0 + r) * out + b * TILE : 0;
                for (long j = 0; j < width; ++j) {
                    float v = acc[r * TILE + j];
                    if (bias) v += bias[b * TILE + j];
                    yr[j] = res ? res[j] + v : v;
                }
            }
        }
    }
    free(prepared);
}
