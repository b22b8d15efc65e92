/* A decode step of a plain pre-norm decoder (engine/models/layers.py: DecoderLayer with
 * Attention and MLP; the Llama family) in one call: every layer's norms, projections,
 * rotary, cache write, attention and MLP, then the final norm. engine/models/decode_plan.py
 * builds the description (pd_model) once from the model's own tensors and calls this for
 * each decode step: one row per sequence (B rows), embeddings in, final hidden states out.
 *
 * The same kernels as the layer-by-layer path (pd_rms_norm, pd_rope_decode_attention,
 * pd_silu_and_mul, the int4 / int8_g32 matmuls of this file's includer) in the same order,
 * so the two agree to the last bit wherever their linears do; what this saves is the
 * Python between ~10 C calls a layer (half of a one-row step on CPU, bench/RESULTS.md).
 *
 *   h0 = embeddings                                   (the caller looks them up)
 *   for each layer:  res = h + res (layer 0: res = h);  x = norm(res)
 *                    qkv = x Wqkv.T (+ b);  [q, k per-head norm];  rotary, cache write
 *                    a = attention(q, cache);  h = a Wo.T
 *                    res = h + res;  x = norm(res);  h = down(silu(gate) * up)
 *   out = norm(h + res)
 *
 * Linears: float32 [N, K] (a dot per row, 16 lanes), int4 (cpu_int4.c), int8_g32
 * (pd_int8g32_matmul), and for batches of dense_rows rows or more the bfloat16 copy
 * (cpu_bf16.c) where the layer keeps one; float32 in and out. Scratch is allocated per call (a few KB a row);
 * returns 1 when it cannot be had, 0 when done. One thread; the caller releases the GIL.
 */

enum { LIN_F32 = 0, LIN_INT4 = 1, LIN_I8G32 = 2 };

typedef struct {
    int kind, N, K, group;
    const void *w;              /* f32 [N, K] | int4 codes [N, K/2] | int8 [N, K] */
    const void *scale;          /* - | f16 [N, K/g] | f32 [N, K/32] */
    const void *min;            /* - | f16 [N, K/g] | - */
    const float *bias;          /* [N] or NULL */
    const uint16_t *dense;      /* its bfloat16 copy [N, K] (engine/quant/amx.py) or NULL */
    int dense_rows;             /* batches of this many rows or more multiply by the copy */
} pd_linear;

typedef struct {
    const float *input_norm, *post_norm;    /* [H] */
    const float *q_norm, *k_norm;           /* [D] or NULL (Qwen3's per-head norms) */
    pd_linear qkv, o, gate_up, down;
    float *k_cache, *v_cache;               /* [blocks, block_size, Hkv, D] */
    const float *sinks;                     /* [Hq] or NULL */
    int window;                             /* 0: every position */
} pd_layer;

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, rotary_dim, intermediate, block_size;
    float eps, scale;
    const float *cos_sin;                   /* [max_pos, rotary_dim] */
    const float *final_norm;                /* [H] */
    const pd_layer *layers;
} pd_model;

/* y [M, N] = x [M, K] @ w[N, K].T, float32 */
static void f32_matmul(const float *x, int M, int K, const float *w, int N, float *y) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < M; i++) y[(long)i * N + n] = dot(x + (long)i * K, w + (long)n * K, K);
}

static int linear(const pd_linear *l, const float *x, int M, float *y) {
    int status = 0;
    if (l->dense && M >= l->dense_rows)
        status = bf16_matmul(x, M, l->K, l->dense, l->N, y);
    else if (l->kind == LIN_INT4)
        status = int4_matmul_f32(x, M, l->K, l->group, l->w, l->scale, l->min, l->N, y);
    else if (l->kind == LIN_I8G32)
        status = pd_int8g32_matmul(x, F32, M, l->K, l->w, l->scale, l->N, y);
    else
        f32_matmul(x, M, l->K, l->w, l->N, y);
    if (l->bias)
        for (int i = 0; i < M; i++)
            for (int n = 0; n < l->N; n++) y[(long)i * l->N + n] += l->bias[n];
    return status;
}

int pd_decode_step(const pd_model *m, int B, float *h, const int64_t *pos, const int64_t *slots,
                   const int32_t *tables, int W, const int32_t *ctx) {
    int H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, I = m->intermediate;
    long QKV = (long)(Hq + 2 * Hkv) * D;
    long per_row = 3L * H + QKV + (long)Hq * D + 3L * I;
    float *buf = malloc(sizeof(float) * per_row * B);
    if (!buf) return 1;
    float *res = buf, *x = res + (long)B * H, *y = x + (long)B * H, *qkv = y + (long)B * H;
    float *att = qkv + B * QKV, *gu = att + (long)B * Hq * D, *act = gu + 2L * B * I;
    int st = 0;
    for (int l = 0; l < m->num_layers && !st; l++) {
        const pd_layer *L = m->layers + l;
        if (l == 0) {
            memcpy(res, h, sizeof(float) * B * H);
            st |= pd_rms_norm(h, F32, H, NULL, 0, NULL, 0, L->input_norm, x, F32, H, B, H, m->eps);
        } else {
            st |= pd_rms_norm(y, F32, H, res, H, res, H, L->input_norm, x, F32, H, B, H, m->eps);
        }
        st |= linear(&L->qkv, x, B, qkv);
        if (L->q_norm)
            for (int t = 0; t < B; t++) {
                float *q = qkv + t * QKV, *k = q + (long)Hq * D;
                st |= pd_rms_norm(q, F32, D, NULL, 0, NULL, 0, L->q_norm, q, F32, D, Hq, D, m->eps);
                st |= pd_rms_norm(k, F32, D, NULL, 0, NULL, 0, L->k_norm, k, F32, D, Hkv, D, m->eps);
            }
        st |= pd_rope_decode_attention(qkv, qkv + (long)Hq * D, qkv + (long)(Hq + Hkv) * D, F32, F32,
                                       F32, QKV, QKV, QKV, B, Hq, Hkv, D, m->rotary_dim, pos,
                                       m->cos_sin, L->k_cache, L->v_cache, slots, m->block_size,
                                       tables, W, ctx, m->scale, L->window, L->sinks, att, F32);
        st |= linear(&L->o, att, B, y);
        st |= pd_rms_norm(y, F32, H, res, H, res, H, L->post_norm, x, F32, H, B, H, m->eps);
        st |= linear(&L->gate_up, x, B, gu);
        pd_silu_and_mul(gu, F32, 2L * I, act, F32, I, B, I);
        st |= linear(&L->down, act, B, y);
    }
    if (!st) st |= pd_rms_norm(y, F32, H, res, H, res, H, m->final_norm, h, F32, H, B, H, m->eps);
    free(buf);
    return st ? 1 : 0;
}
