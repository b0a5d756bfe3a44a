/* tandem's CPU kernels: the few-row GEMMs of a decode step, the routed experts, decode attention
 * over the paged cache, the rotary embedding with the cache write, RMSNorm and softmax routing.
 *
 * Built once per machine by tandem/platform/cpu_kernels.py (cc -O3 -march=native) and called
 * through ctypes, which releases the GIL. Written with GCC vector extensions, so one source
 * serves AVX-512, AVX2 and NEON; the vector width follows the target.
 *
 * Weights are packed once into column panels: panel p holds output columns [p*P, p*P + P) as
 * K rows of P values (zero past N), so a panel streams through memory in order and each
 * k-step is NV vector loads, one broadcast per row and NV fused multiply-adds per row into
 * register accumulators. Activations and accumulators are float32; weights float32 or
 * bfloat16 (widened in registers: the bytes read are what a decode step pays for).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__) || defined(__AVX2__)
#define VL 8
#else
#define VL 4
#endif
#define NV 4
#define PANEL (VL * NV)
#define MR 6

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_u __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint16_t vh_u __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && VL == 16
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HAVE_AMX 0
#endif

/* AMX tiles: a bfloat16 weight panel is 32-k blocks of four 16 x 64-byte B tiles (k pairs
 * interleaved, 16 columns each), so K rounds up to a multiple of 32. */
#define AMX_K 32

/* Whether this process may use AMX: Linux hands out the tile state on request, once. */
static int amx_usable(void) {
#if HAVE_AMX
    static int usable = -1;
    if (usable < 0) usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return usable;
#else
    return 0;
#endif
}

int tandem_amx(void) { return amx_usable(); }

static inline int amx_layout(int bf16) { return bf16 && amx_usable(); }
static inline long amx_k(long K) { return (K + AMX_K - 1) / AMX_K * AMX_K; }
static inline long panel_rows(long K, int bf16) { return amx_layout(bf16) ? amx_k(K) : K; }

long tandem_packed_elements(long N, long K, int bf16) { return (N + PANEL - 1) / PANEL * panel_rows(K, bf16) * PANEL; }

/* Asks for the cache lines of [start, start + bytes) ahead of use. */
static inline void prefetch_span(const void *start, long bytes) {
    for (long b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)start + b, 0, 3);
}

static inline vf load_f32(const float *p) { return *(const vf_u *)p; }

static inline vf load_bf16(const uint16_t *p) {
    vh h = *(const vh_u *)p;
    vu u = __builtin_convertvector(h, vu) << 16;
    return (vf)u;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* out[i, 0:ncols] (+)= x[i, :] . panel[:, 0:ncols] for i < M, M <= MR a constant after inlining. */
#define PANEL_KERNEL(NAME, WTYPE, LOAD)                                                               \
    static inline __attribute__((always_inline)) void NAME(                                          \
        const int M, const float *x, long ldx, const WTYPE *panel, long K, float *out, long ldo,    \
        int ncols, int accumulate) {                                                               \
        vf acc[MR][NV];                                                                            \
        for (int i = 0; i < M; i++)                                                                \
            for (int j = 0; j < NV; j++) acc[i][j] = (vf){0};                                      \
        for (long k = 0; k < K; k++) {                                                             \
            const WTYPE *w = panel + k * PANEL;                                                    \
            vf w0 = LOAD(w), w1 = LOAD(w + VL), w2 = LOAD(w + 2 * VL), w3 = LOAD(w + 3 * VL);      \
            for (int i = 0; i < M; i++) {                                                          \
                float xs = x[i * ldx + k];                                                         \
                acc[i][0] += xs * w0;                                                              \
                acc[i][1] += xs * w1;                                                              \
                acc[i][2] += xs * w2;                                                              \
                acc[i][3] += xs * w3;                                                              \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < M; i++) {                                                              \
            float *o = out + i * ldo;                                                              \
            if (ncols == PANEL && !accumulate) {                                                   \
                for (int j = 0; j < NV; j++) *(vf_u *)(o + j * VL) = acc[i][j];                    \
            } else {                                                                               \
                float tile[PANEL];                                                                 \
                for (int j = 0; j < NV; j++) *(vf_u *)(tile + j * VL) = acc[i][j];                 \
                for (int c = 0; c < ncols; c++) o[c] = accumulate ? o[c] + tile[c] : tile[c];      \
            }                                                                                      \
        }                                                                                          \
    }

PANEL_KERNEL(panel_f32, float, load_f32)
PANEL_KERNEL(panel_bf16, uint16_t, load_bf16)

#define ROWS_DISPATCH(FN, m, ...)           \
    switch (m) {                            \
        case 1: FN(1, __VA_ARGS__); break;  \
        case 2: FN(2, __VA_ARGS__); break;  \
        case 3: FN(3, __VA_ARGS__); break;  \
        case 4: FN(4, __VA_ARGS__); break;  \
        case 5: FN(5, __VA_ARGS__); break;  \
        default: FN(6, __VA_ARGS__); break; \
    }

/* out [M, N] (row stride ldo) = x [M, K] (float32, row stride ldx) times the packed weight. */
static void gemm_f32_out(const float *x, long ldx, long M, long K, const void *packed, int w_bf16, long N,
                         float *out, long ldo) {
    long panels = (N + PANEL - 1) / PANEL;
    /* Threads split the panels: each streams its own share of the weight. A GEMM too small to
     * pay for waking the team (~2 us) runs on the calling thread. */
#pragma omp parallel for schedule(static) if (panels > 1 && M * K * N >= (1L << 16))
    for (long p = 0; p < panels; p++) {
        int ncols = (int)(N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
        for (long m0 = 0; m0 < M; m0 += MR) {
            int m = (int)(M - m0 < MR ? M - m0 : MR);
            const float *xr = x + m0 * ldx;
            float *o = out + m0 * ldo + p * PANEL;
            if (w_bf16) {
                const uint16_t *panel = (const uint16_t *)packed + p * K * PANEL;
                ROWS_DISPATCH(panel_bf16, m, xr, ldx, panel, K, o, ldo, ncols, 0)
            } else {
                const float *panel = (const float *)packed + p * K * PANEL;
                ROWS_DISPATCH(panel_f32, m, xr, ldx, panel, K, o, ldo, ncols, 0)
            }
        }
    }
}

#if HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config_t;

/* out [M, N] = x [M, Kp] (bfloat16, row stride Kp elements, zero past K) times an AMX-packed
 * bfloat16 weight: per 16-row block and panel, four C tiles (64 columns) accumulate one A
 * tile times four B tiles per 32-k block. Tile state is per thread: each thread of the team
 * loads its configuration. */
static void gemm_amx(const uint16_t *x, long M, long Kp, const uint16_t *packed, long N, float *out, long ldo) {
    long panels = (N + PANEL - 1) / PANEL, kblocks = Kp / AMX_K;
#pragma omp parallel if (panels > 1 && M * Kp * N >= (1L << 16))
    {
        long configured = -1;
#pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) {
            int ncols = (int)(N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
            const uint16_t *panel = packed + p * Kp * PANEL;
            for (long m0 = 0; m0 < M; m0 += 16) {
                long m = M - m0 < 16 ? M - m0 : 16;
                if (m != configured) {
                    tile_config_t cfg;
                    memset(&cfg, 0, sizeof cfg);
                    cfg.palette = 1;
                    for (int t = 0; t < 4; t++) cfg.rows[t] = (uint8_t)m, cfg.colsb[t] = 64; /* C */
                    cfg.rows[4] = (uint8_t)m, cfg.colsb[4] = 64;                               /* A */
                    for (int t = 5; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;           /* B */
                    _tile_loadconfig(&cfg);
                    configured = m;
                }
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (long kb = 0; kb < kblocks; kb++) {
                    const uint16_t *b = panel + kb * AMX_K * PANEL;
                    /* The weight streams from memory once, on the first row block: ask for
                     * it two k-blocks (8 KB) ahead, past a panel's end into the next one's
                     * (a thread's panels are contiguous), as tile loads alone wait for it. */
                    if (m0 == 0) prefetch_span(b + 2 * AMX_K * PANEL, AMX_K * PANEL * 2);
                    _tile_loadd(4, x + m0 * Kp + kb * AMX_K, Kp * 2);
                    _tile_loadd(5, b, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, b + 512, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(7, b + 1024, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, b + 1536, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
                float tile[16 * PANEL];
                _tile_stored(0, tile, PANEL * 4);
                _tile_stored(1, tile + 16, PANEL * 4);
                _tile_stored(2, tile + 32, PANEL * 4);
                _tile_stored(3, tile + 48, PANEL * 4);
                for (long i = 0; i < m; i++) memcpy(out + (m0 + i) * ldo + p * PANEL, tile + i * PANEL, ncols * 4);
            }
        }
        if (configured >= 0) _tile_release();
    }
}
#endif

/* Rows `src` [M, K] (float32 or bfloat16, row stride lds) as bfloat16 [M, Kp], zero past K. */
static void rows_to_bf16(const void *src, int src_bf16, long M, long K, long lds, long Kp, uint16_t *dst) {
    for (long m = 0; m < M; m++) {
        uint16_t *d = dst + m * Kp;
        if (src_bf16)
            memcpy(d, (const uint16_t *)src + m * lds, K * 2);
        else
            for (long k = 0; k < K; k++) d[k] = f32_to_bf16(((const float *)src)[m * lds + k]);
        memset(d + K, 0, (Kp - K) * 2);
    }
}

/* Scratch that lives as long as the thread: a decode step calls these kernels hundreds of
 * times, and a fresh allocation above glibc's mmap threshold costs page faults each call. */
typedef struct {
    float *data;
    size_t capacity;
} scratch_t;

static __thread scratch_t scratch_slots[5];

static float *scratch(int slot, size_t floats) {
    scratch_t *s = &scratch_slots[slot];
    if (floats == 0) floats = 1; /* an empty call (no rows) still gets a valid pointer */
    if (s->capacity < floats) {
        free(s->data);
        s->data = (float *)aligned_alloc(64, ((floats * 4 + 63) / 64) * 64);
        s->capacity = s->data ? floats : 0;
    }
    return s->data;
}

static void to_f32(const void *src, int bf16, long n, float *dst) {
    if (bf16) {
        const uint16_t *h = (const uint16_t *)src;
        for (long i = 0; i < n; i++) dst[i] = bf16_to_f32(h[i]);
    } else {
        memcpy(dst, src, n * 4);
    }
}

static void from_f32(const float *src, long n, void *dst, int bf16) {
    if (bf16) {
        uint16_t *h = (uint16_t *)dst;
        for (long i = 0; i < n; i++) h[i] = f32_to_bf16(src[i]);
    } else if ((const void *)src != dst) {
        memcpy(dst, src, n * 4);
    }
}

/* y [M, N] = x [M, K] @ W^T, W packed by tandem_pack. x and y are float32 or bfloat16
 * (x_bf16 / y_bf16), contiguous. Returns 0, or -1 when scratch could not be allocated. */
int tandem_linear(const void *x, int x_bf16, long M, long K, const void *packed, int w_bf16, long N, void *y,
                  int y_bf16) {
#if HAVE_AMX
    if (amx_layout(w_bf16)) {
        long Kp = amx_k(K);
        uint16_t *xb = (uint16_t *)scratch(0, (size_t)(M * Kp / 2 + 1));
        float *out = y_bf16 ? scratch(1, (size_t)(M * N)) : (float *)y;
        if (!xb || !out) return -1;
        rows_to_bf16(x, x_bf16, M, K, K, Kp, xb);
        gemm_amx(xb, M, Kp, (const uint16_t *)packed, N, out, N);
        if (y_bf16) from_f32(out, M * N, y, 1);
        return 0;
    }
#endif
    const float *xf = (const float *)x;
    if (x_bf16) {
        float *buf = scratch(0, (size_t)(M * K));
        if (!buf) return -1;
        to_f32(x, 1, M * K, buf);
        xf = buf;
    }
    float *out = (float *)y;
    if (y_bf16) {
        out = scratch(1, (size_t)(M * N));
        if (!out) return -1;
    }
    gemm_f32_out(xf, K, M, K, packed, w_bf16, N, out, N);
    if (y_bf16) from_f32(out, M * N, y, 1);
    return 0;
}

/* W [N, K] (row stride ldw, float32 or bfloat16) into panels [ceil(N/P), K, P], zero past N,
 * or for AMX the tiles gemm_amx reads; tandem_packed_elements(N, K, bf16) elements. */
void tandem_pack(const void *w, int bf16, long N, long K, long ldw, void *packed) {
    size_t esize = bf16 ? 2 : 4;
    int amx = amx_layout(bf16);
    long rows = panel_rows(K, bf16);
    memset(packed, 0, tandem_packed_elements(N, K, bf16) * esize);
    for (long n = 0; n < N; n++) {
        long p = n / PANEL, c = n % PANEL;
        for (long k = 0; k < K; k++) {
            size_t dst = (p * rows + k) * PANEL + c;
            if (amx) /* k-block, 16-column tile, k pair row, column, pair member */
                dst = p * rows * PANEL + (k / AMX_K) * AMX_K * PANEL + (c / 16) * 512 + (k % AMX_K / 2) * 32 + (c % 16) * 2 + k % 2;
            if (bf16)
                ((uint16_t *)packed)[dst] = ((const uint16_t *)w)[n * ldw + k];
            else
                ((float *)packed)[dst] = ((const float *)w)[n * ldw + k];
        }
    }
}

typedef int32_t vi __attribute__((vector_size(VL * 4)));

/* exp(x) for x <= 0 (a score less its row's maximum), within 3e-7 of expf relatively: x = n ln2 + r,
 * |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, 2^n into the exponent bits. Below
 * -87 it returns exp(-87) (~1e-38) where expf underflows towards 0: nothing a softmax sees. */
static inline vf exp_nonpositive(vf x) {
    const vf floor_x = (vf){0} - 87.0f;
    vi low = x < floor_x;
    x = (vf)(((vi)x & ~low) | ((vi)floor_x & low));
    vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi); /* round to nearest for x <= 0 */
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * 0.693145752f - nf * 1.42860677e-06f;
    vf p = (vf){0} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (vf)((n + 127) << 23);
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* The gated activation of n rows of h [n, 2I] (gate columns first), in place in the gate
 * columns: h[r, i] = silu(h[r, i]) * h[r, I + i], a vector at a time, the sigmoid from
 * e^-|x| (exp_nonpositive, within 3e-7 of expf) and one division, instead of an expf and a
 * division per element (benchmarks/kernel_ab.py: the experts in 0.6-0.87x the time in
 * bfloat16, 0.72-0.84x for the tiny Mixtral in float32; float32 at hidden 1024 is GEMM-bound). */
static void silu_and_mul(float *h, long n, long I) {
    const vf one = (vf){0} + 1.0f;
    for (long r = 0; r < n; r++) {
        float *g = h + r * 2 * I, *u = g + I;
        long i = 0;
        for (; i + VL <= I; i += VL) {
            vf x = load_f32(g + i);
            vf e = exp_nonpositive((vf)((vu)x | ((vu){0} + 0x80000000u))); /* e^-|x|: the sign bit set */
            vi positive = x >= (vf){0};
            vf high = one / (one + e), low = e * high;
            vf sigmoid = (vf)(((vi)high & positive) | ((vi)low & ~positive));
            *(vf_u *)(g + i) = x * sigmoid * load_f32(u + i);
        }
        for (; i < I; i++) g[i] = silu(g[i]) * u[i];
    }
}

/* The routed experts of one MoE layer for the rows of `x [T, K]`:
 *   y[t] = sum_j weights[t, j] * W2[e] (silu(W1g[e] x[t]) * W1u[e] x[t]),  e = ids[t, j],
 * W13[e] [2I, K] (gate rows first) and W2[e] [K, I] packed per expert by tandem_pack, experts
 * `expert_stride13` / `expert_stride2` elements apart. An id outside [0, E) (another rank's
 * expert) adds nothing. Each expert's rows are gathered once and run through both projections
 * while its weights stream once. Returns 0, or -1 when scratch could not be allocated. */
int tandem_moe(const void *x, int x_bf16, long T, long K, const int64_t *ids, const float *weights, long top_k,
               const void *w13, const void *w2, int w_bf16, long E, long I, long expert_stride13,
               long expert_stride2, void *y, int y_bf16) {
    size_t esize = w_bf16 ? 2 : 4;
    int amx = amx_layout(w_bf16); /* bfloat16 rows and activations into AMX tiles */
    long Kp = amx ? amx_k(K) : K, Ip = amx_k(I);
    long pairs = T * top_k;
    long *count = (long *)calloc(E + 2, sizeof(long));
    long *order = (long *)malloc((pairs > 0 ? pairs : 1) * sizeof(long));
    float *acc = scratch(0, (size_t)(T * K));
    float *rows = scratch(1, (size_t)(pairs * Kp));
    float *h = scratch(2, (size_t)(pairs * 2 * I));
    float *down = scratch(3, (size_t)(pairs * K));
    uint16_t *act = (uint16_t *)scratch(4, (size_t)(amx ? pairs * Ip / 2 + 1 : 1));
    if (!count || !order || !acc || !rows || !h || !down || !act) {
        free(count);
        free(order);
        return -1;
    }
    memset(acc, 0, T * K * sizeof(float));
    /* counting sort of the (row, slot) pairs by expert: count[e + 1] pairs go to expert e */
    for (long q = 0; q < pairs; q++)
        if (ids[q] >= 0 && ids[q] < E) count[ids[q] + 2]++;
    for (long e = 0; e < E; e++) count[e + 2] += count[e + 1];
    for (long q = 0; q < pairs; q++)
        if (ids[q] >= 0 && ids[q] < E) order[count[ids[q] + 1]++] = q;
    for (long e = 0; e < E; e++) {
        long first = count[e], n = count[e + 1] - first;
        if (!n) continue;
        const char *w13e = (const char *)w13 + e * expert_stride13 * esize;
        const char *w2e = (const char *)w2 + e * expert_stride2 * esize;
        for (long r = 0; r < n; r++) {
            const char *src = (const char *)x + (order[first + r] / top_k) * K * (x_bf16 ? 2 : 4);
            if (amx)
                rows_to_bf16(src, x_bf16, 1, K, K, Kp, (uint16_t *)rows + r * Kp);
            else
                to_f32(src, x_bf16, K, rows + r * K);
        }
#if HAVE_AMX
        if (amx) {
            gemm_amx((const uint16_t *)rows, n, Kp, (const uint16_t *)w13e, 2 * I, h, 2 * I);
            silu_and_mul(h, n, I);
            rows_to_bf16(h, 0, n, I, 2 * I, Ip, act);
            gemm_amx(act, n, Ip, (const uint16_t *)w2e, K, down, K);
        } else
#endif
        {
        gemm_f32_out(rows, K, n, K, w13e, w_bf16, 2 * I, h, 2 * I);
        silu_and_mul(h, n, I);
        /* the activations sit in the first I columns of each 2I-wide row of h */
        gemm_f32_out(h, 2 * I, n, I, w2e, w_bf16, K, down, K);
        }
        for (long r = 0; r < n; r++) {
            long q = order[first + r];
            float wt = weights[q];
            float *dst = acc + (q / top_k) * K, *src = down + r * K;
            for (long k = 0; k < K; k++) dst[k] += wt * src[k];
        }
    }
    from_f32(acc, T * K, y, y_bf16);
    free(count);
    free(order);
    return 0;
}

static inline float hsum(vf v) {
    /* pairwise halves: log2(VL) vector adds instead of VL - 1 dependent scalar adds */
    float lanes[VL];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = VL / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) lanes[i] += lanes[i + width];
    return lanes[0];
}

/* The four sums of s0..s3's lanes, each added in hsum's order (so the same bits), with a
 * transposing tree of shuffles on AVX-512 instead of four round trips through memory. */
static inline void sum4(vf s0, vf s1, vf s2, vf s3, float out[4]) {
#if VL == 16
    const vi lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    vf a = __builtin_shuffle(s0, s1, lo) + __builtin_shuffle(s0, s1, hi); /* s0's 8 partials, then s1's */
    vf b = __builtin_shuffle(s2, s3, lo) + __builtin_shuffle(s2, s3, hi);
    const vi lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    vf c = __builtin_shuffle(a, b, lo2) + __builtin_shuffle(a, b, hi2); /* 4 partials of each */
    const vi by2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    c += __builtin_shuffle(c, by2);
    const vi by1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    c += __builtin_shuffle(c, by1);
    out[0] = c[0], out[1] = c[4], out[2] = c[8], out[3] = c[12];
#else
    out[0] = hsum(s0), out[1] = hsum(s1), out[2] = hsum(s2), out[3] = hsum(s3);
#endif
}

/* Decode attention over a paged cache, read in place: one query row per request.
 *   out[r, h] = softmax_t(scale * q[r, h] . K[t]) V[t] over the first seq_lens[r] cached rows
 * of request r (row t in block table[r, t / block_size] at t % block_size), kv head h / G.
 * q [R, Hq, Dk] and out [R, Hq, Dv] contiguous; the caches are addressed by element strides
 * (block, row, head), so a value cache that views the key cache's first channels (MLA) works.
 * Rows are visited four at a time, walking the block table (no division per row): four dot
 * products per query head, then four value rows folded into the accumulators per pass.
 * Scores and sums stay float32; a request of length 0 gets zeros. Returns 0, -1 when scratch
 * could not be allocated, -2 when the query heads do not group over the KV heads. */

/* The next cached row of a request: `row` steps through block `blk` of the table row. The
 * same row of the block after it (`ahead`, NULL past the last) is prefetched as each row is
 * taken: a request's blocks lie anywhere in the cache, so the hardware prefetcher, which
 * follows one address stream, stalls at every block boundary, and a decode step reads the
 * cache once, cold (a 32-request batch read it at 9 GB/s of a 24 GB/s memory). */
#define NEXT_ROW(row, off, blk, base, ahead, cache, c_block, c_row, c_head)                         \
    do {                                                                                           \
        row = base + off * c_row;                                                                  \
        if (ahead) prefetch_span(ahead + off * c_row, span_bytes);                                 \
        if (++off == block_size) {                                                                 \
            off = 0;                                                                               \
            base = ahead;                                                                          \
            ahead = (++blk + 1) * block_size < len                                                 \
                        ? cache + (long)table[r * table_stride + blk + 1] * c_block + h * c_head   \
                        : NULL;                                                                    \
        }                                                                                          \
    } while (0)

/* The first block of a request's rows and the one after it (NULL when there is none). */
#define FIRST_BLOCKS(base, ahead, cache, c_block, c_row, c_head)                                          \
    do {                                                                                           \
        base = len ? cache + (long)table[r * table_stride] * c_block + h * c_head : cache;         \
        ahead = len > block_size ? cache + (long)table[r * table_stride + 1] * c_block + h * c_head : NULL; \
        for (long o = 0; o < block_size && o < len; o++) prefetch_span(base + o * c_row, span_bytes); \
    } while (0)

/* Scores of up to four query heads (GN, a constant after inlining) against four cached rows:
 * each key vector is loaded (and widened from bfloat16) once for all GN heads. Rows j >= n
 * are copies whose scores are set to 0 (weights of nothing in the value pass). */
#define DOTS(NAME, CTYPE, LOAD)                                                                     \
    static inline __attribute__((always_inline)) void NAME##_dots(                                 \
        const int GN, const CTYPE *const k[4], const float *qg, long Dk, long dk_vec, int n,       \
        float *sc, long stride, float *best) {                                                     \
        vf s[4][4];                                                                                \
        for (int g = 0; g < GN; g++)                                                               \
            for (int j = 0; j < 4; j++) s[g][j] = (vf){0};                                         \
        for (long d = 0; d < dk_vec; d += VL) {                                                    \
            vf k0 = LOAD(k[0] + d), k1 = LOAD(k[1] + d), k2 = LOAD(k[2] + d), k3 = LOAD(k[3] + d); \
            for (int g = 0; g < GN; g++) {                                                         \
                vf qv = load_f32(qg + g * Dk + d);                                                 \
                s[g][0] += qv * k0;                                                                \
                s[g][1] += qv * k1;                                                                \
                s[g][2] += qv * k2;                                                                \
                s[g][3] += qv * k3;                                                                \
            }                                                                                      \
        }                                                                                          \
        for (int g = 0; g < GN; g++) {                                                             \
            float v[4];                                                                            \
            sum4(s[g][0], s[g][1], s[g][2], s[g][3], v);                                           \
            for (long d = dk_vec; d < Dk; d++)                                                     \
                for (int j = 0; j < 4; j++) v[j] += qg[g * Dk + d] * LOAD##_scalar(k[j] + d);     \
            for (int j = 0; j < n; j++) {                                                          \
                sc[g * stride + j] = v[j];                                                         \
                if (v[j] > best[g]) best[g] = v[j];                                                \
            }                                                                                      \
            for (int j = n; j < 4; j++) sc[g * stride + j] = 0.0f;                                 \
        }                                                                                          \
    }

#define DECODE_ATTENTION(NAME, CTYPE, LOAD, STORE_OUT)                                              \
    static int NAME(const CTYPE *q, const CTYPE *kc, const CTYPE *vc, long k_block, long k_row,     \
                    long k_head, long v_block, long v_row, long v_head, const int32_t *table,       \
                    long table_stride, const int64_t *seq_lens, long R, long Hq, long Hkv, long Dk, \
                    long Dv, long block_size, float scale, CTYPE *out) {                           \
        long G = Hq / Hkv, max_len = 0;                                                            \
        for (long r = 0; r < R; r++) max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;      \
        long dk_vec = Dk - Dk % VL, dv_vec = Dv - Dv % VL;                                         \
        /* A work item is a request's KV heads h0 .. h0 + hc - 1: all of them when there are     \
         * requests enough to share out (a row's heads then stream in order), else one each. */ \
        long hc = R >= 8 ? Hkv : 1, chunks = Hkv / hc, HG = hc * G;                               \
        /* 3 spare scores per head: the last pass of four rows may run past len */                 \
        long stride = (max_len > 0 ? max_len : 1) + 3;                                             \
        int failed = 0;                                                                            \
        _Pragma("omp parallel for schedule(dynamic) reduction(|:failed)")                          \
        for (long item = 0; item < R * chunks; item++) {                                           \
            long r = item / chunks, h0 = item % chunks * hc, len = seq_lens[r];                    \
            float *scores = scratch(0, (size_t)(HG * stride));                                     \
            float *qf = scratch(1, (size_t)(HG * Dk));                                             \
            float *acc = scratch(2, (size_t)(HG * Dv));                                            \
            float *best = scratch(3, (size_t)HG);                                                  \
            if (!scores || !qf || !acc || !best) {                                                 \
                failed = 1;                                                                        \
                continue;                                                                          \
            }                                                                                      \
            const CTYPE *qh = q + (r * Hq + h0 * G) * Dk;                                          \
            for (long i = 0; i < HG * Dk; i++) qf[i] = (float)LOAD##_scalar(qh + i) * scale;       \
            for (long g = 0; g < HG; g++) best[g] = -INFINITY;                                     \
            long off = 0, blk = 0, h = h0;                                                         \
            /* the bytes of a row this item reads: its heads, contiguous in a row */               \
            long span_bytes = ((hc - 1) * k_head + Dk) * (long)sizeof(CTYPE);                     \
            const CTYPE *base, *ahead;                                                             \
            FIRST_BLOCKS(base, ahead, kc, k_block, k_row, k_head);                                        \
            for (long t0 = 0; t0 < len; t0 += 4) {                                                 \
                int n = len - t0 < 4 ? (int)(len - t0) : 4;                                        \
                const CTYPE *k[4] = {0};                                                           \
                for (int j = 0; j < n; j++) NEXT_ROW(k[j], off, blk, base, ahead, kc, k_block, k_row, k_head); \
                for (int j = n; j < 4; j++) k[j] = k[0];                                           \
                for (long hh = 0; hh < hc; hh++) {                                                 \
                    const CTYPE *kh[4] = {k[0] + hh * k_head, k[1] + hh * k_head, k[2] + hh * k_head, \
                                          k[3] + hh * k_head};                                     \
                    for (long g0 = 0; g0 < G; g0 += 4) {                                           \
                        long head = hh * G + g0;                                                   \
                        float *sc = scores + head * stride + t0, *bg = best + head;                \
                        const float *qg = qf + head * Dk;                                          \
                        switch (G - g0 < 4 ? G - g0 : 4) {                                         \
                            case 1: NAME##_dots(1, kh, qg, Dk, dk_vec, n, sc, stride, bg); break;  \
                            case 2: NAME##_dots(2, kh, qg, Dk, dk_vec, n, sc, stride, bg); break;  \
                            case 3: NAME##_dots(3, kh, qg, Dk, dk_vec, n, sc, stride, bg); break;  \
                            default: NAME##_dots(4, kh, qg, Dk, dk_vec, n, sc, stride, bg); break; \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            /* the value rows' first block is on its way while the softmax runs */                 \
            off = 0, blk = 0;                                                                      \
            span_bytes = ((hc - 1) * v_head + Dv) * (long)sizeof(CTYPE);                           \
            FIRST_BLOCKS(base, ahead, vc, v_block, v_row, v_head);                                        \
            for (long g = 0; g < HG; g++) {                                                        \
                float *sg = scores + g * stride;                                                   \
                vf totals = (vf){0};                                                               \
                long t = 0;                                                                        \
                for (; t + VL <= len; t += VL) {                                                   \
                    vf p = exp_nonpositive(load_f32(sg + t) - best[g]);                            \
                    *(vf_u *)(sg + t) = p;                                                         \
                    totals += p;                                                                   \
                }                                                                                  \
                float total = hsum(totals);                                                        \
                for (; t < len; t++) {                                                             \
                    float p = expf(sg[t] - best[g]);                                               \
                    sg[t] = p;                                                                     \
                    total += p;                                                                    \
                }                                                                                  \
                float inv = len ? 1.0f / total : 0.0f;                                             \
                for (t = 0; t < len; t++) sg[t] *= inv;                                            \
            }                                                                                      \
            for (long i = 0; i < HG * Dv; i++) acc[i] = 0.0f;                                      \
            for (long t0 = 0; t0 < len; t0 += 4) {                                                 \
                int n = len - t0 < 4 ? (int)(len - t0) : 4;                                        \
                const CTYPE *v[4] = {0};                                                           \
                for (int j = 0; j < n; j++) NEXT_ROW(v[j], off, blk, base, ahead, vc, v_block, v_row, v_head); \
                for (int j = n; j < 4; j++) v[j] = v[0]; /* weighted by the 0 scores past len */   \
                for (long hh = 0; hh < hc; hh++) {                                                 \
                    const CTYPE *v0p = v[0] + hh * v_head, *v1p = v[1] + hh * v_head,              \
                                *v2p = v[2] + hh * v_head, *v3p = v[3] + hh * v_head;              \
                    for (long d = 0; d < dv_vec; d += VL) {                                        \
                        vf v0 = LOAD(v0p + d), v1 = LOAD(v1p + d), v2 = LOAD(v2p + d), v3 = LOAD(v3p + d); \
                        for (long g = 0; g < G; g++) {                                             \
                            const float *p = scores + (hh * G + g) * stride + t0;                  \
                            vf_u *a = (vf_u *)(acc + (hh * G + g) * Dv + d);                       \
                            *a += p[0] * v0 + p[1] * v1 + p[2] * v2 + p[3] * v3;                   \
                        }                                                                          \
                    }                                                                              \
                    for (long d = dv_vec; d < Dv; d++)                                             \
                        for (long g = 0; g < G; g++) {                                             \
                            const float *p = scores + (hh * G + g) * stride + t0;                  \
                            acc[(hh * G + g) * Dv + d] += p[0] * LOAD##_scalar(v0p + d) + p[1] * LOAD##_scalar(v1p + d) \
                                                        + p[2] * LOAD##_scalar(v2p + d) + p[3] * LOAD##_scalar(v3p + d); \
                        }                                                                          \
                }                                                                                  \
            }                                                                                      \
            CTYPE *o = out + (r * Hq + h0 * G) * Dv;                                               \
            for (long i = 0; i < HG * Dv; i++) o[i] = STORE_OUT(acc[i]);                           \
        }                                                                                          \
        return failed ? -1 : 0;                                                                    \
    }

static inline float load_f32_scalar(const float *p) { return *p; }
static inline float load_bf16_scalar(const uint16_t *p) { return bf16_to_f32(*p); }
static inline float keep_f32(float v) { return v; }

DOTS(decode_attention_f32, float, load_f32)
DOTS(decode_attention_bf16, uint16_t, load_bf16)
DECODE_ATTENTION(decode_attention_f32, float, load_f32, keep_f32)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, load_bf16, f32_to_bf16)

int tandem_decode_attention(const void *q, const void *kc, const void *vc, int bf16, long k_block, long k_row,
                            long k_head, long v_block, long v_row, long v_head, const int32_t *table,
                            long table_stride, const int64_t *seq_lens, long R, long Hq, long Hkv, long Dk,
                            long Dv, long block_size, float scale, void *out) {
    if (Hkv <= 0 || Hq % Hkv) return -2;
    if (bf16)
        return decode_attention_bf16(q, kc, vc, k_block, k_row, k_head, v_block, v_row, v_head, table, table_stride,
                                     seq_lens, R, Hq, Hkv, Dk, Dv, block_size, scale, out);
    return decode_attention_f32(q, kc, vc, k_block, k_row, k_head, v_block, v_row, v_head, table, table_stride,
                                seq_lens, R, Hq, Hkv, Dk, Dv, block_size, scale, out);
}

/* The rounding of a float32 to bfloat16 and back (round to nearest even, NaN kept quiet), a
 * vector at a time: what torch does after each bfloat16 op. */
static inline __attribute__((always_inline)) vf vround_bf16(vf x) {
    vu u = (vu)x;
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    vu quiet = (u | 0x400000u) & 0xffff0000u;
    return (vf)((rounded & ~nan) | (quiet & nan));
}

static inline __attribute__((always_inline)) vf vkeep(vf x) { return x; }

static inline __attribute__((always_inline)) void store_f32(float *p, vf v) { *(vf_u *)p = v; }

/* v must already be rounded (vround_bf16): its high halves are the bfloat16 values. */
static inline __attribute__((always_inline)) void store_bf16(uint16_t *p, vf v) {
    *(vh_u *)p = __builtin_convertvector((vu)v >> 16, vh);
}

/* Rotary embedding and the cache write of one attention layer, in one pass over the step's rows:
 *   q_out[t, h] = rotate(q[t, h]),  k_cache[slots[t], h] = rotate(k[t, h]),  v_cache[slots[t], h] = v[t, h]
 * at the angles of row positions[t] of `table` (float32 [P, D]: cos in the first D/2 columns, sin
 * in the rest). Pairs are (x[i], x[i + D/2]) or, `interleaved`, (x[2i], x[2i+1]) written back
 * de-interleaved. Rows t >= S or with slots[t] < 0 write nothing; v may be NULL (no copy).
 * Element strides for q, k, v (token, head) and both caches (block, row, head); the last
 * dimension of each is contiguous. The arithmetic is the torch path's, rounding where it rounds
 * (cos and sin to the dtype, then each product, then the sum) and never fusing a multiply-add,
 * so both paths give the same bits. Returns 0, -3 for a position outside the table, -4 for a
 * slot outside the cache. */
#define ROPE_AND_CACHE(NAME, CTYPE, TO_F, ROUND, FROM_F, VLOAD, VROUND, VSTORE)                                                 \
    __attribute__((optimize("fp-contract=off"))) static int NAME(                                     \
        const CTYPE *q, long q_tok, long q_head, const CTYPE *k, long k_tok, long k_head,             \
        const CTYPE *v, long v_tok, long v_head, const int64_t *positions, const float *table,        \
        long P, long T, long Hq, long Hk, long D, int interleaved, const int64_t *slots, long S,       \
        long cache_slots, CTYPE *kc, long kc_block, long kc_row, long kc_head, CTYPE *vc,             \
        long vc_block, long vc_row, long vc_head, long Hv, long Dv, long block_size, CTYPE *q_out) {  \
        long half = D / 2;                                                                             \
        int bad = 0;                                                                                   \
        _Pragma("omp parallel for schedule(static) reduction(|:bad) if (T * (Hq + Hk) * D >= (1L << 16))") \
        for (long t = 0; t < T; t++) {                                                                 \
            int64_t pos = positions[t];                                                                \
            if (pos < 0 || pos >= P) {                                                                 \
                bad |= 1;                                                                              \
                continue;                                                                              \
            }                                                                                          \
            int64_t slot = t < S ? slots[t] : -1;                                                      \
            if (slot >= cache_slots) {                                                                 \
                bad |= 2;                                                                              \
                continue;                                                                              \
            }                                                                                          \
            const float *cs = table + pos * D;                                                         \
            for (long h = 0; h < Hq + (slot >= 0 ? Hk : 0); h++) {                                    \
                const CTYPE *x = h < Hq ? q + t * q_tok + h * q_head : k + t * k_tok + (h - Hq) * k_head; \
                CTYPE *o = h < Hq ? q_out + (t * Hq + h) * D                                           \
                                  : kc + (slot / block_size) * kc_block + (slot % block_size) * kc_row \
                                        + (h - Hq) * kc_head;                                          \
                long i = 0;                                                                            \
                if (!interleaved)                                                                      \
                    for (; i + VL <= half; i += VL) {                                                  \
                        vf a = VLOAD(x + i), b = VLOAD(x + half + i);                                  \
                        vf c = VROUND(load_f32(cs + i)), s = VROUND(load_f32(cs + half + i));          \
                        vf ac = VROUND(a * c), bs = VROUND(b * s), bc = VROUND(b * c), as = VROUND(a * s); \
                        VSTORE(o + i, VROUND(ac - bs));                                                \
                        VSTORE(o + half + i, VROUND(bc + as));                                         \
                    }                                                                                  \
                for (; i < half; i++) {                                                                \
                    float a = TO_F(x[interleaved ? 2 * i : i]);                                        \
                    float b = TO_F(x[interleaved ? 2 * i + 1 : half + i]);                             \
                    float c = ROUND(cs[i]), s = ROUND(cs[half + i]);                                   \
                    float ac = ROUND(a * c), bs = ROUND(b * s), bc = ROUND(b * c), as = ROUND(a * s);   \
                    o[i] = FROM_F(ac - bs);                                                            \
                    o[half + i] = FROM_F(bc + as);                                                     \
                }                                                                                      \
            }                                                                                          \
            if (v && slot >= 0)                                                                        \
                for (long h = 0; h < Hv; h++)                                                          \
                    memcpy(vc + (slot / block_size) * vc_block + (slot % block_size) * vc_row + h * vc_head, \
                           v + t * v_tok + h * v_head, Dv * sizeof(CTYPE));                             \
        }                                                                                              \
        return bad & 1 ? -3 : bad ? -4 : 0;                                                            \
    }

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

ROPE_AND_CACHE(rope_and_cache_f32, float, keep_f32, keep_f32, keep_f32, load_f32, vkeep, store_f32)
ROPE_AND_CACHE(rope_and_cache_bf16, uint16_t, bf16_to_f32, round_bf16, f32_to_bf16, load_bf16, vround_bf16, store_bf16)

int tandem_rope_and_cache(const void *q, long q_tok, long q_head, const void *k, long k_tok, long k_head,
                          const void *v, long v_tok, long v_head, int bf16, const int64_t *positions,
                          const float *table, long P, long T, long Hq, long Hk, long D, int interleaved,
                          const int64_t *slots, long S, long cache_slots, void *kc, long kc_block, long kc_row,
                          long kc_head, void *vc, long vc_block, long vc_row, long vc_head, long Hv, long Dv,
                          long block_size, void *q_out) {
    if (bf16)
        return rope_and_cache_bf16(q, q_tok, q_head, k, k_tok, k_head, v, v_tok, v_head, positions, table, P, T, Hq,
                                   Hk, D, interleaved, slots, S, cache_slots, kc, kc_block, kc_row, kc_head, vc,
                                   vc_block, vc_row, vc_head, Hv, Dv, block_size, q_out);
    return rope_and_cache_f32(q, q_tok, q_head, k, k_tok, k_head, v, v_tok, v_head, positions, table, P, T, Hq, Hk,
                              D, interleaved, slots, S, cache_slots, kc, kc_block, kc_row, kc_head, vc, vc_block,
                              vc_row, vc_head, Hv, Dv, block_size, q_out);
}

/* RMSNorm of the rows of x [M, H] (row stride x_row), optionally after the residual add:
 *   s = x + residual (rounded to the dtype, written to res_out [M, H]) or s = x,
 *   out [M, H] = weight * dtype(s / sqrt(mean(s^2) + eps))
 * as torch does it: normalised in float32, cast to the dtype, then scaled by the weight. */
#define RMS_NORM(NAME, CTYPE, LOAD, TO_F, FROM_F)                                                       \
    static void NAME(const CTYPE *x, long x_row, const CTYPE *residual, long r_row, CTYPE *res_out,  \
                     const CTYPE *w, long M, long H, float eps, CTYPE *out) {                       \
        _Pragma("omp parallel for schedule(static) if (M * H >= (1L << 16))")                       \
        for (long m = 0; m < M; m++) {                                                              \
            const CTYPE *xr = x + m * x_row;                                                        \
            CTYPE *o = out + m * H;                                                                 \
            if (residual) {                                                                         \
                const CTYPE *rr = residual + m * r_row;                                             \
                CTYPE *s = res_out + m * H;                                                         \
                for (long i = 0; i < H; i++) s[i] = FROM_F(TO_F(xr[i]) + TO_F(rr[i]));              \
                xr = s;                                                                             \
            }                                                                                       \
            vf sv = (vf){0};                                                                        \
            long i = 0;                                                                             \
            for (; i + VL <= H; i += VL) {                                                          \
                vf v = LOAD(xr + i);                                                                \
                sv += v * v;                                                                        \
            }                                                                                       \
            float ss = hsum(sv);                                                                    \
            for (; i < H; i++) ss += TO_F(xr[i]) * TO_F(xr[i]);                                     \
            float inv = 1.0f / sqrtf(ss / (float)H + eps);                                          \
            for (i = 0; i < H; i++) o[i] = FROM_F(TO_F(FROM_F(TO_F(xr[i]) * inv)) * TO_F(w[i]));     \
        }                                                                                           \
    }

RMS_NORM(rms_norm_f32, float, load_f32, keep_f32, keep_f32)
RMS_NORM(rms_norm_bf16, uint16_t, load_bf16, bf16_to_f32, f32_to_bf16)

void tandem_rms_norm(const void *x, long x_row, const void *residual, long r_row, void *res_out, const void *w,
                     int bf16, long M, long H, float eps, void *out) {
    if (bf16)
        rms_norm_bf16(x, x_row, residual, r_row, res_out, w, M, H, eps, out);
    else
        rms_norm_f32(x, x_row, residual, r_row, res_out, w, M, H, eps, out);
}

/* Softmax routing of a MoE layer: for each row of logits [T, E] (float32 or bfloat16), the top
 * `K` experts by logit (the softmax keeps the order; ties go to the lower expert, where
 * torch.topk leaves their order unset), their softmax probabilities computed in float32, renormalised to sum to 1
 * when `renormalize`. weights [T, K] float32, ids [T, K] int64, best first. */
void tandem_topk_softmax(const void *logits, int bf16, long T, long E, long K, int renormalize, float *weights,
                         int64_t *ids) {
#pragma omp parallel for schedule(static) if (T * E >= (1L << 16))
    for (long t = 0; t < T; t++) {
        float row[E];
        for (long e = 0; e < E; e++)
            row[e] = bf16 ? bf16_to_f32(((const uint16_t *)logits)[t * E + e]) : ((const float *)logits)[t * E + e];
        float top = -INFINITY;
        for (long e = 0; e < E; e++) top = row[e] > top ? row[e] : top;
        float total = 0.0f;
        for (long e = 0; e < E; e++) total += expf(row[e] - top);
        float *w = weights + t * K;
        int64_t *id = ids + t * K;
        for (long j = 0; j < K; j++) {
            long pick = -1;
            for (long e = 0; e < E; e++) {
                int taken = 0;
                for (long i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (pick < 0 || row[e] > row[pick])) pick = e;
            }
            id[j] = pick;
            w[j] = expf(row[pick] - top) / total;
        }
        if (renormalize) {
            float sum = 0.0f;
            for (long j = 0; j < K; j++) sum += w[j];
            for (long j = 0; j < K; j++) w[j] /= sum;
        }
    }
}

/* The first maximum of row[0 .. V): a vector maximum, then the first lane that holds it. */
static long first_max(const float *row, long V) {
    float top = row[0];
    long v = 0;
    if (V >= VL) {
        vf m = load_f32(row);
        for (v = VL; v + VL <= V; v += VL) {
            vf x = load_f32(row + v);
            vi greater = x > m;
            m = (vf)(((vi)x & greater) | ((vi)m & ~greater));
        }
        for (int i = 0; i < VL; i++) top = m[i] > top ? m[i] : top;
    }
    for (; v < V; v++) top = row[v] > top ? row[v] : top;
    for (v = 0; v < V; v++)
        if (row[v] == top) return v;
    return 0; /* a row of NaN */
}

/* A token for each of R rows of float32 logits [R, V] (row stride ld). Row r is drawn by
 * inverse CDF from softmax(logits[r] / temperature[r]) at uniform[r] in [0, 1): the first
 * token whose cumulative mass passes uniform * total, which stays below the total. The mass is
 * summed in vector-wide chunks (each chunk's sum in float, the chunks' in double) and searched
 * chunk by chunk; a search that rounding carries past its chunk takes the chunk's last token
 * with mass, so the token drawn always has mass. Scores more than 87 below the row's best get
 * none (expf would give a denormal). A row with temperature <= 0, or whose mass is not finite
 * (a temperature so small the scores overflow), takes its first maximum: greedy. Returns 0, or
 * -1 when scratch could not be allocated. */
int tandem_sample(const float *logits, long R, long V, long ld, const float *temperature, const double *uniform,
                  int64_t *out) {
    long chunks = (V + VL - 1) / VL;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(|:failed) if (R * V >= (1L << 16))
    for (long r = 0; r < R; r++) {
        const float *row = logits + r * ld;
        long best = first_max(row, V);
        out[r] = best;
        float t = temperature[r];
        if (!(t > 0.0f)) continue;
        float *mass = scratch(0, (size_t)(chunks * VL));
        double *sums = (double *)scratch(1, (size_t)(2 * chunks));
        if (!mass || !sums) {
            failed = 1;
            continue;
        }
        float top = row[best] / t;
        double total = 0.0;
        for (long c = 0; c < chunks; c++) {
            long v = c * VL;
            vf x;
            if (v + VL <= V) {
                x = load_f32(row + v) / t - top;
            } else {
                for (int i = 0; i < VL; i++) x[i] = v + i < V ? row[v + i] / t - top : -INFINITY;
            }
            vf e = (vf)((vi)exp_nonpositive(x) & ~(vi)(x < -87.0f));
            *(vf_u *)(mass + v) = e;
            sums[c] = hsum(e);
            total += sums[c];
        }
        if (!isfinite(total) || !(total > 0.0)) continue;
        double target = uniform[r] * total, seen = 0.0;
        long c = 0;
        while (c < chunks - 1 && seen + sums[c] <= target) seen += sums[c++];
        long pick = -1;
        for (long v = c * VL; v < (c + 1) * VL && v < V; v++) {
            if (mass[v] > 0.0f) pick = v;
            seen += mass[v];
            if (seen > target && pick == v) break;
        }
        if (pick >= 0) out[r] = pick;
    }
    return failed ? -1 : 0;
}
