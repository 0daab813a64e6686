/* Causal attention over a KV cache whose result for a query row never depends on the other rows,
 * fused with what comes before it in a layer: the optional per-head RMS norms of queries and keys,
 * RoPE (rotate-half layout), and the write of the new keys and values into the cache.
 *
 * The row at position p of head h attends to keys [lo, p] of its key-value head (lo = 0, or
 * p - window + 1 with a sliding window): scores = scale * q . k, a softmax, and the weighted sum
 * of the values. Each (head, row) is one thread's work, done by the same operations whatever the
 * number of rows in the call, so verifying k tokens gives each position exactly the bits of a
 * one-token step. Library attention kernels block their products by the number of query rows,
 * and on weights held as 8-bit blocks (whose activations are quantised per block) a difference
 * in the last bit can change a product by a quantisation step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include <omp.h>

#define LANES 8

/* out[j] = q . key[j] for `count` keys `stride` floats apart, of n values (a multiple of LANES):
 * per key, products summed lane-wise in order of i, then the lanes in a fixed order (the same
 * bits whatever `count`; keys are taken four at a time so that their sums do not wait on each
 * other). */
#ifdef __AVX2__
static inline float lanes_sum(__m256 v) {
    float l[LANES], sum = 0.0f;
    _mm256_storeu_ps(l, v);
    for (int i = 0; i < LANES; ++i) sum += l[i];
    return sum;
}

static void scores_of(const float *q, const float *key, int64_t stride, int64_t count, int n,
                      float *out) {
    int64_t j = 0;
    for (; j + 4 <= count; j += 4) {
        const float *k = key + j * stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < n; i += LANES) {
            __m256 qi = _mm256_loadu_ps(q + i);
            a0 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + i), a0);
            a1 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + stride + i), a1);
            a2 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + 2 * stride + i), a2);
            a3 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + 3 * stride + i), a3);
        }
        out[j] = lanes_sum(a0), out[j + 1] = lanes_sum(a1);
        out[j + 2] = lanes_sum(a2), out[j + 3] = lanes_sum(a3);
    }
    for (; j < count; ++j) {
        const float *k = key + j * stride;
        __m256 a0 = _mm256_setzero_ps();
        for (int i = 0; i < n; i += LANES)
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
        out[j] = lanes_sum(a0);
    }
}

/* o[i] += w[j] * value[j][i] for `count` value rows `stride` floats apart, in order of j, for
 * each i < n (a multiple of LANES); o is kept in registers 64 values at a time. */
static void weighted_sum(float *o, const float *w, const float *value, int64_t stride,
                         int64_t count, int n) {
    for (int c = 0; c < n; c += 64) {
        int width = n - c < 64 ? (n - c) / LANES : 8;
        __m256 acc[8];
        for (int v = 0; v < width; ++v) acc[v] = _mm256_loadu_ps(o + c + v * LANES);
        for (int64_t j = 0; j < count; ++j) {
            __m256 wj = _mm256_set1_ps(w[j]);
            const float *row = value + j * stride + c;
            for (int v = 0; v < width; ++v)
                acc[v] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(row + v * LANES), acc[v]);
        }
        for (int v = 0; v < width; ++v) _mm256_storeu_ps(o + c + v * LANES, acc[v]);
    }
}
#else
static void scores_of(const float *q, const float *key, int64_t stride, int64_t count, int n,
                      float *out) {
    for (int64_t j = 0; j < count; ++j) {
        const float *k = key + j * stride;
        float acc[LANES] = {0}, sum = 0.0f;
        for (int i = 0; i < n; i += LANES)
            for (int l = 0; l < LANES; ++l) acc[l] = fmaf(q[i + l], k[i + l], acc[l]);
        for (int l = 0; l < LANES; ++l) sum += acc[l];
        out[j] = sum;
    }
}

static void weighted_sum(float *o, const float *w, const float *value, int64_t stride,
                         int64_t count, int n) {
    for (int64_t j = 0; j < count; ++j)
        for (int i = 0; i < n; ++i) o[i] = fmaf(w[j], value[j * stride + i], o[i]);
}
#endif

/* The largest of x[0..n-1] (lane-wise, then lanes; exact whatever the order). */
static inline float largest(const float *x, int64_t n) {
    float top[LANES];
    int64_t i = 0;
#ifdef __AVX2__
    __m256 best8 = _mm256_set1_ps(-INFINITY);
    for (; i + LANES <= n; i += LANES) best8 = _mm256_max_ps(best8, _mm256_loadu_ps(x + i));
    _mm256_storeu_ps(top, best8);
#else
    for (int l = 0; l < LANES; ++l) top[l] = -INFINITY;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; ++l) top[l] = top[l] > x[i + l] ? top[l] : x[i + l];
#endif
    float best = -INFINITY;
    for (; i < n; ++i) best = best > x[i] ? best : x[i];
    for (int l = 0; l < LANES; ++l) best = best > top[l] ? best : top[l];
    return best;
}

/* x[i] = e^(x[i] - top) for i < n; returns their sum (lane-wise, then lanes, in a fixed order). */
static inline float exp_sum(float *x, int64_t n, float top) {
    float acc[LANES] = {0}, total = 0.0f;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 sum = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    for (; i + LANES <= n; i += LANES) {
        __m256 e = exp8_approx(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift));
        _mm256_storeu_ps(x + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(acc, sum);
#else
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += x[i + l] = exp_approx(x[i + l] - top);
#endif
    for (int l = 0; l < LANES; ++l) total += acc[l];
    for (; i < n; ++i) total += x[i] = exp_approx(x[i] - top);
    return total;
}

/* RMS norm of one head's `dim` values in place, with scale `offset + weight` (NULL: none). */
static void head_norm(float *x, int dim, const float *weight, float eps, float offset) {
    if (!weight) return;
    float squares[LANES] = {0};
    for (int i = 0; i < dim; i += LANES)
        for (int l = 0; l < LANES; ++l) squares[l] += x[i + l] * x[i + l];
    float sum = 0.0f;
    for (int l = 0; l < LANES; ++l) sum += squares[l];
    float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int i = 0; i < dim; ++i) x[i] = x[i] * inv * (offset + weight[i]);
}

/* out = RoPE of x (rotate-half: the first half pairs with the second) with this position's
 * cos and sin rows. */
static void rope(const float *x, const float *cos, const float *sin, int dim, float *out) {
    int half = dim / 2;
    for (int i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    for (int i = half; i < dim; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

static inline int64_t position_of(const Rows *R, int r) {
    return R->positions ? R->positions[r] : R->start + r;
}

/* The cache of row r's sequence (keys or values), at key-value head 0. */
static inline float *cache_of(const Rows *R, float *cache, int r) {
    return cache + (R->slots ? R->slots[r] : 0) * R->slot_stride;
}

/* Row r's RoPE table row (cos or sin). */
static inline const float *table_of(const Rows *R, const float *table, int r, int dim) {
    return table + (position_of(R, r) - R->table_first) * dim;
}

int64_t dl_attention_scratch(const AttentionShape *s, const Rows *R) {
    int64_t top = 0;
    for (int r = 0; r < R->rows; ++r) top = position_of(R, r) > top ? position_of(R, r) : top;
    return top + 1 + (2 + R->rows) * (int64_t)s->dim;
}

/* Key of the call's row r for key-value head g (normed, rotated) into `out`; `scratch`: dim
 * floats. */
static void new_key(const AttentionShape *s, const Rows *R, const float *qkv, int64_t ld_qkv,
                    const float *cos, const float *sin, int g, int r, float *scratch, float *out) {
    int dim = s->dim;
    const float *k = qkv + (int64_t)r * ld_qkv + (int64_t)(s->heads + g) * dim;
    for (int i = 0; i < dim; ++i) scratch[i] = k[i];
    head_norm(scratch, dim, s->k_norm, s->norm_eps, s->norm_offset);
    rope(scratch, table_of(R, cos, r, dim), table_of(R, sin, r, dim), dim, out);
}

void dl_attention_write(const AttentionShape *s, const Rows *R, const float *qkv, int64_t ld_qkv,
                        const float *cos, const float *sin, float *keys, float *values) {
    int dim = s->dim;
#pragma omp for schedule(static) nowait
    for (int task = 0; task < R->rows * s->kv_heads; ++task) {
        int r = task / s->kv_heads, g = task % s->kv_heads;
        float scratch[dim];
        int64_t at = g * s->kv_stride + position_of(R, r) * dim;
        const float *v = qkv + (int64_t)r * ld_qkv + (int64_t)(s->heads + s->kv_heads + g) * dim;
        float *vslot = cache_of(R, values, r) + at;
        new_key(s, R, qkv, ld_qkv, cos, sin, g, r, scratch, cache_of(R, keys, r) + at);
        for (int i = 0; i < dim; ++i) vslot[i] = v[i];
    }
}

void dl_attention_rows(const AttentionShape *s, const Rows *R, const float *qkv, int64_t ld_qkv,
                       const float *cos, const float *sin, float *keys, float *values, float *out,
                       int written, float *scratch) {
    int dim = s->dim, heads = s->heads, group = heads / s->kv_heads, rows = R->rows;
    int64_t v_offset = (int64_t)(heads + s->kv_heads) * dim, start = position_of(R, 0);
    int64_t score_n = dl_attention_scratch(s, R) - (2 + rows) * (int64_t)dim;
#pragma omp for schedule(dynamic, 1) nowait
    for (int task = 0; task < heads * rows; ++task) {
        int h = task / rows, r = task % rows, g = h / group;
        int64_t p = position_of(R, r);
        int64_t lo = s->window > 0 && p - s->window + 1 > 0 ? p - s->window + 1 : 0;
        float *scores = scratch, *normed = scores + score_n;
        float *qr = normed + dim, *fresh = qr + dim; /* unless written: new rows' keys 0..r */
        const float *q = qkv + (int64_t)r * ld_qkv + (int64_t)h * dim;
        for (int i = 0; i < dim; ++i) normed[i] = q[i];
        head_norm(normed, dim, s->q_norm, s->norm_eps, s->norm_offset);
        rope(normed, table_of(R, cos, r, dim), table_of(R, sin, r, dim), dim, qr);
        const float *k = cache_of(R, keys, r) + (int64_t)g * s->kv_stride;
        const float *v = cache_of(R, values, r) + (int64_t)g * s->kv_stride;
        /* positions read from the cache; without `written`, the call's rows are one sequence's
         * consecutive positions start.., whose keys each task computes itself */
        int64_t cached = written ? p + 1 : start;
        if (!written) {
            for (int n = 0; n <= r; ++n)
                new_key(s, R, qkv, ld_qkv, cos, sin, g, n, normed, fresh + n * dim);
            if (h % group == 0) { /* this row's key and value go into the cache for later calls */
                float *slot = (float *)k + p * dim, *vslot = (float *)v + p * dim;
                const float *value = qkv + (int64_t)r * ld_qkv + v_offset + (int64_t)g * dim;
                for (int i = 0; i < dim; ++i) slot[i] = fresh[r * dim + i], vslot[i] = value[i];
            }
        }
        /* keys and values are the same bits from the cache or computed afresh */
        int64_t from_cache = cached > lo ? cached - lo : 0, first_new = lo > cached ? lo : cached;
        const float *new_values = qkv + v_offset + (int64_t)g * dim;
        scores_of(qr, k + lo * dim, dim, from_cache, dim, scores + lo);
        scores_of(qr, fresh + (first_new - start) * dim, dim, p + 1 - first_new, dim,
                  scores + first_new);
        for (int64_t j = lo; j <= p; ++j) scores[j] *= s->scale;
        float total = exp_sum(scores + lo, p + 1 - lo, largest(scores + lo, p + 1 - lo));
        float *o = out + (int64_t)r * heads * dim + (int64_t)h * dim;
        for (int i = 0; i < dim; ++i) o[i] = 0.0f;
        weighted_sum(o, scores + lo, v + lo * dim, dim, from_cache, dim);
        weighted_sum(o, scores + first_new, new_values + (first_new - start) * ld_qkv, ld_qkv,
                     p + 1 - first_new, dim);
        float inv = 1.0f / total;
        for (int i = 0; i < dim; ++i) o[i] *= inv;
    }
}

/* One layer's attention for `rows` new positions start.. of one sequence from their fused
 * projection `qkv` ([rows][ld_qkv]: heads * dim query values, then kv_heads * dim keys, then as
 * many values). Writes the new keys (normed, rotated) and values into `keys`/`values`
 * ([kv_heads][kv_stride / dim][dim], positions 0..start+rows-1 then cached) and the attention
 * output to `out` ([rows][heads * dim]). `cos`/`sin`: [rows][dim], the rows' RoPE tables.
 * `q_norm`/`k_norm`: per-head RMS norm weights, or NULL. Returns 0, or -1 when dim is not a
 * multiple of 8, -2 when out of memory. */
int dl_attention(const float *qkv, int64_t ld_qkv, const float *cos, const float *sin,
                 const float *q_norm, const float *k_norm, float norm_eps, float norm_offset,
                 float *keys, float *values, float *out, int heads, int kv_heads, int dim,
                 int rows, int64_t start, int64_t kv_stride, int64_t window, float scale,
                 int threads) {
    if (dim % LANES) return -1;
    AttentionShape s = {heads, kv_heads, dim, kv_stride, window, scale,
                        q_norm, k_norm, norm_eps, norm_offset};
    Rows R = {rows, NULL, start, NULL, 0, start};
    int64_t positions = start + rows, each = dl_attention_scratch(&s, &R);
    int team = threads > 1 && (int64_t)heads * rows * positions > 4096 ? threads : 1;
    float *scratch = malloc((size_t)(each * team) * sizeof(float));
    if (!scratch) return -2;
#pragma omp parallel num_threads(team) if (team > 1)
    dl_attention_rows(&s, &R, qkv, ld_qkv, cos, sin, keys, values, out, 0,
                      scratch + each * omp_get_thread_num());
    free(scratch);
    return 0;
}
