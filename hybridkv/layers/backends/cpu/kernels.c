/* hybridkv's CPU kernels: plain C (no torch headers: it builds in about a
 * second), compiled for the machine at install time or by `hybridkv
 * build-kernels` (build.py), called through ctypes (library.py). OpenMP
 * shares the process's runtime, the libgomp torch has loaded, so its
 * threads are torch's.
 *
 * The boundary is this file: library.py reads the structs and the
 * signatures of the exported (non-static) functions below and declares
 * them to ctypes from here, and checks the structs' sizes against
 * `struct_sizes` when it loads the library; check.py tests every exported
 * function against torch before the backend uses any.
 *
 * decode_attention: one query token per row, attended over its own keys
 * where they lie in the paged pool: no copy of the keys first. The torch
 * reference (backends/reference) gathers every page a decode group reads,
 * then reads the copy again in two batched products; this reads each key
 * and value once. Attention sinks (gpt-oss: a learned logit per query head,
 * in each softmax's denominator only) are one more term in the maximum and
 * the sum of the softmax; they read nothing from the pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Sixteen floats: one AVX-512 register, two AVX2 ones; the compiler picks. */
#define LANES 16
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec load(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned */
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

static inline float sum_lanes(vec v)
{
    float s = 0.0f;
    for (int i = 0; i < LANES; i++)
        s += v[i];
    return s;
}

static inline vec splat(float x) { return (vec){0} + x; }

/* Lane by lane: a where `mask` (a vector comparison's result), else b. */
static inline vec select(ivec mask, vec a, vec b)
{
    ivec ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    const ivec picked = (mask & ia) | (~mask & ib);
    vec out;
    memcpy(&out, &picked, sizeof out);
    return out;
}

/* exp(x) for x <= 0 (softmax weights after the maximum is taken off):
 * 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor
 * series to r^6 (relative error < 2e-7). x below -87 gives e^-87 (~1e-38),
 * a weight no sum notices. */
static inline vec exp_nonpositive(vec x)
{
    x = select(x < -87.0f, splat(-87.0f), x);
    /* Truncating y - 0.5 rounds y <= 0 to the nearest integer. */
    ivec n = __builtin_convertvector(x * 1.44269504f - 0.5f, ivec);
    vec nf = __builtin_convertvector(n, vec);
    vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f; /* ln 2 in two parts, the second exact-ish */
    vec p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    ivec bits = (n + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Dot products of one key row with four query rows, dim floats each (four
 * independent sums, so the multiply-adds overlap). */
static inline void dot4(const float *q0, const float *q1, const float *q2, const float *q3, const float *k,
                        int64_t dim, float *s)
{
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES) {
        const vec kv = load(k + d);
        a0 += load(q0 + d) * kv;
        a1 += load(q1 + d) * kv;
        a2 += load(q2 + d) * kv;
        a3 += load(q3 + d) * kv;
    }
    s[0] = sum_lanes(a0), s[1] = sum_lanes(a1), s[2] = sum_lanes(a2), s[3] = sum_lanes(a3);
    for (; d < dim; d++)
        s[0] += q0[d] * k[d], s[1] += q1[d] * k[d], s[2] += q2[d] * k[d], s[3] += q3[d] * k[d];
}

/* Where key position p of a row lies in the pool. */
static inline const float *slot(const float *cache, const int64_t *row_pages, int64_t p, int64_t block0,
                                int64_t block_size, int64_t page_stride, int64_t slot_stride)
{
    return cache + row_pages[p / block_size - block0] * page_stride + (p % block_size) * slot_stride;
}

/* One row and up to four of a KV head's query heads (count): scores
 * [4][n] is scratch; sink[g] is head g's sink logit (-INFINITY: none). */
static void attend_heads(const float *const qs[4], float *const os[4], const float sink[4], int64_t count,
                         const float *cache, const int64_t *row_pages, int64_t lo, int64_t n, int64_t block0,
                         int64_t block_size, int64_t page_stride, int64_t half_stride, int64_t slot_stride,
                         int64_t dim, float scale, float softcap, float *scores)
{
    float s[4];
    const int64_t last_block = (lo + n - 1) / block_size;
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = lo + i;
        /* The next block's row at this slot, fetched a block ahead: the
         * pages of a row lie anywhere in the pool, where the hardware's own
         * prefetch does not follow. */
        if (p / block_size < last_block) {
            const char *next = (const char *)slot(cache, row_pages, p + block_size, block0, block_size, page_stride,
                                                  slot_stride);
            for (int64_t b = 0; b < dim * (int64_t)sizeof(float); b += 64)
                __builtin_prefetch(next + b);
        }
        /* And this key's value row, for the second pass to find in cache. */
        const char *value = (const char *)(slot(cache, row_pages, p, block0, block_size, page_stride, slot_stride) +
                                           half_stride);
        for (int64_t b = 0; b < dim * (int64_t)sizeof(float); b += 64)
            __builtin_prefetch(value + b);
        dot4(qs[0], qs[1], qs[2], qs[3], slot(cache, row_pages, p, block0, block_size, page_stride, slot_stride),
             dim, s);
        for (int g = 0; g < 4; g++)
            scores[g * n + i] = softcap > 0.0f ? tanhf(s[g] * scale / softcap) * softcap : s[g] * scale;
    }
    float total[4];
    for (int g = 0; g < count; g++) {
        float *sg = scores + g * n, top = sink[g];
        for (int64_t i = 0; i < n; i++)
            top = sg[i] > top ? sg[i] : top;
        vec sum = {0};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            const vec e = exp_nonpositive(load(sg + i) - top);
            store(sg + i, e);
            sum += e;
        }
        total[g] = sum_lanes(sum) + expf(sink[g] - top); /* the sink weighs no value */
        for (; i < n; i++) {
            sg[i] = expf(sg[i] - top);
            total[g] += sg[i];
        }
    }
    /* Values weighted in slices of four vectors per head (sixteen
     * accumulators), over keys a block at a time so that a block's value
     * rows stay in cache while each slice reads its part of them. */
    const int64_t key_block = 64;
    int64_t d = 0;
    for (int g = 0; g < count; g++)
        memset(os[g], 0, sizeof(float) * (size_t)dim);
    for (int64_t i0 = 0; i0 < n; i0 += key_block) {
        const int64_t i1 = i0 + key_block < n ? i0 + key_block : n;
        for (d = 0; d + 4 * LANES <= dim; d += 4 * LANES) {
            vec acc[4][4];
            for (int g = 0; g < 4; g++)
                for (int j = 0; j < 4; j++)
                    acc[g][j] = load(os[g] + d + j * LANES);
            for (int64_t i = i0; i < i1; i++) {
                const float *v = slot(cache, row_pages, lo + i, block0, block_size, page_stride, slot_stride) +
                                 half_stride + d;
                const vec v0 = load(v), v1 = load(v + LANES), v2 = load(v + 2 * LANES), v3 = load(v + 3 * LANES);
                for (int g = 0; g < 4; g++) {
                    const vec w = splat(scores[g * n + i]);
                    acc[g][0] += w * v0, acc[g][1] += w * v1, acc[g][2] += w * v2, acc[g][3] += w * v3;
                }
            }
            for (int g = 0; g < count; g++)
                for (int j = 0; j < 4; j++)
                    store(os[g] + d + j * LANES, acc[g][j]);
        }
    }
    for (int g = 0; g < count; g++) {
        const float inv = 1.0f / total[g];
        for (int64_t j = 0; j < d; j++)
            os[g][j] *= inv;
    }
    for (; d < dim; d++) {
        for (int g = 0; g < count; g++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < n; i++)
                acc += scores[g * n + i] *
                       slot(cache, row_pages, lo + i, block0, block_size, page_stride, slot_stride)[half_stride + d];
            os[g][d] = acc / total[g];
        }
    }
}

/* One layer's paged K/V cache as the kernels address it: float32, strides
 * in floats (page, K/V half, slot, head; head_dim contiguous). */
typedef struct {
    float *data;
    int64_t page_stride, half_stride, slot_stride, head_stride;
    int64_t block_size, kv_heads, head_dim;
} paged_cache;

/* A step's decode rows: each reads key positions first[r] .. last[r]
 * (inclusive; last is the query's own position) through pages[r] (its
 * pages from the block holding its first key, max_blocks per row). A
 * decoder layer also stores each row's new K/V at (store_pages[r],
 * store_offsets[r]); attention alone leaves those NULL. */
typedef struct {
    int64_t rows, max_blocks;
    const int64_t *pages, *first, *last;
    const int64_t *store_pages, *store_offsets;
} decode_rows;

/* Row r of a decode batch, the query heads g0 .. g0 + count - 1 of KV
 * head h (count <= 4); see decode_attention for the arguments. Returns 0,
 * or -1 where memory for the scores could not be had. */
static int attend_row(const float *q, const paged_cache *c, const decode_rows *d, int64_t r, int64_t groups,
                      int64_t h, int64_t g0, int64_t count, float scale, float softcap, const float *sinks,
                      float *out)
{
    const int64_t lo = d->first[r], hi = d->last[r], n = hi - lo + 1, dim = c->head_dim;
    const int64_t block_size = c->block_size;
    float *scores = malloc(sizeof(float) * (size_t)(4 * n));
    if (scores == NULL)
        return -1;
    const float *qs[4];
    float *os[4];
    float sink[4];
    for (int g = 0; g < 4; g++) { /* missing heads repeat the last: computed, not written */
        const int64_t head = h * groups + g0 + (g < count ? g : count - 1);
        qs[g] = q + head * dim;
        os[g] = out + head * dim;
        sink[g] = sinks != NULL ? sinks[head] : -INFINITY;
    }
    attend_heads(qs, os, sink, count, c->data + h * c->head_stride, d->pages + r * d->max_blocks, lo, n,
                 lo / block_size, block_size, c->page_stride, c->half_stride, c->slot_stride, dim, scale, softcap,
                 scores);
    free(scores);
    return 0;
}

/* q [rows, q_heads, head_dim] float32, contiguous; out the same: each
 * row's query heads attended over its keys (`decode_rows`) in the cache.
 * softcap <= 0: none. sinks [q_heads] float32, or NULL: none. Returns 0,
 * or -1 where memory for the scores could not be had. */
int decode_attention(const paged_cache *cache, const decode_rows *rows, const float *q, int64_t q_heads,
                     float scale, float softcap, const float *sinks, float *out, int threads)
{
    const int64_t dim = cache->head_dim, groups = q_heads / cache->kv_heads, batches = (groups + 3) / 4;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) collapse(2) reduction(| : failed)
    for (int64_t r = 0; r < rows->rows; r++) {
        for (int64_t hb = 0; hb < cache->kv_heads * batches; hb++) {
            const int64_t h = hb / batches, g0 = hb % batches * 4;
            const int64_t count = groups - g0 < 4 ? groups - g0 : 4;
            failed |= attend_row(q + r * q_heads * dim, cache, rows, r, groups, h, g0, count, scale, softcap,
                                 sinks, out + r * q_heads * dim);
        }
    }
    return failed ? -1 : 0;
}

/* ---- Elementwise work fused: each op one pass over its rows where torch
 * makes several (a norm is a square, a mean, a reciprocal root and two
 * products; rotary a negation, a concatenation, two products and a sum). */

/* Enough work to be worth waking a second thread for. */
#define PARALLEL_WORK (1 << 15)

/* x [outer, inner, dim] with strides (outer_stride, inner_stride, 1); out
 * the same shape, contiguous. Each row of dim: with weight, scaled by
 * rsqrt(mean(x^2) + eps) * (weight + offset); then, with cos and sin
 * ([outer, dim], contiguous), rotated half against half (rotary
 * embeddings, the rotate-half convention; dim even). */
/* out = row * rsqrt(mean(row^2) + eps) * (weight + offset), dim floats
 * (out may be row). */
static void norm_row(const float *row, const float *weight, float offset, float eps, int64_t dim, float *out)
{
    vec squares = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES) {
        const vec v = load(row + d);
        squares += v * v;
    }
    float sum = sum_lanes(squares);
    for (; d < dim; d++)
        sum += row[d] * row[d];
    const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    for (d = 0; d + LANES <= dim; d += LANES)
        store(out + d, load(row + d) * scale * (load(weight + d) + offset));
    for (; d < dim; d++)
        out[d] = row[d] * scale * (weight[d] + offset);
}

/* o (dim floats, in place) rotated half against half by c and s. */
static void rotate_row(float *o, const float *c, const float *s, int64_t dim)
{
    const int64_t half = dim / 2;
    int64_t d = 0;
    for (; d + LANES <= half; d += LANES) {
        const vec x1 = load(o + d), x2 = load(o + half + d);
        store(o + d, x1 * load(c + d) - x2 * load(s + d));
        store(o + half + d, x2 * load(c + half + d) + x1 * load(s + half + d));
    }
    for (; d < half; d++) {
        const float x1 = o[d], x2 = o[half + d];
        o[d] = x1 * c[d] - x2 * s[d];
        o[half + d] = x2 * c[half + d] + x1 * s[half + d];
    }
}

void norm_rotary(const float *x, int64_t outer, int64_t inner, int64_t dim, int64_t outer_stride,
                 int64_t inner_stride, const float *weight, float offset, float eps, const float *cos,
                 const float *sin, float *out, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (outer * inner * dim > PARALLEL_WORK)
    for (int64_t a = 0; a < outer; a++) {
        for (int64_t b = 0; b < inner; b++) {
            const float *row = x + a * outer_stride + b * inner_stride;
            float *o = out + (a * inner + b) * dim;
            if (weight != NULL)
                norm_row(row, weight, offset, eps, dim, o);
            else if (o != row)
                memcpy(o, row, sizeof(float) * (size_t)dim);
            if (cos != NULL)
                rotate_row(o, cos + a * dim, sin + a * dim, dim);
        }
    }
}

/* sigmoid(x) from exp of a non-positive argument only: 1 / (1 + e^-x)
 * for x >= 0, e^x / (1 + e^x) below. */
static inline vec sigmoid(vec x)
{
    const vec e = exp_nonpositive(select(x > 0.0f, -x, x)); /* e^-|x| */
    const vec s = 1.0f / (1.0f + e);
    return select(x >= 0.0f, s, e * s);
}

/* act(x) * up: act SiLU (kind 0) or GELU with the tanh approximation
 * (kind 1), where 0.5 x (1 + tanh(y)) = x * sigmoid(2y). */
static inline vec gated(vec x, vec up, int kind)
{
    const vec y = kind == 0 ? x : 1.5957691216f * (x + 0.044715f * x * x * x); /* 2 sqrt(2/pi) (...) */
    return x * sigmoid(y) * up;
}

/* gate_up [rows, 2 * inter] (row stride `stride`): the gate's columns,
 * then the up projection's. out [rows, inter] = act(gate) * up (`gated`). */
void gated_activation(const float *gate_up, int64_t rows, int64_t inter, int64_t stride, int kind, float *out,
                      int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter > PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * stride, *u = g + inter;
        float *o = out + r * inter;
        int64_t j = 0;
        for (; j + LANES <= inter; j += LANES)
            store(o + j, gated(load(g + j), load(u + j), kind));
        for (; j < inter; j++) {
            const float x = g[j];
            const float y = kind == 0 ? x : 1.5957691216f * (x + 0.044715f * x * x * x);
            o[j] = x / (1.0f + expf(-y)) * u[j];
        }
    }
}

/* ---- A decoder layer's decode step in one call: a few query rows, every
 * product a matrix-vector one that reads each weight once, all of it in
 * one parallel region. At batch 1 a step through torch's modules spends
 * as long between the products as in the elementwise work itself: ~15
 * calls per layer from Python, each waking the threads again. */

/* The dot products of x with `count` (<= 4) consecutive rows of w, k
 * floats each (rows past count repeat the last: computed, not kept). */
static inline void dot_rows(const float *x, const float *w, int64_t k, int64_t count, float *out)
{
    const float *w0 = w, *w1 = w + (count > 1) * k, *w2 = w + (count > 2 ? 2 : count - 1) * k,
                *w3 = w + (count > 3 ? 3 : count - 1) * k;
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t d = 0;
    for (; d + LANES <= k; d += LANES) {
        const vec xv = load(x + d);
        a0 += load(w0 + d) * xv, a1 += load(w1 + d) * xv, a2 += load(w2 + d) * xv, a3 += load(w3 + d) * xv;
    }
    float s[4] = {sum_lanes(a0), sum_lanes(a1), sum_lanes(a2), sum_lanes(a3)};
    for (; d < k; d++)
        s[0] += x[d] * w0[d], s[1] += x[d] * w1[d], s[2] += x[d] * w2[d], s[3] += x[d] * w3[d];
    for (int64_t c = 0; c < count; c++)
        out[c] = s[c];
}

/* out [rows, n] = x [rows, k] times w [n, k] transposed, plus bias (or
 * none): the calling thread's share of the columns (a worksharing loop
 * inside the caller's parallel region; its end is a barrier). Four weight
 * rows at a time, read once for every row of x. */
static void products(const float *x, int64_t rows, int64_t k, const float *w, const float *bias, int64_t n,
                     float *out)
{
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j += 4) {
        const int64_t count = n - j < 4 ? n - j : 4;
        for (int64_t r = 0; r < rows; r++) {
            float *o = out + r * n + j;
            dot_rows(x + r * k, w + j * k, k, count, o);
            if (bias != NULL)
                for (int64_t c = 0; c < count; c++)
                    o[c] += bias[j + c];
        }
    }
}

/* The gated MLP's first half: out [rows, inter] = act(gate) * up, gate_up
 * [2 * inter, k] (the gate's rows, then up's), LANES columns at a time. */
static void gated_products(const float *x, int64_t rows, int64_t k, const float *gate_up, int64_t inter, int kind,
                           float *out)
{
#pragma omp for schedule(static)
    for (int64_t j = 0; j < inter; j += LANES) {
        const int64_t count = inter - j < LANES ? inter - j : LANES;
        for (int64_t r = 0; r < rows; r++) {
            float g[LANES] = {0}, u[LANES] = {0};
            for (int64_t c = 0; c < count; c += 4) {
                const int64_t part = count - c < 4 ? count - c : 4;
                dot_rows(x + r * k, gate_up + (j + c) * k, k, part, g + c);
                dot_rows(x + r * k, gate_up + (inter + j + c) * k, k, part, u + c);
            }
            float o[LANES];
            store(o, gated(load(g), load(u), kind));
            memcpy(out + r * inter + j, o, sizeof(float) * (size_t)count);
        }
    }
}

/* x += norm(sub) (sub normed in place; no norm: x += sub), dim floats. */
static void add_residual(float *x, float *sub, const float *norm, float offset, float eps, int64_t dim)
{
    if (norm != NULL)
        norm_row(sub, norm, offset, eps, dim, sub);
    for (int64_t d = 0; d < dim; d++)
        x[d] += sub[d];
}

/* One decoder layer's weights and shape (decoder.py fills it).
 * Products' weights are dense [out, in]; a NULL norm, bias or sinks
 * ([q_heads] attention sink logits) is absent. */
typedef struct {
    int64_t hidden, q_heads, kv_heads, head_dim, inter, activation;
    float eps, norm_offset, scale, softcap; /* softcap <= 0: none */
    const float *input_norm, *post_attention_norm, *pre_feedforward_norm, *post_feedforward_norm;
    const float *q_norm, *k_norm, *sinks;
    const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *down;
} decoder_layer;

/* The layer's parts, between which a tensor-parallel rank (decoder.py)
 * sums its output products with the other ranks': it holds its share of
 * the heads and of the MLP's width, so Wo and down give partial sums, and
 * the residual add and the norms after them need the whole sum. */
enum { LAYER_WHOLE = 0, LAYER_ATTENTION = 1, LAYER_FEED_FORWARD = 2, LAYER_LAST_RESIDUAL = 3 };

/* sums [rows, hidden] = attn(rotary(norm(q)), ...) Wo (+ b) of h = norm(x),
 * the new K/V stored: each thread's share, inside the caller's parallel
 * region. A failed attention row sets *failed. */
static void attention_part(const decoder_layer *L, const paged_cache *c, const decode_rows *d, const float *x,
                           const float *cos, const float *sin, float *h, float *qkv, float *attn, float *sums,
                           int *failed)
{
    const int64_t rows = d->rows, block_size = c->block_size, page_stride = c->page_stride;
    const int64_t half_stride = c->half_stride, slot_stride = c->slot_stride, head_stride = c->head_stride;
    const int64_t *store_pages = d->store_pages, *store_offsets = d->store_offsets;
    float *cache = c->data;
    const int64_t H = L->hidden, dim = L->head_dim, heads = L->q_heads + L->kv_heads;
    const int64_t q_width = L->q_heads * dim, kv_width = L->kv_heads * dim, qkv_width = q_width + 2 * kv_width;
    const int64_t groups = L->q_heads / L->kv_heads, batches = (groups + 3) / 4;
    const float offset = L->norm_offset, eps = L->eps;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + r * H, L->input_norm, offset, eps, H, h + r * H);
    products(h, rows, H, L->qkv, L->qkv_bias, qkv_width, qkv);
#pragma omp for schedule(static) collapse(2)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t head = 0; head < heads; head++) { /* the query heads, then the key heads */
            float *row = qkv + r * qkv_width + head * dim;
            const float *weight = head < L->q_heads ? L->q_norm : L->k_norm;
            if (weight != NULL)
                norm_row(row, weight, offset, eps, dim, row);
            rotate_row(row, cos + r * dim, sin + r * dim, dim);
        }
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *page = cache + store_pages[r] * page_stride;
        const float *k = qkv + r * qkv_width + q_width, *v = k + kv_width;
        for (int64_t head = 0; head < L->kv_heads; head++) {
            float *slot0 = page + store_offsets[r] * slot_stride + head * head_stride;
            memcpy(slot0, k + head * dim, sizeof(float) * (size_t)dim);
            memcpy(slot0 + half_stride, v + head * dim, sizeof(float) * (size_t)dim);
            for (int64_t s = 1; store_offsets[r] == 0 && s < block_size; s++) {
                memset(page + s * slot_stride + head * head_stride, 0, sizeof(float) * (size_t)dim);
                memset(page + half_stride + s * slot_stride + head * head_stride, 0, sizeof(float) * (size_t)dim);
            }
        }
    }
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t hb = 0; hb < L->kv_heads * batches; hb++) {
            const int64_t head = hb / batches, g0 = hb % batches * 4;
            const int64_t count = groups - g0 < 4 ? groups - g0 : 4;
            if (attend_row(qkv + r * qkv_width, c, d, r, groups, head, g0, count, L->scale, L->softcap, L->sinks,
                           attn + r * q_width) != 0) {
#pragma omp atomic write
                *failed = 1;
            }
        }
    }
    products(attn, rows, q_width, L->o, L->o_bias, H, sums);
}

/* x += post_norm(sums) (the attention's), then sums [rows, hidden] =
 * down(act(h Wg) * h Wu) with h = pre_norm(x): inside the caller's region. */
static void feed_forward_part(const decoder_layer *L, int64_t rows, float *x, float *h, float *act, float *sums)
{
    const int64_t H = L->hidden;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        add_residual(x + r * H, sums + r * H, L->post_attention_norm, L->norm_offset, L->eps, H);
        norm_row(x + r * H, L->pre_feedforward_norm, L->norm_offset, L->eps, H, h + r * H);
    }
    gated_products(h, rows, H, L->gate_up, L->inter, (int)L->activation, act);
    products(act, rows, L->inter, L->down, NULL, H, sums);
}

/* x [rows, hidden] (in place: the residual stream) through one layer, each
 * row one sequence's next token:
 *   h = norm(x); q, k, v = h Wqkv (+ b); q, k = rotary(norm(q), norm(k));
 *   k, v stored at (store_pages[r], store_offsets[r]) of the cache;
 *   attention as decode_attention over the rows' keys (`decode_rows`),
 *   with the layer's sinks where it has them;
 *   x += post_norm(attn Wo (+ b)); x += post_norm(down(act(h Wg) * h Wu))
 *   with h = pre_norm(x)
 * (a missing post norm is the identity). A block written first here gets
 * the slots after the new token zeroed, as the torch reference's `store`
 * does. cos, sin [rows, head_dim].
 *
 * `part` LAYER_WHOLE runs all of it in one parallel region (`sums` may be
 * NULL). A tensor-parallel rank runs it in three calls, adding up `sums`
 * [rows, hidden] with the other ranks' after the first two: LAYER_ATTENTION
 * leaves its attention's partial output product in `sums`,
 * LAYER_FEED_FORWARD adds the summed one to x and leaves the MLP's partial
 * product there, LAYER_LAST_RESIDUAL adds the summed one to x. Returns 0,
 * or -1 where memory for scratch could not be had (or `part` is none of
 * these). */
int decode_layer(const decoder_layer *L, const paged_cache *c, const decode_rows *d, float *x, const float *cos,
                 const float *sin, float *sums, int part, int threads)
{
    if (part < LAYER_WHOLE || part > LAYER_LAST_RESIDUAL)
        return -1;
    const int64_t rows = d->rows, H = L->hidden, dim = L->head_dim;
    const int64_t q_width = L->q_heads * dim, qkv_width = q_width + 2 * L->kv_heads * dim;
    float *scratch = malloc(sizeof(float) * (size_t)(rows * (2 * H + qkv_width + q_width + L->inter)));
    if (scratch == NULL)
        return -1;
    float *h = scratch, *qkv = h + rows * H, *attn = qkv + rows * qkv_width, *act = attn + rows * q_width,
          *sub = act + rows * L->inter;
    if (sums == NULL)
        sums = sub;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        if (part == LAYER_WHOLE || part == LAYER_ATTENTION)
            attention_part(L, c, d, x, cos, sin, h, qkv, attn, sums, &failed);
        if (part == LAYER_WHOLE || part == LAYER_FEED_FORWARD)
            feed_forward_part(L, rows, x, h, act, sums);
        if (part == LAYER_WHOLE || part == LAYER_LAST_RESIDUAL) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                add_residual(x + r * H, sums + r * H, L->post_feedforward_norm, L->norm_offset, L->eps, H);
        }
    }
    free(scratch);
    return failed ? -1 : 0;
}

/* The sizes of the structs above, in the order they are declared, for the
 * loader to check against its own (library.py). */
void struct_sizes(int64_t *out)
{
    out[0] = (int64_t)sizeof(paged_cache);
    out[1] = (int64_t)sizeof(decode_rows);
    out[2] = (int64_t)sizeof(decoder_layer);
}
