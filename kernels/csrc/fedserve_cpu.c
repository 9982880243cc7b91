/* fedserve CPU kernels: batch-invariant by construction.
 *
 * Every output value is computed from its own row's inputs by one code path whose
 * floating-point operation order depends only on the problem's inner sizes (K, D, context
 * length), never on how many rows share the call, which thread runs them, or where a row sits
 * in the batch. Rules that make that true:
 *   - built with -ffp-contract=off and without -ffast-math: no FMA contraction, no reassociation,
 *     so vectorization cannot change results and a*b+c means round(round(a*b)+c) everywhere;
 *   - dot products use 8 lanes (lane l sums elements k = l mod 8 in increasing k) and one fixed
 *     pairwise lane combine;
 *   - threads split work by output rows/heads only; a reduction is never split.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float v8 __attribute__((vector_size(32)));

#define QB 32     /* quantization block (elements) */
#define TR 4      /* output rows per tile */
#define BCHUNK 64 /* batch rows per accumulator pass (bounds scratch; order unaffected) */

static inline v8 ld8(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline void st8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float hsum8(v8 a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}
static inline int nthreads_or_default(int n) { return n > 0 ? n : 1; }

/* Dequantize one 32-block of row `row`, block `g` into w[32] (exactly like kernels/linear.py). */
static inline void load_block(int fmt, const void *wq, const float *scale, const float *minv,
                              int64_t K, int64_t row, int64_t g, float *w) {
    int64_t nb = K / QB;
    if (fmt == 0) { /* f32 */
        memcpy(w, (const float *)wq + row * K + g * QB, QB * sizeof(float));
    } else if (fmt == 1) { /* q4: w = d*q + m */
        const uint8_t *qs = (const uint8_t *)wq + row * (K / 2) + g * (QB / 2);
        float d = scale[row * nb + g], m = minv[row * nb + g];
        for (int j = 0; j < 16; j++) {
            float lo = d * (float)(qs[j] & 15), hi = d * (float)(qs[j] >> 4);
            w[j] = lo + m;
            w[j + 16] = hi + m;
        }
    } else { /* q8: w = d*q */
        const int8_t *qs = (const int8_t *)wq + row * K + g * QB;
        float d = scale[row * nb + g];
        for (int j = 0; j < QB; j++) w[j] = d * (float)qs[j];
    }
}

/* y[b, n] = sum_k x[b, k] * W[n, k]; x [B, K] f32, y [B, N] f32.
 * fmt 0: W f32 [N, K] (K % 8 == 0); 1: q4 (K % 32 == 0); 2: q8 (K % 32 == 0). */
void fs_linear(int fmt, const float *x, int64_t B, int64_t K, const void *wq, const float *scale,
               const float *minv, int64_t N, float *y, int nthreads) {
    int64_t ntiles = (N + TR - 1) / TR;
    int64_t kblocks = (K + QB - 1) / QB; /* f32 may end on a partial (multiple-of-8) block */
#pragma omp parallel num_threads(nthreads_or_default(nthreads))
    {
        v8 *acc = (v8 *)aligned_alloc(32, sizeof(v8) * BCHUNK * TR);
        float w[TR][QB] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            int64_t rows[TR];
            for (int r = 0; r < TR; r++) rows[r] = t * TR + r < N ? t * TR + r : N - 1;
            for (int64_t b0 = 0; b0 < B; b0 += BCHUNK) {
                int64_t nbat = B - b0 < BCHUNK ? B - b0 : BCHUNK;
                memset(acc, 0, sizeof(v8) * BCHUNK * TR);
                for (int64_t g = 0; g < kblocks; g++) {
                    int64_t klen = K - g * QB < QB ? K - g * QB : QB;
                    if (fmt == 0 && klen < QB) {
                        for (int r = 0; r < TR; r++)
                            memcpy(w[r], (const float *)wq + rows[r] * K + g * QB, klen * sizeof(float));
                    } else {
                        for (int r = 0; r < TR; r++) load_block(fmt, wq, scale, minv, K, rows[r], g, w[r]);
                    }
                    for (int64_t b = 0; b < nbat; b++) {
                        const float *xb = x + (b0 + b) * K + g * QB;
                        for (int r = 0; r < TR; r++) {
                            v8 a = acc[b * TR + r];
                            for (int c = 0; c < klen; c += 8) a = a + ld8(w[r] + c) * ld8(xb + c);
                            acc[b * TR + r] = a;
                        }
                    }
                }
                for (int64_t b = 0; b < nbat; b++)
                    for (int r = 0; r < TR; r++)
                        if (t * TR + r < N) y[(b0 + b) * N + t * TR + r] = hsum8(acc[b * TR + r]);
            }
        }
        free(acc);
    }
}

/* y[r] = x[r] * (1/sqrt(mean(x[r]^2) + eps)) * w ; x, y [R, K], w [K], K % 8 == 0. */
void fs_rms_norm(const float *x, const float *w, int64_t R, int64_t K, float eps, float *y, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads_or_default(nthreads))
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * K;
        v8 a = {0};
        for (int64_t k = 0; k < K; k += 8) { v8 v = ld8(xr + k); a = a + v * v; }
        float inv = 1.0f / sqrtf(hsum8(a) / (float)K + eps);
        for (int64_t k = 0; k < K; k++) y[r * K + k] = (xr[k] * inv) * w[k];
    }
}

/* out[i] = silu(g[i]) * u[i] for R rows of width K (g and u may be row-strided views). */
void fs_silu_mul(const float *g, const float *u, int64_t R, int64_t K, int64_t gstride,
                 int64_t ustride, float *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads_or_default(nthreads))
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < K; k++) {
            float gv = g[r * gstride + k];
            out[r * K + k] = (gv / (1.0f + expf(-gv))) * u[r * ustride + k];
        }
}

/* Row softmax: y[r] = exp(x[r] - max) / sum, sequential sum; x, y [R, K]. */
void fs_softmax(const float *x, int64_t R, int64_t K, float *y, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads_or_default(nthreads))
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * K;
        float mx = -INFINITY, s = 0.0f;
        for (int64_t k = 0; k < K; k++) mx = xr[k] > mx ? xr[k] : mx;
        for (int64_t k = 0; k < K; k++) { y[r * K + k] = expf(xr[k] - mx); s += y[r * K + k]; }
        for (int64_t k = 0; k < K; k++) y[r * K + k] = y[r * K + k] / s;
    }
}

/* Causal paged attention, one query token at a time.
 * q [T, H, D]; caches [num_blocks, BS, KVH, D]; block_tables [S, MB] int32;
 * tok_row[t] = the block-table row of token t's stream; ctx[t] = keys visible to token t
 * (its position + 1, all already written to the cache). out [T, H, D].
 * For each (t, h): two passes over the keys in increasing position, exp-sum sequential. */
void fs_paged_attention(const float *q, int64_t T, int64_t H, int64_t KVH, int64_t D,
                        const float *kc, const float *vc, int64_t BS, const int32_t *block_tables,
                        int64_t MB, const int32_t *tok_row, const int32_t *ctx, float scale,
                        float *out, int nthreads) {
    int64_t group = H / KVH, nv = D / 8;
#pragma omp parallel num_threads(nthreads_or_default(nthreads))
    {
        int64_t cap = 0;
        float *s = NULL;
        v8 *acc = (v8 *)aligned_alloc(32, sizeof(v8) * (nv > 0 ? nv : 1));
#pragma omp for schedule(static)
        for (int64_t th = 0; th < T * H; th++) {
            int64_t t = th / H, h = th % H, kvh = h / group, n = ctx[t];
            const int32_t *bt = block_tables + (int64_t)tok_row[t] * MB;
            const float *qv = q + (t * H + h) * D;
            if (n > cap) { free(s); cap = n > 2 * cap ? n : 2 * cap; s = (float *)malloc(sizeof(float) * cap); }
            float mx = -INFINITY;
            for (int64_t i = 0; i < n; i++) {
                const float *kp = kc + (((int64_t)bt[i / BS] * BS + i % BS) * KVH + kvh) * D;
                v8 a = {0};
                for (int64_t c = 0; c < nv; c++) a = a + ld8(qv + 8 * c) * ld8(kp + 8 * c);
                s[i] = hsum8(a) * scale;
                mx = s[i] > mx ? s[i] : mx;
            }
            float sum = 0.0f;
            for (int64_t c = 0; c < nv; c++) acc[c] = (v8){0};
            for (int64_t i = 0; i < n; i++) {
                float e = expf(s[i] - mx);
                sum += e;
                const float *vp = vc + (((int64_t)bt[i / BS] * BS + i % BS) * KVH + kvh) * D;
                v8 ev = {e, e, e, e, e, e, e, e};
                for (int64_t c = 0; c < nv; c++) acc[c] = acc[c] + ev * ld8(vp + 8 * c);
            }
            float *o = out + (t * H + h) * D;
            v8 sv = {sum, sum, sum, sum, sum, sum, sum, sum};
            for (int64_t c = 0; c < nv; c++) st8(o + 8 * c, acc[c] / sv);
        }
        free(s);
        free(acc);
    }
}
