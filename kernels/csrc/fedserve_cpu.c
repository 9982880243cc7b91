/* fedserve CPU kernels: batch-invariant by construction.
 *
 * Every output value is computed from its own row's inputs by one code path whose
 * floating-point operation order depends only on the problem's inner sizes (K, D, context
 * length), never on how many rows share the call, which thread runs them, or where a row sits
 * in the batch. Rules that make that true:
 *   - built with -ffp-contract=off and without -ffast-math: no FMA contraction, no reassociation,
 *     so vectorization cannot change results and a*b+c means round(round(a*b)+c) everywhere;
 *   - dot products use fixed lanes (lane l sums elements k = l mod 16, or mod 8, in increasing k)
 *     and one fixed pairwise lane combine;
 *   - threads split work by output rows/heads only; a reduction is never split.
 * Threads come from a small persistent pool of our own (not OpenMP: libgomp throttles its spin
 * when more threads than cores exist, which made every kernel called off the main thread — the
 * engine's step loop — twice as slow).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <stdatomic.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));

#define QB 32     /* quantization block (elements) */
#define TR 4      /* output rows per tile */

/* ---- thread pool -------------------------------------------------------------------------- */
#define MAXT 64
#define SPIN 200000
typedef void (*range_fn)(void *ctx, int64_t begin, int64_t end);
static struct {
    pthread_mutex_t busy; /* one dispatch at a time; a concurrent caller runs inline */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int nworkers;
    atomic_long gen;
    atomic_int remaining;
    range_fn fn;
    void *ctx;
    int64_t total;
    int nparts;
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void run_part(int i) {
    int64_t b = P.total * i / P.nparts, e = P.total * (i + 1) / P.nparts;
    if (b < e) P.fn(P.ctx, b, e);
}

static long start_gen[MAXT]; /* the generation a worker was created at (set by its creator) */

static void *pool_worker(void *arg) {
    int id = (int)(intptr_t)arg;
    long seen = start_gen[id]; /* jobs after this one are ours, even if we start late */
    for (;;) {
        long g;
        int spins = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
            if (++spins < SPIN) { __builtin_ia32_pause(); continue; }
            pthread_mutex_lock(&P.lock);
            while (atomic_load(&P.gen) == seen) pthread_cond_wait(&P.wake, &P.lock);
            pthread_mutex_unlock(&P.lock);
        }
        seen = g;
        if (id < P.nparts) {
            run_part(id);
            atomic_fetch_sub_explicit(&P.remaining, 1, memory_order_release);
        }
    }
    return NULL;
}

/* fn over [0, total) split into contiguous parts, one per thread (the caller runs part 0). */
static void parallel_for(range_fn fn, void *ctx, int64_t total, int nthreads) {
    if (nthreads > MAXT) nthreads = MAXT;
    if (nthreads <= 1 || total <= 1 || pthread_mutex_trylock(&P.busy) != 0) {
        fn(ctx, 0, total);
        return;
    }
    while (P.nworkers < nthreads - 1) {
        pthread_t th;
        start_gen[P.nworkers + 1] = atomic_load(&P.gen);
        if (pthread_create(&th, NULL, pool_worker, (void *)(intptr_t)(P.nworkers + 1)) != 0) break;
        pthread_detach(th);
        P.nworkers++;
    }
    int parts = nthreads < P.nworkers + 1 ? nthreads : P.nworkers + 1;
    if (parts > total) parts = (int)total;
    P.fn = fn, P.ctx = ctx, P.total = total, P.nparts = parts;
    atomic_store(&P.remaining, parts - 1);
    pthread_mutex_lock(&P.lock);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.lock);
    run_part(0);
    while (atomic_load_explicit(&P.remaining, memory_order_acquire) > 0) __builtin_ia32_pause();
    pthread_mutex_unlock(&P.busy);
}

static inline v8 ld8(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline void st8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float hsum8(v8 a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

typedef float v16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* a*b + c with one rounding (IEEE fma): the same bits on every ISA, so the kernels' results
 * do not depend on which of these paths the compiler was allowed to use. */
static inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    v8 al, ah, bl, bh, cl, ch;
    memcpy(&al, &a, 32); memcpy(&ah, (char *)&a + 32, 32);
    memcpy(&bl, &b, 32); memcpy(&bh, (char *)&b + 32, 32);
    memcpy(&cl, &c, 32); memcpy(&ch, (char *)&c + 32, 32);
    v8 rl = (v8)_mm256_fmadd_ps((__m256)al, (__m256)bl, (__m256)cl);
    v8 rh = (v8)_mm256_fmadd_ps((__m256)ah, (__m256)bh, (__m256)ch);
    v16 r;
    memcpy(&r, &rl, 32); memcpy((char *)&r + 32, &rh, 32);
    return r;
#else
    v16 r;
    for (int i = 0; i < 16; i++) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

/* bytes → floats in two widening steps (a direct u8→f32 conversion is scalarized by GCC) */
static inline v16 u8_to_f(u8x16 q) { return __builtin_convertvector(__builtin_convertvector(q, i32x16), v16); }
static inline v16 i8_to_f(i8x16 q) { /* via unsigned: GCC scalarizes a signed widening */
    u8x16 u = (u8x16)q ^ 0x80;
    return __builtin_convertvector(__builtin_convertvector(u, i32x16) - 128, v16);
}

static inline v16 ld16(const float *p) { v16 r; memcpy(&r, p, sizeof r); return r; }
static inline v16 splat16(float f) { return (v16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }
static inline float hsum16(v16 a) {
    v8 lo, hi;
    memcpy(&lo, &a, sizeof lo);
    memcpy(&hi, (const char *)&a + sizeof lo, sizeof hi);
    return hsum8(lo + hi);
}

/* Dequantize block g of row `row` into two 16-lane halves (elements 0..15, 16..31), exactly
 * as kernels/linear.py does: q4 w = d*q + m, q8 w = d*q, f32 as stored. */
static inline void load_block(int fmt, const void *wq, const float *scale, const float *minv,
                              int64_t K, int64_t row, int64_t g, v16 *w0, v16 *w1) {
    int64_t nb = K / QB;
    if (fmt == 0) {
        const float *p = (const float *)wq + row * K + g * QB;
        *w0 = ld16(p);
        *w1 = ld16(p + 16);
    } else if (fmt == 1) {
        u8x16 q;
        memcpy(&q, (const uint8_t *)wq + row * (K / 2) + g * (QB / 2), sizeof q);
        v16 d = splat16(scale[row * nb + g]), m = splat16(minv[row * nb + g]);
        *w0 = d * u8_to_f(q & 15) + m;
        *w1 = d * u8_to_f(q >> 4) + m;
    } else {
        i8x16 q0, q1;
        const int8_t *p = (const int8_t *)wq + row * K + g * QB;
        memcpy(&q0, p, sizeof q0);
        memcpy(&q1, p + 16, sizeof q1);
        v16 d = splat16(scale[row * nb + g]);
        *w0 = d * i8_to_f(q0);
        *w1 = d * i8_to_f(q1);
    }
}

/* One tile: TR weight rows × NB batch rows, accumulators held in registers across all K.
 * Accumulator (b, r) sees exactly: for g in 0..K/32: a = fma(w0, x0, a); a = fma(w1, x1, a),
 * whatever NB is; so how rows are grouped changes no bit of any result. */
static inline __attribute__((always_inline)) void tile_rows(
    int NB, int fmt, const float *restrict x, int64_t K, const void *restrict wq,
    const float *restrict scale, const float *restrict minv, const int64_t *rows, int64_t nvalid,
    int64_t N, int64_t b0, float *restrict y, int64_t col0) {
    v16 acc[4][TR];
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < TR; r++) acc[b][r] = splat16(0.0f);
    for (int64_t g = 0; g < K / QB; g++) {
        v16 w0[TR], w1[TR];
        for (int r = 0; r < TR; r++) load_block(fmt, wq, scale, minv, K, rows[r], g, &w0[r], &w1[r]);
        for (int b = 0; b < NB; b++) {
            const float *xb = x + (b0 + b) * K + g * QB;
            v16 x0 = ld16(xb), x1 = ld16(xb + 16);
            for (int r = 0; r < TR; r++) {
                acc[b][r] = fma16(w0[r], x0, acc[b][r]);
                acc[b][r] = fma16(w1[r], x1, acc[b][r]);
            }
        }
    }
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < nvalid; r++) y[(b0 + b) * N + col0 + r] = hsum16(acc[b][r]);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(FS_GENERIC_TILES)
/* The same tile on AVX2 with 8-lane registers: accumulator (b, r)'s 16 lanes are two registers
 * (lanes 0..7, 8..15), each lane sees the same fma sequence as in tile_rows, and the final sum
 * is hsum16's order, so every result has tile_rows' bits. Written with intrinsics because GCC
 * lowers tile_rows' 16-lane vectors on AVX2 to byte extracts and stack traffic (measured: ~1 GB/s
 * on a q4 GEMV). Row r's block is dequantized once and used by all NB batch rows. */
static inline __attribute__((always_inline)) void dequant8x4(int fmt, const void *wq,
        const float *scale, const float *minv, int64_t K, int64_t row, int64_t g, __m256 w[4]) {
    int64_t nb = K / QB;
    if (fmt == 0) {
        const float *p = (const float *)wq + row * K + g * QB;
        for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps(p + 8 * i);
    } else if (fmt == 1) {
        __m128i q = _mm_loadu_si128((const __m128i *)((const uint8_t *)wq + row * (K / 2) + g * (QB / 2)));
        __m128i mask = _mm_set1_epi8(15);
        __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        __m256 d = _mm256_set1_ps(scale[row * nb + g]), m = _mm256_set1_ps(minv[row * nb + g]);
        __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]))), m);
    } else {
        const int8_t *p = (const int8_t *)wq + row * K + g * QB;
        __m256 d = _mm256_set1_ps(scale[row * nb + g]);
        for (int i = 0; i < 4; i++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(p + 8 * i));
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
    }
}

static inline float hsum2x8(__m256 a, __m256 b) { /* hsum16 of the 16 lanes (a: 0..7, b: 8..15) */
    float s[8];
    _mm256_storeu_ps(s, _mm256_add_ps(a, b));
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

static inline __attribute__((always_inline)) void tile_avx2(
    int NB, int TR_, int fmt, const float *restrict x, int64_t K, const void *restrict wq,
    const float *restrict scale, const float *restrict minv, const int64_t *rows, int64_t nvalid,
    int64_t N, int64_t b0, float *restrict y, int64_t col0) {
    __m256 acc[4][4][2];
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < TR_; r++) acc[b][r][0] = acc[b][r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / QB; g++) {
        for (int r = 0; r < TR_; r++) {
            __m256 w[4]; /* elements 0..7, 8..15 (first half), 16..23, 24..31 (second) */
            dequant8x4(fmt, wq, scale, minv, K, rows[r], g, w);
            for (int b = 0; b < NB; b++) {
                const float *xb = x + (b0 + b) * K + g * QB;
                acc[b][r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[b][r][0]);
                acc[b][r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[b][r][1]);
                acc[b][r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[b][r][0]);
                acc[b][r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[b][r][1]);
            }
        }
    }
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < TR_ && r < nvalid; r++)
            y[(b0 + b) * N + col0 + r] = hsum2x8(acc[b][r][0], acc[b][r][1]);
}
#define FS_AVX2_TILES 1
#endif

/* y[b, n] = sum_k x[b, k] * W[n, k]; x [B, K] f32, y [B, N] f32, K % 32 == 0.
 * fmt 0: W f32 [N, K]; 1: q4; 2: q8. Lane l of one 16-lane accumulator sums, in increasing k,
 * the products of elements k = l (mod 16) (fused multiply-add); lanes combine by hsum16. */
struct linear_args {
    int fmt;
    const float *x;
    int64_t B, K;
    const void *wq;
    const float *scale, *minv;
    int64_t N;
    float *y;
};

static void linear_range(void *ctx, int64_t t0, int64_t t1) {
    const struct linear_args *a = ctx;
    int fmt = a->fmt;
    const float *x = a->x, *scale = a->scale, *minv = a->minv;
    const void *wq = a->wq;
    int64_t B = a->B, K = a->K, N = a->N;
    float *y = a->y;
    for (int64_t t = t0; t < t1; t++) {
        int64_t rows[TR];
        for (int r = 0; r < TR; r++) rows[r] = t * TR + r < N ? t * TR + r : N - 1;
        int64_t nvalid = N - t * TR < TR ? N - t * TR : TR;
        int64_t b = 0;
#ifdef FS_AVX2_TILES /* 4 batch rows share each dequantized row; a lone batch row takes 4 rows */
#define TILE4(F) for (int r = 0; r < nvalid; r++) \
            tile_avx2(4, 1, F, x, K, wq, scale, minv, rows + r, 1, N, b, y, t * TR + r)
#define TILE1(F) tile_avx2(1, TR, F, x, K, wq, scale, minv, rows, nvalid, N, b, y, t * TR)
#else
#define TILE4(F) tile_rows(4, F, x, K, wq, scale, minv, rows, nvalid, N, b, y, t * TR)
#define TILE1(F) tile_rows(1, F, x, K, wq, scale, minv, rows, nvalid, N, b, y, t * TR)
#endif
#define BY_FORMAT(T) switch (fmt) { case 0: T(0); break; case 1: T(1); break; default: T(2); }
        for (; b + 4 <= B; b += 4) BY_FORMAT(TILE4)
        for (; b < B; b++) BY_FORMAT(TILE1)
#undef BY_FORMAT
#undef TILE4
#undef TILE1
    }
}

void fs_linear(int fmt, const float *x, int64_t B, int64_t K, const void *wq, const float *scale,
               const float *minv, int64_t N, float *y, int nthreads) {
    struct linear_args a = {fmt, x, B, K, wq, scale, minv, N, y};
    parallel_for(linear_range, &a, (N + TR - 1) / TR, nthreads);
}

/* y[r] = x[r] * (1/sqrt(mean(x[r]^2) + eps)) * w ; x, y [R, K], w [K], K % 8 == 0. */
struct rows_args {
    const float *x, *w, *u;
    int64_t K, gstride, ustride;
    float eps;
    float *y;
};

static void rms_norm_range(void *ctx, int64_t r0, int64_t r1) {
    const struct rows_args *a = ctx;
    const float *x = a->x, *w = a->w;
    int64_t K = a->K;
    float eps = a->eps, *y = a->y;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * K;
        v8 a = {0};
        for (int64_t k = 0; k < K; k += 8) { v8 v = ld8(xr + k); a = a + v * v; }
        float inv = 1.0f / sqrtf(hsum8(a) / (float)K + eps);
        for (int64_t k = 0; k < K; k++) y[r * K + k] = (xr[k] * inv) * w[k];
    }
}

void fs_rms_norm(const float *x, const float *w, int64_t R, int64_t K, float eps, float *y, int nthreads) {
    struct rows_args a = {.x = x, .w = w, .K = K, .eps = eps, .y = y};
    parallel_for(rms_norm_range, &a, R, nthreads);
}

/* out[i] = silu(g[i]) * u[i] for R rows of width K (g and u may be row-strided views). */
static void silu_mul_range(void *ctx, int64_t r0, int64_t r1) {
    const struct rows_args *a = ctx;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t k = 0; k < a->K; k++) {
            float gv = a->x[r * a->gstride + k];
            a->y[r * a->K + k] = (gv / (1.0f + expf(-gv))) * a->u[r * a->ustride + k];
        }
}

void fs_silu_mul(const float *g, const float *u, int64_t R, int64_t K, int64_t gstride,
                 int64_t ustride, float *out, int nthreads) {
    struct rows_args a = {.x = g, .u = u, .K = K, .gstride = gstride, .ustride = ustride, .y = out};
    parallel_for(silu_mul_range, &a, R, nthreads);
}

/* Row softmax: y[r] = exp(x[r] - max) / sum, sequential sum; x, y [R, K]. */
static void softmax_range(void *ctx, int64_t r0, int64_t r1) {
    const struct rows_args *a = ctx;
    const float *x = a->x;
    int64_t K = a->K;
    float *y = a->y;
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * K;
        float mx = -INFINITY, s = 0.0f;
        for (int64_t k = 0; k < K; k++) mx = xr[k] > mx ? xr[k] : mx;
        for (int64_t k = 0; k < K; k++) { y[r * K + k] = expf(xr[k] - mx); s += y[r * K + k]; }
        for (int64_t k = 0; k < K; k++) y[r * K + k] = y[r * K + k] / s;
    }
}

void fs_softmax(const float *x, int64_t R, int64_t K, float *y, int nthreads) {
    struct rows_args a = {.x = x, .K = K, .y = y};
    parallel_for(softmax_range, &a, R, nthreads);
}

/* Causal paged attention, one query token at a time.
 * q [T, H, D]; caches [num_blocks, BS, KVH, D]; block_tables [S, MB] int32;
 * tok_row[t] = the block-table row of token t's stream; ctx[t] = keys visible to token t
 * (its position + 1, all already written to the cache). out [T, H, D].
 * For each (t, h): two passes over the keys in increasing position, exp-sum sequential. */
struct attn_args {
    const float *q, *kc, *vc;
    int64_t H, KVH, D, BS, MB;
    const int32_t *block_tables, *tok_row, *ctx;
    float scale;
    float *out;
};

static void attention_range(void *ctxp, int64_t th0, int64_t th1) {
    const struct attn_args *a = ctxp;
    const float *q = a->q, *kc = a->kc, *vc = a->vc;
    int64_t H = a->H, KVH = a->KVH, D = a->D, BS = a->BS, MB = a->MB;
    const int32_t *block_tables = a->block_tables, *tok_row = a->tok_row, *ctx = a->ctx;
    float scale = a->scale, *out = a->out;
    int64_t group = H / KVH, nv = D / 8;
    {
        int64_t cap = 0;
        float *s = NULL;
        v8 *acc = (v8 *)aligned_alloc(32, sizeof(v8) * (nv > 0 ? nv : 1));
        for (int64_t th = th0; th < th1; th++) {
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

void fs_paged_attention(const float *q, int64_t T, int64_t H, int64_t KVH, int64_t D,
                        const float *kc, const float *vc, int64_t BS, const int32_t *block_tables,
                        int64_t MB, const int32_t *tok_row, const int32_t *ctx, float scale,
                        float *out, int nthreads) {
    struct attn_args a = {q, kc, vc, H, KVH, D, BS, MB, block_tables, tok_row, ctx, scale, out};
    parallel_for(attention_range, &a, T * H, nthreads);
}
