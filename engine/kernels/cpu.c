/* pdserve's CPU kernels: the elementwise ops, decode attention (per head and MLA's latent
 * form) and the int8 weight-only matmuls of a float32 model, each one call instead of the dozen eager torch ops of its
 * reference (engine/kernels/reference.py). At decode on CPU a layer's torch calls cost more
 * than its arithmetic. The float32 and int4 matmuls stay torch's (MKL; its int4 kernel).
 *
 * Built by engine/kernels/cpu.py with the host compiler and loaded with ctypes. Tensors arrive
 * as pointers with row strides in elements; within a row, heads and head dims are contiguous.
 * Activations are float32 or bfloat16 (dtype codes below: what torch's CPU int8/int4 matmuls
 * take and return); weights, the residual stream and the KV cache are float32, int8 codes
 * with their scales for the matmuls.
 *
 * Compiled with -ffp-contract=off: the compiler fuses no multiply-add, so the scalar code
 * rounds every product and sum where the torch reference does (rotary is bitwise equal to the
 * reference; the norm and attention sum in another order, within float32 rounding of it). The
 * AVX-512 matmul blocks use fused multiply-adds explicitly (_mm512_fmadd_ps): their sums are
 * within float32 rounding of the reference's, not bitwise. Functions that need scratch memory
 * return 0, or 1 when it cannot be had (nothing is written then; cpu.py raises MemoryError).
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };

/* scratch for the kernels' 16-lane loads: on 64-byte lines (malloc gives 16: a load across two
 * lines costs two; measured: a 4-row decode step 12.1 -> 8.8 ms). Freed with free(). */
static void *amalloc(size_t bytes) {
    void *p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 64) ? NULL : p;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, NaN to the quiet NaN: c10::BFloat16's conversion */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float ld(const void *p, int dt, long i) {
    return dt == BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, int dt, long i, float v) {
    if (dt == BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* a[0..16) summed pairwise (vectorizes), in place */
static inline float hsum16(float *a) {
    for (int j = 0; j < 8; j++) a[j] += a[j + 8];
    for (int j = 0; j < 4; j++) a[j] += a[j + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* sum of a[i] * b[i] in 16 interleaved partial sums (vectorizes without -ffast-math) */
static inline float dot(const float *a, const float *b, int n) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {          /* the same 16 partial sums, in registers, then a tree */
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16)
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    return s + hsum16(acc);
}

/* e^x for x <= 0, within about 2 ulp (Cephes' expf polynomial); branch-free, so softmax's
 * loop over it vectorizes, where libm's expf is a call per element */
static inline float exp_nonpos(float x) {
    x = x > -87.3f ? x : -87.3f;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

/* RMSNorm over rows of H: out = w * (s * 1/sqrt(mean(s^2) + eps)), s = x (+ res). With res,
 * the sum s is also written to res_out (the new residual stream). res and res_out float32. */
int pd_rms_norm(const void *x, int xdt, long xs, const float *res, long rs, float *res_out,
                long ros, const float *w, void *out, int odt, long os, int T, int H, float eps) {
    float *s = amalloc(sizeof(float) * H);
    if (!s) return 1;
    for (int t = 0; t < T; t++) {
        float acc[16] = {0};
        for (int i = 0; i < H; i++) s[i] = ld(x, xdt, t * xs + i);
        if (res) {
            for (int i = 0; i < H; i++) s[i] += res[t * rs + i];
            memcpy(res_out + t * ros, s, sizeof(float) * H);
        }
        int i = 0;
        for (; i + 16 <= H; i += 16)
            for (int j = 0; j < 16; j++) acc[j] += s[i + j] * s[i + j];
        float ss = 0.0f;
        for (; i < H; i++) ss += s[i] * s[i];
        ss += hsum16(acc);
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (int i = 0; i < H; i++) st(out, odt, t * os + i, w[i] * (s[i] * r));
    }
    free(s);
    return 0;
}

/* Neox-style rotary on q and k, then k and v into their cache slots (slot < 0: skip).
 * cos_sin [max_pos, R] = cat(cos[:R/2], sin[:R/2]), R <= D the rotary dimension: the first R
 * values of a head rotate, the rest pass through (partial rotary); q_out [T, Hq, D] float32;
 * caches [slots, Hkv, D] float32. out[i] = x[i] cos[i] - x[i + R/2] sin[i] for i < R/2, and
 * x[i] cos[i - R/2] + x[i - R/2] sin[i - R/2] up to R: the reference's products and sum. */
static void rotate(const void *x, int dt, long off, const float *cs, int R, int D, float *out) {
    int d2 = R / 2;
    for (int i = 0; i < d2; i++) {
        float a = ld(x, dt, off + i), b = ld(x, dt, off + i + d2);
        float c = cs[i], s = cs[d2 + i];
        float p1 = a * c, p2 = b * -s, p3 = b * c, p4 = a * s;
        out[i] = p1 + p2;
        out[i + d2] = p3 + p4;
    }
    for (int i = R; i < D; i++) out[i] = ld(x, dt, off + i);
}

void pd_rope_write_kv(const void *q, const void *k, const void *v, int qdt, int kdt, int vdt,
                      long qs, long ks, long vs, int T, int Hq, int Hkv, int D, int R,
                      const int64_t *pos, const float *cos_sin, float *q_out, float *k_cache,
                      float *v_cache, const int64_t *slots) {
    for (int t = 0; t < T; t++) {
        const float *cs = cos_sin + pos[t] * R;
        for (int h = 0; h < Hq; h++) rotate(q, qdt, t * qs + (long)h * D, cs, R, D, q_out + ((long)t * Hq + h) * D);
        if (slots[t] < 0) continue;
        float *kr = k_cache + slots[t] * Hkv * D, *vr = v_cache + slots[t] * Hkv * D;
        for (int h = 0; h < Hkv; h++) rotate(k, kdt, t * ks + (long)h * D, cs, R, D, kr + (long)h * D);
        for (long i = 0; i < (long)Hkv * D; i++) vr[i] = ld(v, vdt, t * vs + i);
    }
}

#if defined(__AVX512F__)
/* exp_nonpos on 16 lanes: the same operations in the same order (bitwise its results) */
static inline __m512 exp_nonpos16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                                  _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                             _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(two_n));
}
#endif

/* x[0..n) <- softmax(x), n >= 1; with `sink` (one more logit, not written back: an
 * attention sink) the denominator has its term too. 16 lanes at a time where AVX-512 is
 * built in (the max, exp_nonpos16 and the sum in 16 partial sums); scores are finite. */
static void softmax(float *x, int n, const float *sink) {
    float m = x[0], sum = 0.0f;
    int i = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(x[0]);
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    if (sink) m = *sink > m ? *sink : m;
    i = 0;
#if defined(__AVX512F__)
    __m512 sv = _mm512_setzero_ps(), mb = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mb));
        _mm512_storeu_ps(x + i, e);
        sv = _mm512_add_ps(sv, e);
    }
    sum = _mm512_reduce_add_ps(sv);
#endif
    for (; i < n; i++) sum += (x[i] = exp_nonpos(x[i] - m));
    if (sink) sum += exp_nonpos(*sink - m);
    float inv = 1.0f / sum;
    for (i = 0; i < n; i++) x[i] *= inv;
}

/* One query's heads h0 .. h1 - 1 (those of KV heads h0 / G .. h1 / G, G = Hq / Hkv) over its
 * paged context of L positions (table: its block ids): head h's output, float32, at
 * acc + (h - h0) D; p: scratch for (h1 - h0) * (its visible positions) scores. window > 0:
 * the query (position L - 1) sees the last `window` positions only; sinks [Hq] or NULL: a
 * logit per head in each softmax's denominator (reference.py). Positions are read in cache
 * order, every head of a position at once: a block's K (then V) rows are one contiguous run
 * of memory, which is what decode's time goes to here. */
static void attend(const float *q, const float *k_cache, const float *v_cache, int bs, int Hq,
                   int Hkv, int D, const int32_t *table, int L, float scale, int window,
                   const float *sinks, int h0, int h1, float *acc, float *p) {
    int G = Hq / Hkv, lo = window > 0 && L > window ? L - window : 0, n = L - lo, nh = h1 - h0;
    long row = (long)Hkv * D;                       /* floats per cache position */
    for (int j0 = lo - lo % bs; j0 < L; j0 += bs) {
        const float *kb = k_cache + (long)table[j0 / bs] * bs * row;
        for (int j = j0; j < L && j < j0 + bs; j++, kb += row)
            for (int h = h0; h < h1 && j >= lo; h++)
                p[(long)(h - h0) * n + j - lo] = dot(q + (long)h * D, kb + (long)(h / G) * D, D) * scale;
    }
    for (int h = h0; h < h1 && n > 0; h++) softmax(p + (long)(h - h0) * n, n, sinks ? sinks + h : NULL);
    memset(acc, 0, sizeof(float) * nh * D);
    for (int j0 = lo - lo % bs; j0 < L; j0 += bs) {
        const float *vb = v_cache + (long)table[j0 / bs] * bs * row;
        for (int j = j0; j < L && j < j0 + bs; j++, vb += row)
            for (int h = h0; h < h1 && j >= lo; h++) {
                float pj = p[(long)(h - h0) * n + j - lo], *a = acc + (long)(h - h0) * D;
                const float *vr = vb + (long)(h / G) * D;
                for (int d = 0; d < D; d++) a[d] += pj * vr[d];
            }
    }
}

/* One query per sequence over its paged context: q [B, Hq, D] float32; caches [blocks, bs,
 * Hkv, D] float32; block_tables [B, W] int32; ctx [B] int32 (0: a padding row, zeros out).
 * window, sinks: as in attend. */
int pd_decode_attention(const float *q, const float *k_cache, const float *v_cache, int bs,
                        int Hq, int Hkv, int D, const int32_t *block_tables, int W,
                        const int32_t *ctx, int B, float scale, int window, const float *sinks,
                        void *out, int odt) {
    int Lmax = 1;
    for (int b = 0; b < B; b++) Lmax = ctx[b] > Lmax ? ctx[b] : Lmax;
    float *p = amalloc(sizeof(float) * ((long)Hq * Lmax + (long)Hq * D));   /* scores [Hq, n] */
    if (!p) return 1;
    float *acc = p + (long)Hq * Lmax;                                          /* [Hq, D] */
    for (int b = 0; b < B; b++) {
        attend(q + (long)b * Hq * D, k_cache, v_cache, bs, Hq, Hkv, D, block_tables + (long)b * W,
               ctx[b], scale, window, sinks, 0, Hq, acc, p);
        for (long i = 0; i < (long)Hq * D; i++) st(out, odt, (long)b * Hq * D + i, acc[i]);
    }
    free(p);
    return 0;
}

/* A decode step's attention in one call (one query per sequence: T = B): pd_rope_write_kv's
 * rotary and cache write, then pd_decode_attention of the rotated q (held in scratch), the
 * same two functions in the same order, so the results are theirs bit for bit. One call
 * instead of two saves a layer the second call's argument conversion, checks and q's
 * allocation in Python (~2% of a one-row decode step). */
int pd_rope_decode_attention(const void *q, const void *k, const void *v, int qdt, int kdt,
                             int vdt, long qs, long ks, long vs, int B, int Hq, int Hkv, int D,
                             int R, const int64_t *pos, const float *cos_sin, float *k_cache,
                             float *v_cache, const int64_t *slots, int bs,
                             const int32_t *block_tables, int W, const int32_t *ctx, float scale,
                             int window, const float *sinks, void *out, int odt) {
    float *qr = amalloc(sizeof(float) * (long)B * Hq * D);
    if (!qr) return 1;
    pd_rope_write_kv(q, k, v, qdt, kdt, vdt, qs, ks, vs, B, Hq, Hkv, D, R, pos, cos_sin, qr,
                     k_cache, v_cache, slots);
    int status = pd_decode_attention(qr, k_cache, v_cache, bs, Hq, Hkv, D, block_tables, W, ctx,
                                     B, scale, window, sinks, out, odt);
    free(qr);
    return status;
}

/* silu(g) = g / (1 + e^-g), from e = e^-|g| (exp_nonpos: no libm call, so the loop over it
 * vectorizes): g / (1 + e) for g >= 0, g e / (1 + e) below (within ~3 ulp of libm's) */
static inline float silu(float g) {
    float e = exp_nonpos(-fabsf(g));
    return (g >= 0.0f ? g : g * e) / (1.0f + e);
}


/* x [T, 2I] = cat(gate, up) -> silu(gate) * up [T, I] */
void pd_silu_and_mul(const void *x, int xdt, long xs, void *out, int odt, long os, int T, int I) {
    for (int t = 0; t < T; t++) {
        int i = 0;
#if defined(__AVX512F__)
        if (xdt == F32 && odt == F32) {          /* float32 rows, 16 lanes: silu() bitwise */
            const float *g = (const float *)x + t * xs, *u = g + I;
            float *o = (float *)out + t * os;
            for (; i + 16 <= I; i += 16) {
                __m512 gv = _mm512_loadu_ps(g + i);
                __m512 e = exp_nonpos16(_mm512_abs_ps(gv) * -1.0f);
                __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
                __m512 num = _mm512_mask_mul_ps(gv, neg, gv, e);
                __m512 s = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
                _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
            }
        }
#endif
        for (; i < I; i++)
            st(out, odt, t * os + i, silu(ld(x, xdt, t * xs + i)) * ld(x, xdt, t * xs + I + i));
    }
}

/* y [M, N] = (x [M, K] @ w[N, K].T) * scale[N]: int8 weights with a scale per output channel,
 * torch's _weight_int8pack_mm layout (w row-major int8, scale bfloat16); x float32 or
 * bfloat16; y in odt (bfloat16, as torch's kernel returns it). With AVX-512 (i8_block), four
 * weight rows at a time, read once from memory for all M rows, the int8 -> float conversion
 * and the multiply-add 16 lanes wide: at decode torch's kernel (it converts through bfloat16)
 * reads about 5 GB/s a core here, this about 11, and at 64 rows it is 1.3x slower. One
 * thread, every M: the engine's int8 layers take this path for prefill and decode alike. */
static float dot_i8(const float *x, const int8_t *w, int K) {
    float acc[16] = {0}, s = 0.0f;
    int k = 0;
    for (; k + 16 <= K; k += 16)
        for (int j = 0; j < 16; j++) acc[j] += x[k + j] * (float)w[k + j];
    for (; k < K; k++) s += x[k] * (float)w[k];
    return s + hsum16(acc);
}

#if defined(__AVX512F__)
/* 4 weight rows x mr <= 4 activation rows: each 16 weights are converted once for all mr
 * rows of x (16 accumulators), so prefill's many rows cost multiply-adds, not conversions.
 * Inlined with mr = 4 (a constant: the accumulators stay in registers) and for the tail. */
static inline __attribute__((always_inline)) void i8_block(
        const float *x, int K, const int8_t *w, const uint16_t *scale, int mr, void *y, int odt,
        long y0, int N) {
    __m512 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 4; r++) a[i][r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        __m512 wv[4];
        for (int r = 0; r < 4; r++) {
            /* the rows two blocks ahead: 7.5 -> 11.7 GB/s from memory here (a hint: past
             * the weight's end it reads nothing and cannot fault) */
            _mm_prefetch((const char *)(w + (long)(r + 8) * K + k), _MM_HINT_T0);
            wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(w + (long)r * K + k))));
        }
        for (int i = 0; i < mr; i++) {
            __m512 xv = _mm512_loadu_ps(x + (long)i * K + k);
            for (int r = 0; r < 4; r++) a[i][r] = _mm512_fmadd_ps(xv, wv[r], a[i][r]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < 4; r++)
            st(y, odt, y0 + (long)i * N + r, _mm512_reduce_add_ps(a[i][r]) * bf16_to_f32(scale[r]));
}
#endif

int pd_int8_matmul(const void *x, int xdt, int M, int K, const int8_t *w, const uint16_t *scale,
                   int N, void *y, int odt) {
    float *xf = amalloc(sizeof(float) * (long)M * K);
    if (!xf) return 1;
    for (long i = 0; i < (long)M * K; i++) xf[i] = ld(x, xdt, i);
    int n = 0;
#if defined(__AVX512F__)
    if (K % 16 == 0)
        for (; n + 4 <= N; n += 4)
            for (int m0 = 0; m0 < M; m0 += 4) {
                if (M - m0 >= 4) i8_block(xf + (long)m0 * K, K, w + (long)n * K, scale + n, 4, y, odt, (long)m0 * N + n, N);
                else i8_block(xf + (long)m0 * K, K, w + (long)n * K, scale + n, M - m0, y, odt, (long)m0 * N + n, N);
            }
#endif
    for (; n < N; n++)
        for (int m = 0; m < M; m++)
            st(y, odt, (long)m * N + n, dot_i8(xf + (long)m * K, w + (long)n * K, K) * bf16_to_f32(scale[n]));
    free(xf);
    return 0;
}

/* y [M, N] float32 = x [M, K] @ W.T for int8 codes with a float32 scale per 32 values of a
 * row (GGUF Q8_0; scale [N, K/32]): w[n, k] = q[n, k] * scale[n, k / 32]. Per group the
 * products are summed, then scaled. x float32 or bfloat16. Float32 logits straight from the
 * stored codes (an output head needs no bfloat16 rounding). One thread, every M. */
static float dot_i8g(const float *x, const int8_t *w, const float *scale, int K) {
    float s = 0.0f;
    for (int g = 0; g < K / 32; g++) s += scale[g] * dot_i8(x + 32 * g, w + 32 * g, 32);
    return s;
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void i8g_block(
        const float *x, int K, const int8_t *w, const float *scale, int mr, float *y, long y0, long N) {
    __m512 a[4][4];
    int G = K / 32;
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 4; r++) a[i][r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __m512 w0[4], w1[4], s[4];
        for (int r = 0; r < 4; r++) {
            const int8_t *wr = w + (long)r * K + k;
            _mm_prefetch((const char *)(wr + 8L * K), _MM_HINT_T0);
            w0[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)wr)));
            w1[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + 16))));
            s[r] = _mm512_set1_ps(scale[(long)r * G + k / 32]);
        }
        for (int i = 0; i < mr; i++) {
            __m512 x0 = _mm512_loadu_ps(x + (long)i * K + k), x1 = _mm512_loadu_ps(x + (long)i * K + k + 16);
            for (int r = 0; r < 4; r++)
                a[i][r] = _mm512_fmadd_ps(s[r], _mm512_fmadd_ps(x1, w1[r], _mm512_mul_ps(x0, w0[r])), a[i][r]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < 4; r++) y[y0 + (long)i * N + r] = _mm512_reduce_add_ps(a[i][r]);
}
#endif

/* columns [n0, n1) into y [M, n1 - n0], rows ldy apart; x float32 [M, K] */
static void int8g32_cols(const float *x, int M, int K, const int8_t *w, const float *scale,
                         int n0, int n1, float *y, long ldy) {
    int n = n0, G = K / 32;
#if defined(__AVX512F__)
    for (; n + 4 <= n1; n += 4)
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int8_t *wn = w + (long)n * K;
            long at = m0 * ldy + (n - n0);
            if (M - m0 >= 4) i8g_block(x + (long)m0 * K, K, wn, scale + (long)n * G, 4, y, at, ldy);
            else i8g_block(x + (long)m0 * K, K, wn, scale + (long)n * G, M - m0, y, at, ldy);
        }
#endif
    for (; n < n1; n++)
        for (int m = 0; m < M; m++)
            y[m * ldy + (n - n0)] = dot_i8g(x + (long)m * K, w + (long)n * K, scale + (long)n * G, K);
}

int pd_int8g32_matmul(const void *x, int xdt, int M, int K, const int8_t *w, const float *scale,
                      int N, float *y) {
    float *xf = amalloc(sizeof(float) * (long)M * K);
    if (!xf) return 1;
    for (long i = 0; i < (long)M * K; i++) xf[i] = ld(x, xdt, i);
    int8g32_cols(xf, M, K, w, scale, 0, N, y, N);
    free(xf);
    return 0;
}

/* MLA's latent-cache decode attention, the int4 matmul and the whole decode step live in
 * files of their own, compiled as part of this one (they use the helpers and kernels above). */
#include "cpu_mla.c"
#include "cpu_int4.c"
#include "cpu_bf16.c"
#include "cpu_pool.c"
#include "cpu_step.c"
