/* int4 weight-only matmul for the CPU: y [M, N] float32 = x [M, K] @ W.T, with W held as
 * 4-bit codes and a float16 scale and min per group of g values along K (g = 32 or 128):
 *
 *     W[n, k] = q[n, k] * scale[n, k / g] + min[n, k / g]        q in 0..15
 *
 * Layout (engine/quant/int4.py Int4Cpu): codes [N, K/2] bytes, each run of 32 values of a
 * row in 16 bytes, byte j holding value j in its low nibble and value j + 16 in its high one
 * (GGUF's Q4 order: one 16-byte load widens to two vectors of 16 consecutive values);
 * scale and min [N, K/g] float16, as the checkpoint stored them.
 *
 * The arithmetic is float32 throughout: each weight is exactly q * scale + min as
 * reference.dequantize_int4 computes it, x is never rounded to bfloat16 (torch's int4 kernel
 * rounds x, its scales and its output to bfloat16: ~2^-9 relative per value, this ~2^-24).
 * Two forms, by the rows of x:
 *
 *   M <= 2   factored: y = sum_g scale_g * (sum_j q_j x_j) + sum_g min_g * (sum_j x_j), the
 *            codes turned to floats by a 16-entry table (vpermps) and multiplied as they are;
 *            the per-group sums of x once per call. Bound by reading the codes (one-row
 *            decode: the whole model's weights cross memory once a token).
 *   M >= 3   each 4 rows of W dequantized once per 32 values and multiplied into up to 4
 *            rows of x at a time (16 accumulators in registers).
 *
 * Both sum in another order than the reference (within float32 rounding of it). Four rows
 * of W at a time with AVX-512; a remainder of N % 4 rows and machines without AVX-512 take
 * the scalar loop (cpu.py only builds this layout where AVX-512 is compiled in:
 * pd_int4_avx512). One thread. Returns 1 when scratch memory cannot be had.
 */

/* IEEE half -> float (exact), without F16C */
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, u;
    if (e == 31) u = sign | 0x7f800000u | (m << 13);                  /* inf, NaN */
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);              /* normal */
    else if (!m) u = sign;                                             /* zero */
    else {                                                             /* subnormal */
        float f = (float)m * (1.0f / 16777216.0f);                     /* m * 2^-24, exact */
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void f16_to_f32(const uint16_t *h, float *f, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#endif
    for (; i < n; i++) f[i] = h2f(h[i]);
}

int pd_int4_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* one row n of W against one row x: the reference order of operations per value */
static float int4_dot(const float *x, const uint8_t *w, const uint16_t *sc, const uint16_t *mn,
                      int K, int g) {
    float s = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 32) {
        float d = h2f(sc[k0 / g]), m = h2f(mn[k0 / g]);
        const uint8_t *b = w + k0 / 2;
        for (int j = 0; j < 16; j++) {
            s += x[k0 + j] * ((float)(b[j] & 15) * d + m);
            s += x[k0 + j + 16] * ((float)(b[j] >> 4) * d + m);
        }
    }
    return s;
}

#if defined(__AVX512F__)
/* the codes of 4 rows of W at values k .. k + 31, as floats: lo = values k .. k + 15 (the low
 * nibbles of each row's 16 bytes), hi = k + 16 .. k + 31, through a 16-entry table (vpermps);
 * the rows two blocks on prefetched */
static inline __attribute__((always_inline)) void int4_codes4(const uint8_t *w, long row, int k,
                                                              __m512 lo[4], __m512 hi[4]) {
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int r = 0; r < 4; r++) {
        const uint8_t *wr = w + r * row + k / 2;
        _mm_prefetch((const char *)(wr + 8 * row), _MM_HINT_T0);
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)wr));
        lo[r] = _mm512_permutexvar_ps(b, lut);
        hi[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
    }
}

/* M <= 2 (mr rows of x), 4 rows of W: the factored form. sc/mn: this block's 4 rows of
 * scales and mins, float32 [4, G]; xs: per-group sums of x [mr, G]. */
static inline __attribute__((always_inline)) void int4_gemv4(
        const float *x, const float *xs, int K, int g, const uint8_t *w, const float *sc,
        const float *mn, int mr, float *y, long N) {
    int G = K / g;
    __m512 a[2][4];
    for (int i = 0; i < 2; i++)
        for (int r = 0; r < 4; r++) a[i][r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        int gi = k / g;
        __m512 lo[4], hi[4];
        int4_codes4(w, K / 2, k, lo, hi);
        for (int i = 0; i < mr; i++) {
            __m512 x0 = _mm512_loadu_ps(x + (long)i * K + k), x1 = _mm512_loadu_ps(x + (long)i * K + k + 16);
            for (int r = 0; r < 4; r++)
                a[i][r] = _mm512_fmadd_ps(_mm512_fmadd_ps(hi[r], x1, _mm512_mul_ps(lo[r], x0)),
                                          _mm512_set1_ps(sc[r * G + gi]), a[i][r]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < 4; r++) {
            float t = 0.0f;
            for (int q = 0; q < G; q++) t += mn[r * G + q] * xs[i * G + q];
            y[(long)i * N + r] = _mm512_reduce_add_ps(a[i][r]) + t;
        }
}

/* M >= 3: 4 rows of W dequantized per 32 values, times mr <= 4 rows of x */
static inline __attribute__((always_inline)) void int4_block4(
        const float *x, int K, int g, const uint8_t *w, const float *sc, const float *mn,
        int mr, float *y, long N) {
    int G = K / g;
    __m512 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 4; r++) a[i][r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        int gi = k / g;
        __m512 lo[4], hi[4];
        int4_codes4(w, K / 2, k, lo, hi);
        for (int r = 0; r < 4; r++) {                  /* the weights: code * scale + min */
            __m512 d = _mm512_set1_ps(sc[r * G + gi]), m = _mm512_set1_ps(mn[r * G + gi]);
            lo[r] = _mm512_fmadd_ps(lo[r], d, m);
            hi[r] = _mm512_fmadd_ps(hi[r], d, m);
        }
        for (int i = 0; i < mr; i++) {
            __m512 x0 = _mm512_loadu_ps(x + (long)i * K + k), x1 = _mm512_loadu_ps(x + (long)i * K + k + 16);
            for (int r = 0; r < 4; r++)
                a[i][r] = _mm512_fmadd_ps(hi[r], x1, _mm512_fmadd_ps(lo[r], x0, a[i][r]));
        }
    }
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < 4; r++) y[(long)i * N + r] = _mm512_reduce_add_ps(a[i][r]);
}
#endif

/* columns [n0, n1) of y = x @ W.T into y0 [M, n1 - n0], rows ldy apart (x float32,
 * contiguous rows [M, K]); n0 a multiple of 4 */
static int int4_matmul_cols(const float *x, int M, int K, int g, const uint8_t *w,
                            const uint16_t *sc, const uint16_t *mn, int n0, int n1, float *y0,
                            long ldy) {
    int n = n0;
#if defined(__AVX512F__)
    int G = K / g;
    float *s = amalloc(sizeof(float) * (8L * G + (M <= 2 ? (long)M * G : 0)));
    if (!s) return 1;
    float *m = s + 4L * G, *xs = s + 8L * G;
    if (M <= 2)
        for (int i = 0; i < M; i++)
            for (int q = 0; q < G; q++) {
                const float *xq = x + (long)i * K + (long)q * g;
                float acc[16] = {0};
                for (int j = 0; j < g; j += 16)
                    for (int l = 0; l < 16; l++) acc[l] += xq[j + l];
                xs[i * G + q] = hsum16(acc);
            }
    for (; n + 4 <= n1; n += 4) {
        const uint8_t *wn = w + (long)n * (K / 2);
        float *y = y0 + (n - n0);
        f16_to_f32(sc + (long)n * G, s, 4 * G);
        f16_to_f32(mn + (long)n * G, m, 4 * G);
        if (M == 1) int4_gemv4(x, xs, K, g, wn, s, m, 1, y, ldy);
        else if (M == 2) int4_gemv4(x, xs, K, g, wn, s, m, 2, y, ldy);
        else {
            int i = 0;
            for (; i + 4 <= M; i += 4) int4_block4(x + (long)i * K, K, g, wn, s, m, 4, y + i * ldy, ldy);
            if (M - i == 3) int4_block4(x + (long)i * K, K, g, wn, s, m, 3, y + i * ldy, ldy);
            else if (M - i == 2) int4_block4(x + (long)i * K, K, g, wn, s, m, 2, y + i * ldy, ldy);
            else if (M - i == 1) int4_block4(x + (long)i * K, K, g, wn, s, m, 1, y + i * ldy, ldy);
        }
    }
    free(s);
#endif
    for (; n < n1; n++)
        for (int i = 0; i < M; i++)
            y0[i * ldy + (n - n0)] = int4_dot(x + (long)i * K, w + (long)n * (K / 2), sc + (long)n * (K / g),
                                              mn + (long)n * (K / g), K, g);
    return 0;
}

static int int4_matmul_f32(const float *x, int M, int K, int g, const uint8_t *w,
                           const uint16_t *sc, const uint16_t *mn, int N, float *y) {
    return int4_matmul_cols(x, M, K, g, w, sc, mn, 0, N, y, N);
}

/* x float32 or bfloat16 (xdt), rows `xs` elements apart; y float32 [M, N] */
int pd_int4_matmul(const void *x, int xdt, long xstride, int M, int K, int g, const uint8_t *w,
                   const uint16_t *sc, const uint16_t *mn, int N, float *y) {
    if (xdt == F32 && xstride == K) return int4_matmul_f32(x, M, K, g, w, sc, mn, N, y);
    float *xf = amalloc(sizeof(float) * (long)M * K);
    if (!xf) return 1;
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++) xf[(long)i * K + k] = ld(x, xdt, (long)i * xstride + k);
    int status = int4_matmul_f32(xf, M, K, g, w, sc, mn, N, y);
    free(xf);
    return status;
}
