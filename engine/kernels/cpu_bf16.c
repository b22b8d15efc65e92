/* y [M, N] float32 = x [M, K] @ W.T with W held in bfloat16 [N, K] (the copies
 * engine/quant/amx.py keeps for batches of many rows), for the decode plan's batched steps
 * (cpu_step.c; the layer path multiplies by the same copies through oneDNN).
 *
 * x is rounded to bfloat16 once per call (round to nearest even, as torch's .bfloat16()),
 * then each 4 rows of W meet up to 4 rows of x in 16 accumulators of vdpbf16ps: the products
 * of two bfloat16 values are exact in float32, summed in float32. The output stays float32
 * (oneDNN rounds its own to bfloat16). K in runs of 32 (a masked load for the remainder);
 * N % 4 and a CPU without AVX512_BF16 take the scalar loop. One thread. Returns 1 when
 * scratch memory cannot be had.
 */

int pd_bf16_native(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void bf16_block4(
        const uint16_t *x, int K, const uint16_t *w, int mr, float *y, long N) {
    __m512 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 4; r++) a[i][r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __mmask32 m = K - k >= 32 ? 0xffffffffu : (1u << (K - k)) - 1;
        __m512i wv[4];
        for (int r = 0; r < 4; r++) {
            _mm_prefetch((const char *)(w + (long)(r + 8) * K + k), _MM_HINT_T0);
            wv[r] = _mm512_maskz_loadu_epi16(m, w + (long)r * K + k);
        }
        for (int i = 0; i < mr; i++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + (long)i * K + k);
            for (int r = 0; r < 4; r++) a[i][r] = _mm512_dpbf16_ps(a[i][r], xv, (__m512bh)wv[r]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < 4; r++) y[(long)i * N + r] = _mm512_reduce_add_ps(a[i][r]);
}
#endif

/* columns [n0, n1) of xb @ W.T into y0 [M, n1 - n0], rows ldy apart; xb [M, K] bfloat16 */
static void bf16_matmul_cols(const uint16_t *xb, int M, int K, const uint16_t *w, int n0, int n1,
                             float *y0, long ldy) {
    int n = n0;
#if defined(__AVX512BF16__)
    for (; n + 4 <= n1; n += 4) {
        const uint16_t *wn = w + (long)n * K;
        float *y = y0 + (n - n0);
        int i = 0;
        for (; i + 4 <= M; i += 4) bf16_block4(xb + (long)i * K, K, wn, 4, y + i * ldy, ldy);
        if (M - i == 3) bf16_block4(xb + (long)i * K, K, wn, 3, y + i * ldy, ldy);
        else if (M - i == 2) bf16_block4(xb + (long)i * K, K, wn, 2, y + i * ldy, ldy);
        else if (M - i == 1) bf16_block4(xb + (long)i * K, K, wn, 1, y + i * ldy, ldy);
    }
#endif
    for (; n < n1; n++)
        for (int i = 0; i < M; i++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += bf16_to_f32(xb[(long)i * K + k]) * bf16_to_f32(w[(long)n * K + k]);
            y0[i * ldy + (n - n0)] = s;
        }
}

/* The same product on the AMX tiles (TDPBF16PS), for batches of pd_bf16_tile_rows rows or
 * more where the CPU has them and the kernel lets this process use them (Linux:
 * arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA), asked once). Computed transposed, y.T = W x.T,
 * so that the big operand, W, is read as it is stored: an A tile is 16 weight rows of 32
 * values straight from [N, K]; the small one, x, is repacked once per linear into B tiles
 * (pack_tiles: pairs of K for 16 rows of x, zero past M). 2 x 2 output tiles (32
 * weight rows, 32 rows of x) at a time, 16 x 16 float32 each, summed in float32 over K.
 * Needs K % 32 == 0; the last N % 16 columns take the dot-product kernel above. Each call
 * loads the tile configuration on its own thread and releases the tiles after. */
int pd_bf16_tile_rows = 8;      /* 0: never the tiles (bench/cpu_step.py compares); from 8 rows
                                 * they are 2x the dot products here, 1.1x at 4 */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define PD_AMX 1
static _Atomic int amx_state;   /* 0: not asked, 1: granted, -1: refused */

static int amx_ready(void) {
    if (!amx_state)             /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: the whole process */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return amx_state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tiles 0-3: y.T blocks (n, m), (n, m+1), (n+1, m), (n+1, m+1); 4-5: W rows n, n+1; 6-7: x */
static void tile_configure(void) {
    _Alignas(64) tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* out[16 x 16] (row i: weight row n + i, column j: x row m + j) -> y[m + j][n + i - n0] */
static void tile_store(float *buf, float *y0, long ldy, int n, int n0, int m, int M) {
    int mj = M - m < 16 ? M - m : 16;
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < mj; j++) y0[(long)(m + j) * ldy + (n - n0 + i)] = buf[i * 16 + j];
}

#define TILE_PASS(NA, NB)                                                                   \
    for (int kb = 0; kb < KB; kb++) {                                                      \
        _tile_loadd(4, w + (long)n * K + kb * 32, 2 * K);                                  \
        if (NA > 1) _tile_loadd(5, w + (long)(n + 16) * K + kb * 32, 2 * K);              \
        _tile_loadd(6, xv + ((long)(mb * KB + kb) << 9), 64);                              \
        if (NB > 1) _tile_loadd(7, xv + ((long)((mb + 1) * KB + kb) << 9), 64);           \
        _tile_dpbf16ps(0, 4, 6);                                                           \
        if (NB > 1) _tile_dpbf16ps(1, 4, 7);                                               \
        if (NA > 1) _tile_dpbf16ps(2, 5, 6);                                               \
        if (NA > 1 && NB > 1) _tile_dpbf16ps(3, 5, 7);                                     \
    }

static void tile_matmul_cols(const uint16_t *xv, const uint16_t *xb, int M, int K, const uint16_t *w,
                             int n0, int n1, float *y0, long ldy) {
    _Alignas(64) float buf[4][256];
    int KB = K / 32, MB = (M + 15) / 16, n = n0;
    tile_configure();
    for (; n + 16 <= n1; n += 32) {
        int na = n + 32 <= n1 ? 2 : 1;
        for (int mb = 0; mb < MB; mb += 2) {
            int nb = mb + 1 < MB ? 2 : 1;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            if (na == 2 && nb == 2) { TILE_PASS(2, 2) }
            else if (na == 2) { TILE_PASS(2, 1) }
            else if (nb == 2) { TILE_PASS(1, 2) }
            else { TILE_PASS(1, 1) }
            _tile_stored(0, buf[0], 64); _tile_stored(1, buf[1], 64);
            _tile_stored(2, buf[2], 64); _tile_stored(3, buf[3], 64);
            for (int a = 0; a < na; a++)
                for (int b = 0; b < nb; b++)
                    tile_store(buf[2 * a + b], y0, ldy, n + 16 * a, n0, 16 * (mb + b), M);
        }
        if (na == 1) { n += 16; break; }
    }
    _tile_release();
    if (n < n1) bf16_matmul_cols(xb, M, K, w, n, n1, y0 + (n - n0), ldy);
}
#undef TILE_PASS
#else
#define PD_AMX 0
static int amx_ready(void) { return 0; }
static void tile_matmul_cols(const uint16_t *xv, const uint16_t *xb, int M, int K, const uint16_t *w,
                             int n0, int n1, float *y0, long ldy) {
    (void)xv;
    bf16_matmul_cols(xb, M, K, w, n0, n1, y0, ldy);
}
#endif

/* whether a linear of M rows and inner size K multiplies on the tiles */
static int bf16_tiles(int M, int K) {
    return PD_AMX && pd_bf16_tile_rows > 0 && M >= pd_bf16_tile_rows && K % 32 == 0 && amx_ready();
}

int pd_bf16_tiles_usable(void) { return PD_AMX && amx_ready(); }

/* xb [M, K] bfloat16 -> xv, the B tiles: tile (mb, kb) at xv + (mb * K/32 + kb) * 512, its row
 * r the pairs (x[16 mb + j][32 kb + 2r], x[16 mb + j][32 kb + 2r + 1]) for j = 0..15 (0 past M) */
static void pack_tiles(const uint16_t *xb, int M, int K, uint16_t *xv) {
    int KB = K / 32, MB = (M + 15) / 16;
    uint32_t *out = (uint32_t *)xv;
    for (int mb = 0; mb < MB; mb++)
        for (int kb = 0; kb < KB; kb++) {
            uint32_t *t = out + ((long)(mb * KB + kb) << 8);
            for (int j = 0; j < 16; j++) {
                int m = 16 * mb + j;
                const uint32_t *row = (const uint32_t *)(xb + (long)m * K + 32 * kb);
                for (int r = 0; r < 16; r++) t[r * 16 + j] = m < M ? row[r] : 0;
            }
        }
}

/* x rounded to bfloat16 (as torch's .bfloat16(): nearest even) */
static void round_bf16(const float *x, long n, uint16_t *xb) {
    long i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++) xb[i] = f32_to_bf16(x[i]);
}

/* bfloat16 values the operand of x [M, K] takes (bf16_operand): xb, and with `tiles` its
 * B tiles from the next 64-byte line */
static long bf16_operand_size(int M, int K, int tiles) {
    return (long)M * K + (tiles ? 32 + (long)(M + 15) / 16 * 16 * K : 0);
}

/* x rounded into xb [M, K]; with `tiles` also packed as B tiles after it (bf16_operand_size):
 * returns those, or NULL */
static uint16_t *bf16_operand(const float *x, int M, int K, uint16_t *xb, int tiles) {
    round_bf16(x, (long)M * K, xb);
    if (!tiles) return NULL;
    uint16_t *xv = xb + ((long)M * K + 31) / 32 * 32;
    pack_tiles(xb, M, K, xv);
    return xv;
}

/* x float32 [M, K] contiguous */
static int bf16_matmul(const float *x, int M, int K, const uint16_t *w, int N, float *y) {
    int tiles = bf16_tiles(M, K);
    uint16_t *xb = amalloc(sizeof(uint16_t) * bf16_operand_size(M, K, tiles));
    if (!xb) return 1;
    uint16_t *xv = bf16_operand(x, M, K, xb, tiles);
    if (xv)
        tile_matmul_cols(xv, xb, M, K, w, 0, N, y, N);
    else
        bf16_matmul_cols(xb, M, K, w, 0, N, y, N);
    free(xb);
    return 0;
}

int pd_bf16_matmul(const void *x, int xdt, int M, int K, const uint16_t *w, int N, float *y) {
    if (xdt == F32) return bf16_matmul(x, M, K, w, N, y);
    float *xf = amalloc(sizeof(float) * (long)M * K);
    if (!xf) return 1;
    for (long i = 0; i < (long)M * K; i++) xf[i] = ld(x, xdt, i);
    int status = bf16_matmul(xf, M, K, w, N, y);
    free(xf);
    return status;
}
