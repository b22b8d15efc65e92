/* pdserve's CPU kernel for MLA decode attention (DeepSeek-V3's latent cache), #included at
 * the end of cpu.c: one translation unit, built by engine/kernels/cpu.py with cpu.c's flags,
 * sharing its helpers (dot, exp_nonpos, st). Its torch reference is
 * engine/kernels/mla_reference.py.
 *
 * cpu.c is compiled with -ffp-contract=off; the two inner loops here (scores, value sums) are
 * marked MLA_FMA and fuse their multiply-adds, as cpu.c's AVX-512 matmul blocks do: sums
 * within float32 rounding of the reference's, not bitwise. They are written with GCC's vector
 * extension (8 lanes; AVX2 registers on x86-64, pairs of NEON registers on aarch64), since
 * plain loops over small arrays of sums were spilled to the stack by GCC 12.
 */

/* MLA decode (DeepSeek-V3, weight-absorbed; engine/kernels/mla_reference.py): q [B, H, D]
 * float32; cache [nb, bs, D] float32, one latent row per token for every head: key = the row,
 * value = its first V values. Online softmax over tiles of MLA_TILE rows: each tile's rows
 * are scored against all H heads, then summed into every head's acc while still in cache, so
 * a row is read from memory once per request (not once per head, nor once for K and once for
 * V as in pd_decode_attention). Returns 2 (nothing written) for a table entry outside the
 * pool or a context longer than the table holds; cpu.py raises ValueError. */
enum { MLA_TILE = 64 };
#if defined(__GNUC__) && !defined(__clang__)
#define MLA_FMA __attribute__((optimize("fp-contract=fast")))   /* multiply-adds fused here */
#else
#define MLA_FMA
#endif

/* 8 lanes; aligned(4), so a v8u pointer may point anywhere in a float array and its loads and
 * stores go straight to memory (no copies through the stack) */
typedef float v8u __attribute__((vector_size(32), aligned(4)));

static inline float hsum8(v8u v) {
    float t[8];
    memcpy(t, &v, sizeof t);
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

/* s[k] = q[k] . r for 4 query rows q[k] = q + k * D and one cache row: each load of the row
 * serves four heads, in 8 independent sums of 8 lanes */
MLA_FMA static void dot4(const float *q, const float *r, int D, float *s) {
    const float *q1 = q + D, *q2 = q + 2L * D, *q3 = q + 3L * D;
    v8u s00 = {0}, s01 = {0}, s10 = {0}, s11 = {0}, s20 = {0}, s21 = {0}, s30 = {0}, s31 = {0};
    int i = 0;
    for (; i + 16 <= D; i += 16) {
        v8u r0 = *(const v8u *)(r + i), r1 = *(const v8u *)(r + i + 8);
        s00 += *(const v8u *)(q + i) * r0, s01 += *(const v8u *)(q + i + 8) * r1;
        s10 += *(const v8u *)(q1 + i) * r0, s11 += *(const v8u *)(q1 + i + 8) * r1;
        s20 += *(const v8u *)(q2 + i) * r0, s21 += *(const v8u *)(q2 + i + 8) * r1;
        s30 += *(const v8u *)(q3 + i) * r0, s31 += *(const v8u *)(q3 + i + 8) * r1;
    }
    s[0] = hsum8(s00 + s01), s[1] = hsum8(s10 + s11), s[2] = hsum8(s20 + s21), s[3] = hsum8(s30 + s31);
    for (int k = 0; k < 4; k++)
        for (int c = i; c < D; c++) s[k] += q[(long)k * D + c] * r[c];
}

/* acc[k][0..V) += sum_i p[k][i] * rows[i][0..V) for 4 heads k (acc rows V apart, p rows
 * MLA_TILE apart), 16 columns at a time: each row's load serves four heads and the 4 x 16
 * sums stay in registers across the tile */
MLA_FMA static void axpy4(float *acc, const float *p, const float *const *rows, int n, int V) {
    v8u *a0 = (v8u *)acc, *a1 = (v8u *)(acc + V), *a2 = (v8u *)(acc + 2L * V), *a3 = (v8u *)(acc + 3L * V);
    const float *p0 = p, *p1 = p + MLA_TILE, *p2 = p + 2 * MLA_TILE, *p3 = p + 3 * MLA_TILE;
    int d = 0;
    for (; d + 16 <= V; d += 16) {
        int c = d / 8;
        v8u s00 = a0[c], s01 = a0[c + 1], s10 = a1[c], s11 = a1[c + 1];
        v8u s20 = a2[c], s21 = a2[c + 1], s30 = a3[c], s31 = a3[c + 1];
        for (int i = 0; i < n; i++) {
            v8u r0 = *(const v8u *)(rows[i] + d), r1 = *(const v8u *)(rows[i] + d + 8);
            s00 += p0[i] * r0, s01 += p0[i] * r1, s10 += p1[i] * r0, s11 += p1[i] * r1;
            s20 += p2[i] * r0, s21 += p2[i] * r1, s30 += p3[i] * r0, s31 += p3[i] * r1;
        }
        a0[c] = s00, a0[c + 1] = s01, a1[c] = s10, a1[c + 1] = s11;
        a2[c] = s20, a2[c + 1] = s21, a3[c] = s30, a3[c + 1] = s31;
    }
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < n; i++)
            for (int c = d; c < V; c++) acc[(long)k * V + c] += p[k * MLA_TILE + i] * rows[i][c];
}

/* the same for one head */
static void axpy1(float *a, const float *p, const float *const *rows, int n, int V) {
    for (int i = 0; i < n; i++)
        for (int c = 0; c < V; c++) a[c] += p[i] * rows[i][c];
}

/* one tile of n rows into every head's running (max m, sum l, acc); p [H, MLA_TILE] scratch */
static void mla_tile(const float *q, const float *const *rows, int n, int H, int D, int V,
                     float scale, float *p, float *m, float *l, float *acc) {
    for (int i = 0; i < n; i++) {
        int h = 0;
        float s[4];
        for (; h + 4 <= H; h += 4) {
            dot4(q + (long)h * D, rows[i], D, s);
            for (int k = 0; k < 4; k++) p[(long)(h + k) * MLA_TILE + i] = s[k] * scale;
        }
        for (; h < H; h++) p[(long)h * MLA_TILE + i] = dot(q + (long)h * D, rows[i], D) * scale;
    }
    for (int h = 0; h < H; h++) {
        float *ph = p + (long)h * MLA_TILE, *a = acc + (long)h * V, mx = m[h], sum = 0.0f;
        for (int i = 0; i < n; i++) mx = ph[i] > mx ? ph[i] : mx;
        for (int i = 0; i < n; i++) sum += (ph[i] = exp_nonpos(ph[i] - mx));
        float alpha = m[h] == -INFINITY ? 0.0f : exp_nonpos(m[h] - mx);
        l[h] = l[h] * alpha + sum;
        m[h] = mx;
        if (alpha != 1.0f)
            for (int d = 0; d < V; d++) a[d] *= alpha;
    }
    int h = 0;
    for (; h + 4 <= H; h += 4) axpy4(acc + (long)h * V, p + (long)h * MLA_TILE, rows, n, V);
    for (; h < H; h++) axpy1(acc + (long)h * V, p + (long)h * MLA_TILE, rows, n, V);
}

int pd_mla_decode_attention(const float *q, const float *kv, long nb, int bs, int H, int D, int V,
                            const int32_t *block_tables, int W, const int32_t *ctx, int B,
                            float scale, void *out, int odt) {
    for (int b = 0; b < B; b++) {
        if (ctx[b] < 0 || ctx[b] > (long)W * bs) return 2;
        for (int i = 0; i < (ctx[b] + bs - 1) / bs; i++)
            if (block_tables[(long)b * W + i] < 0 || block_tables[(long)b * W + i] >= nb) return 2;
    }
    float *acc = amalloc(sizeof(float) * ((long)H * V + (long)H * MLA_TILE + 2L * H));
    if (!acc) return 1;
    float *p = acc + (long)H * V, *m = p + (long)H * MLA_TILE, *l = m + H;
    const float *rows[MLA_TILE];
    for (int b = 0; b < B; b++) {
        const int32_t *table = block_tables + (long)b * W;
        memset(acc, 0, sizeof(float) * H * V);
        for (int h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;
        for (int j0 = 0; j0 < ctx[b]; j0 += MLA_TILE) {
            int n = ctx[b] - j0 < MLA_TILE ? ctx[b] - j0 : MLA_TILE;
            for (int i = 0, j = j0; i < n; i++, j++)
                rows[i] = kv + ((long)table[j / bs] * bs + j % bs) * D;
            mla_tile(q + (long)b * H * D, rows, n, H, D, V, scale, p, m, l, acc);
        }
        for (int h = 0; h < H; h++) {
            float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
            for (int d = 0; d < V; d++) st(out, odt, ((long)b * H + h) * V + d, acc[(long)h * V + d] * inv);
        }
    }
    free(acc);
    return 0;
}
