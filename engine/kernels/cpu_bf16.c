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

/* x rounded to bfloat16 (as torch's .bfloat16(): nearest even) */
static void round_bf16(const float *x, long n, uint16_t *xb) {
    long i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++) xb[i] = f32_to_bf16(x[i]);
}

/* x float32 [M, K] contiguous */
static int bf16_matmul(const float *x, int M, int K, const uint16_t *w, int N, float *y) {
    uint16_t *xb = amalloc(sizeof(uint16_t) * (long)M * K);
    if (!xb) return 1;
    round_bf16(x, (long)M * K, xb);
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
