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
 * (cpu_bf16.c) where the layer keeps one; float32 in and out. The matmuls (by columns) and
 * attention (by row and KV head) are shared with the pool's helper threads where the caller
 * gives a pool (cpu_pool.c: a chunk's values are the same whoever computes it); the norms,
 * rotary and SiLU run on the calling thread. Scratch is allocated per call (a few KB a row);
 * returns 1 when it cannot be had, 0 when done. The caller releases the GIL.
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
    pd_linear head;                         /* the output head (N = 0: not the plan's) */
} pd_model;

/* columns [n0, n1) of x [M, K] @ w[N, K].T into y [M, n1 - n0], rows ldy apart, float32 */
static void f32_matmul_cols(const float *x, int M, int K, const float *w, int n0, int n1,
                            float *y, long ldy) {
    for (int n = n0; n < n1; n++)
        for (int i = 0; i < M; i++) y[i * ldy + (n - n0)] = dot(x + (long)i * K, w + (long)n * K, K);
}

/* A linear layer as a pool task: chunks of `width` output columns (weight rows). */
typedef struct {
    const pd_linear *l;
    const float *x;             /* [M, K] */
    const uint16_t *xb;         /* x rounded to bfloat16, for the bfloat16 copy */
    const uint16_t *xv;         /* and packed as AMX tiles (cpu_bf16.c), or NULL */
    int M, width;
    float *y;                   /* [M, N] */
} lin_task;

static long lin_compute(const void *ctx, int c, float *scratch) {
    const lin_task *t = ctx;
    const pd_linear *l = t->l;
    int n0 = c * t->width, n1 = n0 + t->width < l->N ? n0 + t->width : l->N, M = t->M;
    float *y = scratch ? scratch : t->y + n0;
    long ldy = scratch ? n1 - n0 : l->N;
    if (t->xv)
        tile_matmul_cols(t->xv, t->xb, M, l->K, l->dense, n0, n1, y, ldy);
    else if (t->xb)
        bf16_matmul_cols(t->xb, M, l->K, l->dense, n0, n1, y, ldy);
    else if (l->kind == LIN_INT4) {
        if (int4_matmul_cols(t->x, M, l->K, l->group, l->w, l->scale, l->min, n0, n1, y, ldy)) return -1;
    }
    else if (l->kind == LIN_I8G32)
        int8g32_cols(t->x, M, l->K, l->w, l->scale, n0, n1, y, ldy);
    else
        f32_matmul_cols(t->x, M, l->K, l->w, n0, n1, y, ldy);
    if (l->bias)
        for (int i = 0; i < M; i++)
            for (int n = n0; n < n1; n++) y[i * ldy + (n - n0)] += l->bias[n];
    return (long)M * (n1 - n0);
}

static void lin_commit(const void *ctx, int c, const float *scratch) {
    const lin_task *t = ctx;
    int n0 = c * t->width, n1 = n0 + t->width < t->l->N ? n0 + t->width : t->l->N;
    for (int i = 0; i < t->M; i++)
        memcpy(t->y + (long)i * t->l->N + n0, scratch + (long)i * (n1 - n0), sizeof(float) * (n1 - n0));
}

_Static_assert(sizeof(lin_task) <= CTX_BYTES, "a pool task carries its arguments by value");

/* y [M, N] = x [M, K] @ W.T (+ bias), float32, shared with the pool's helpers by columns;
 * xb: room for x's bfloat16 operand (bf16_operand_size with tiles; the step's: it outlives
 * the op, see pool_run) */
static int linear(pd_pool *pool, const pd_linear *l, const float *x, int M, float *y, uint16_t *xb) {
    int dense = l->dense && M >= l->dense_rows, tiles = dense && bf16_tiles(M, l->K);
    uint16_t *xv = dense ? bf16_operand(x, M, l->K, xb, tiles) : NULL;
    /* chunks of >= 64 weight rows (a few microseconds of work at one row), at most
     * MAX_CHUNKS, a multiple of 4 (the kernels' row blocks; 32 on the tiles) */
    int width = (l->N + MAX_CHUNKS - 1) / MAX_CHUNKS, unit = tiles ? 32 : 4;
    width = width < 64 ? 64 : (width + unit - 1) / unit * unit;
    lin_task t = {l, x, dense ? xb : NULL, xv, M, width, y};
    pd_task task = {lin_compute, lin_commit, (l->N + width - 1) / width, (long)M * width};
    memcpy(task.ctx, &t, sizeof t);
    return pool_run(pool, &task);
}

/* A decode step's attention as a pool task: a chunk is a run of whole rows (per_head: one
 * KV head of one row, kept for a long context of few rows; off, see pd_decode_step). */
typedef struct {
    const pd_model *m;
    const pd_layer *L;
    const float *q;             /* [B, Hq, D] rotated */
    const int32_t *tables, *ctx;
    int W, B, rows, per_head;   /* rows a chunk; per_head: a chunk is (row, KV head) */
    float *out;                 /* [B, Hq, D] */
} att_task;

static long att_compute(const void *ctx, int c, float *scratch) {
    const att_task *t = ctx;
    const pd_model *m = t->m;
    int Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, G = Hq / Hkv;
    int b0 = t->per_head ? c / Hkv : c * t->rows, b1 = t->per_head ? b0 + 1 : b0 + t->rows;
    int h0 = t->per_head ? (c % Hkv) * G : 0, h1 = t->per_head ? h0 + G : Hq;
    b1 = b1 < t->B ? b1 : t->B;
    int Lmax = 1;
    for (int b = b0; b < b1; b++) Lmax = t->ctx[b] > Lmax ? t->ctx[b] : Lmax;
    float *p = amalloc(sizeof(float) * (long)(h1 - h0) * Lmax);
    if (!p) return -1;
    long n = 0;
    for (int b = b0; b < b1; b++) {
        float *acc = scratch ? scratch + n : t->out + ((long)b * Hq + h0) * D;
        attend(t->q + (long)b * Hq * D, t->L->k_cache, t->L->v_cache, m->block_size, Hq, Hkv, D,
               t->tables + (long)b * t->W, t->ctx[b], m->scale, t->L->window, t->L->sinks, h0, h1, acc, p);
        n += (long)(h1 - h0) * D;
    }
    free(p);
    return n;
}

_Static_assert(sizeof(att_task) <= CTX_BYTES, "a pool task carries its arguments by value");

static void att_commit(const void *ctx, int c, const float *scratch) {
    const att_task *t = ctx;
    const pd_model *m = t->m;
    int Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, G = Hq / Hkv;
    if (t->per_head) {
        int b = c / Hkv, h0 = (c % Hkv) * G;
        memcpy(t->out + ((long)b * Hq + h0) * D, scratch, sizeof(float) * G * D);
        return;
    }
    int b0 = c * t->rows, b1 = b0 + t->rows < t->B ? b0 + t->rows : t->B;
    memcpy(t->out + (long)b0 * Hq * D, scratch, sizeof(float) * (long)(b1 - b0) * Hq * D);
}

int pd_decode_step(const pd_model *m, pd_pool *pool, int B, float *h, const int64_t *pos,
                   const int64_t *slots, const int32_t *tables, int W, const int32_t *ctx) {
    int H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, I = m->intermediate;
    long QKV = (long)(Hq + 2 * Hkv) * D;
    /* each buffer on a 64-byte line: the kernels' 16-lane loads of x never straddle two;
     * the last one: x rounded to bfloat16 for the linears' bfloat16 copies */
    long widest = H > Hq * D ? H : Hq * D;
    widest = widest > I ? widest : I;
#define LINE(n) (((long)(n) + 15) / 16 * 16)
    long sizes[9] = {LINE(B * H), LINE(B * H), LINE(B * H), LINE(B * QKV), LINE((long)B * Hq * D),
                     LINE((long)B * Hq * D), LINE(2L * B * I), LINE((long)B * I),
                     LINE((bf16_operand_size(B, widest, 1) + 1) / 2)};
#undef LINE
    long total = 0;
    for (int i = 0; i < 9; i++) total += sizes[i];
    /* with helpers: the pool's buffers, kept past the step (a late helper may read them),
     * once the last step's late helpers are done */
    pool_quiesce(pool);
    float *buf = pool ? pool_workspace(pool, total) : amalloc(sizeof(float) * total);
    if (!buf) return 1;
    float *at[9];
    for (int i = 0; i < 9; i++) at[i] = i ? at[i - 1] + sizes[i - 1] : buf;
    float *res = at[0], *x = at[1], *y = at[2], *qkv = at[3], *q = at[4], *att = at[5];
    float *gu = at[6], *act = at[7];
    uint16_t *xb = (uint16_t *)at[8];
    /* attention by whole rows (a row's cache blocks read as one stream; split by KV head,
     * each pass strides over the others' values: 2-6x slower from memory) */
    int per_head = 0, rows = (B + MAX_CHUNKS - 1) / MAX_CHUNKS;
    int st = 0;
    for (int l = 0; l < m->num_layers && !st; l++) {
        const pd_layer *L = m->layers + l;
        if (l == 0) {
            memcpy(res, h, sizeof(float) * B * H);
            st |= pd_rms_norm(h, F32, H, NULL, 0, NULL, 0, L->input_norm, x, F32, H, B, H, m->eps);
        } else {
            st |= pd_rms_norm(y, F32, H, res, H, res, H, L->input_norm, x, F32, H, B, H, m->eps);
        }
        st |= linear(pool, &L->qkv, x, B, qkv, xb);
        if (L->q_norm)
            for (int t = 0; t < B; t++) {
                float *qt = qkv + t * QKV, *kt = qt + (long)Hq * D;
                st |= pd_rms_norm(qt, F32, D, NULL, 0, NULL, 0, L->q_norm, qt, F32, D, Hq, D, m->eps);
                st |= pd_rms_norm(kt, F32, D, NULL, 0, NULL, 0, L->k_norm, kt, F32, D, Hkv, D, m->eps);
            }
        pd_rope_write_kv(qkv, qkv + (long)Hq * D, qkv + (long)(Hq + Hkv) * D, F32, F32, F32, QKV,
                         QKV, QKV, B, Hq, Hkv, D, m->rotary_dim, pos, m->cos_sin, q, L->k_cache,
                         L->v_cache, slots);
        att_task a = {m, L, q, tables, ctx, W, B, rows, per_head, att};
        pd_task task = {att_compute, att_commit, per_head ? B * Hkv : (B + rows - 1) / rows,
                        per_head ? (long)(Hq / Hkv) * D : (long)rows * Hq * D};
        memcpy(task.ctx, &a, sizeof a);
        st |= pool_run(pool, &task);
        st |= linear(pool, &L->o, att, B, y, xb);
        st |= pd_rms_norm(y, F32, H, res, H, res, H, L->post_norm, x, F32, H, B, H, m->eps);
        st |= linear(pool, &L->gate_up, x, B, gu, xb);
        pd_silu_and_mul(gu, F32, 2L * I, act, F32, I, B, I);
        st |= linear(pool, &L->down, act, B, y, xb);
    }
    if (!st) st |= pd_rms_norm(y, F32, H, res, H, res, H, m->final_norm, h, F32, H, B, H, m->eps);
    if (!pool) free(buf);
    return st ? 1 : 0;
}

/* logits y [M, V] float32 = x [M, H] @ head.T, shared with the pool's helpers by columns
 * (the head's own kernel, so the layer path's values to the bit) */
int pd_decode_logits(const pd_model *m, pd_pool *pool, int M, const float *x, float *y) {
    pool_quiesce(pool);
    return linear(pool, &m->head, x, M, y, NULL);
}
