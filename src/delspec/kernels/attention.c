/* Causal attention over a KV cache whose result for a query row never depends on the other rows,
 * fused with what comes before it in a layer: the optional per-head RMS norms of queries and keys,
 * RoPE (rotate-half layout), and the write of the new keys and values into the cache.
 *
 * The row at position p of head h attends to keys [lo, p] of its key-value head (lo = 0, or
 * p - window + 1 with a sliding window): scores = scale * q . k, a softmax, and the weighted sum
 * of the values. A thread's task is one row of up to BLOCK_ROWS query heads of one key-value head:
 * each key and value loaded serves all of them. Each (head, row) gets the same operations in the
 * same order whatever the number of rows in the call and of heads computed with it (each product
 * sum and each output value accumulates in its own lanes, in order of i and of key), so verifying
 * k tokens gives each position exactly the bits of a one-token step. Library attention kernels
 * block their products by the number of query rows, and on weights held as 8-bit blocks (whose
 * activations are quantised per block) a difference in the last bit can change a product by a
 * quantisation step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include <omp.h>

#define LANES 8

/* out[r * ld_out + j] = q[r * ld_q] . key[j] for m (<= BLOCK_ROWS) query rows and `count` keys
 * `stride` floats apart, of n values (a multiple of LANES): per (row, key), products summed
 * lane-wise in order of i, then 0.0f plus the lanes in order 0..7 (the same bits whatever m,
 * `count` and the blocking; each key's load serves all m rows).
 *
 * o[r * ld_o + i] += w[r * ld_w + j] * value[j][i] for m rows and `count` value rows `stride`
 * floats apart, in order of j, for each i < n (a multiple of LANES). */
#ifdef __AVX2__
#ifdef __AVX512VL__
#define BLOCK_ROWS 4    /* query rows computed together */
#define ACCUMULATORS 24 /* vector accumulators of a block (32 vector registers) */
#else
#define BLOCK_ROWS 2
#define ACCUMULATORS 8 /* (16 vector registers) */
#endif

static inline float lanes_sum(__m256 v) {
    float l[LANES], sum = 0.0f;
    _mm256_storeu_ps(l, v);
    for (int i = 0; i < LANES; ++i) sum += l[i];
    return sum;
}

/* lanes_sum of a[0..7], as the lanes of one vector (an 8x8 transpose, then the lanes added in
 * the same order). */
static inline __m256 lanes_sums(const __m256 *a) {
    __m256 t[8], u[8];
    for (int x = 0; x < 8; x += 2) {
        t[x] = _mm256_unpacklo_ps(a[x], a[x + 1]);
        t[x + 1] = _mm256_unpackhi_ps(a[x], a[x + 1]);
    }
    for (int x = 0; x < 8; x += 4) {
        u[x] = _mm256_shuffle_ps(t[x], t[x + 2], 0x44);
        u[x + 1] = _mm256_shuffle_ps(t[x], t[x + 2], 0xEE);
        u[x + 2] = _mm256_shuffle_ps(t[x + 1], t[x + 3], 0x44);
        u[x + 3] = _mm256_shuffle_ps(t[x + 1], t[x + 3], 0xEE);
    }
    __m256 sum = _mm256_setzero_ps(); /* u[l] | u[l + 4]: lane l of a[0..3] | of a[4..7] */
    for (int l = 0; l < 4; ++l)
        sum = _mm256_add_ps(sum, _mm256_permute2f128_ps(u[l], u[l + 4], 0x20));
    for (int l = 0; l < 4; ++l)
        sum = _mm256_add_ps(sum, _mm256_permute2f128_ps(u[l], u[l + 4], 0x31));
    return sum;
}

static inline __attribute__((always_inline)) void scores_block(const float *q, int64_t ld_q, int m,
                                                               const float *key, int64_t stride,
                                                               int64_t count, int n, float *out,
                                                               int64_t ld_out) {
    const int kb = m * 8 <= ACCUMULATORS ? 8 : 4; /* keys at a time */
    int64_t j = 0;
    for (; j + kb <= count; j += kb) {
        const float *k = key + j * stride;
        __m256 acc[ACCUMULATORS]; /* [row][key] */
        for (int a = 0; a < m * kb; ++a) acc[a] = _mm256_setzero_ps();
        for (int i = 0; i < n; i += LANES) {
            __m256 qi[BLOCK_ROWS];
            for (int r = 0; r < m; ++r) qi[r] = _mm256_loadu_ps(q + r * ld_q + i);
            for (int b = 0; b < kb; ++b) {
                __m256 kj = _mm256_loadu_ps(k + b * stride + i);
                for (int r = 0; r < m; ++r)
                    acc[r * kb + b] = _mm256_fmadd_ps(qi[r], kj, acc[r * kb + b]);
            }
        }
        for (int a = 0; a < m * kb; a += 8) {
            __m256 sums = lanes_sums(acc + a);
            if (kb == 8) {
                _mm256_storeu_ps(out + a / 8 * ld_out + j, sums);
            } else {
                _mm_storeu_ps(out + a / 4 * ld_out + j, _mm256_castps256_ps128(sums));
                _mm_storeu_ps(out + (a / 4 + 1) * ld_out + j, _mm256_extractf128_ps(sums, 1));
            }
        }
    }
    for (; j < count; ++j)
        for (int r = 0; r < m; ++r) {
            __m256 a0 = _mm256_setzero_ps();
            for (int i = 0; i < n; i += LANES)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ld_q + i),
                                     _mm256_loadu_ps(key + j * stride + i), a0);
            out[r * ld_out + j] = lanes_sum(a0);
        }
}

static void scores_of(const float *q, int64_t ld_q, int m, const float *key, int64_t stride,
                      int64_t count, int n, float *out, int64_t ld_out) {
    switch (m) { /* each m its own loops, accumulators in registers */
    case 1: scores_block(q, ld_q, 1, key, stride, count, n, out, ld_out); break;
    case 2: scores_block(q, ld_q, 2, key, stride, count, n, out, ld_out); break;
#if BLOCK_ROWS == 4
    case 3: scores_block(q, ld_q, 3, key, stride, count, n, out, ld_out); break;
    case 4: scores_block(q, ld_q, 4, key, stride, count, n, out, ld_out); break;
#endif
    }
}

static inline __attribute__((always_inline)) void weighted_block(float *o, int64_t ld_o, int m,
                                                                 const float *w, int64_t ld_w,
                                                                 const float *value,
                                                                 int64_t stride, int64_t count,
                                                                 int n) {
    int c = 0;
#ifdef __AVX512F__
    for (; c + 64 <= n; c += 64) { /* the same operations on 16 values per instruction */
        __m512 acc[4 * BLOCK_ROWS]; /* [row][vector] */
        for (int r = 0; r < m; ++r)
            for (int v = 0; v < 4; ++v) acc[r * 4 + v] = _mm512_loadu_ps(o + r * ld_o + c + v * 16);
        for (int64_t j = 0; j < count; ++j) {
            const float *row = value + j * stride + c;
            for (int r = 0; r < m; ++r) {
                __m512 wj = _mm512_set1_ps(w[r * ld_w + j]);
                for (int v = 0; v < 4; ++v)
                    acc[r * 4 + v] =
                        _mm512_fmadd_ps(wj, _mm512_loadu_ps(row + v * 16), acc[r * 4 + v]);
            }
        }
        for (int r = 0; r < m; ++r)
            for (int v = 0; v < 4; ++v) _mm512_storeu_ps(o + r * ld_o + c + v * 16, acc[r * 4 + v]);
    }
#endif
    const int width = m * 8 <= ACCUMULATORS ? 8 : 4; /* vectors of o per row in registers */
    for (; c + width * LANES <= n; c += width * LANES) {
        __m256 acc[ACCUMULATORS]; /* [row][vector] */
        for (int r = 0; r < m; ++r)
            for (int v = 0; v < width; ++v)
                acc[r * width + v] = _mm256_loadu_ps(o + r * ld_o + c + v * LANES);
        for (int64_t j = 0; j < count; ++j) {
            const float *row = value + j * stride + c;
            for (int r = 0; r < m; ++r) {
                __m256 wj = _mm256_set1_ps(w[r * ld_w + j]);
                for (int v = 0; v < width; ++v)
                    acc[r * width + v] =
                        _mm256_fmadd_ps(wj, _mm256_loadu_ps(row + v * LANES), acc[r * width + v]);
            }
        }
        for (int r = 0; r < m; ++r)
            for (int v = 0; v < width; ++v)
                _mm256_storeu_ps(o + r * ld_o + c + v * LANES, acc[r * width + v]);
    }
    for (; c < n; c += LANES)
        for (int r = 0; r < m; ++r) {
            __m256 acc = _mm256_loadu_ps(o + r * ld_o + c);
            for (int64_t j = 0; j < count; ++j)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(w[r * ld_w + j]),
                                      _mm256_loadu_ps(value + j * stride + c), acc);
            _mm256_storeu_ps(o + r * ld_o + c, acc);
        }
}

static void weighted_sums(float *o, int64_t ld_o, int m, const float *w, int64_t ld_w,
                          const float *value, int64_t stride, int64_t count, int n) {
    switch (m) {
    case 1: weighted_block(o, ld_o, 1, w, ld_w, value, stride, count, n); break;
    case 2: weighted_block(o, ld_o, 2, w, ld_w, value, stride, count, n); break;
#if BLOCK_ROWS == 4
    case 3: weighted_block(o, ld_o, 3, w, ld_w, value, stride, count, n); break;
    case 4: weighted_block(o, ld_o, 4, w, ld_w, value, stride, count, n); break;
#endif
    }
}
#else
#define BLOCK_ROWS 1

static void scores_of(const float *q, int64_t ld_q, int m, const float *key, int64_t stride,
                      int64_t count, int n, float *out, int64_t ld_out) {
    for (int r = 0; r < m; ++r)
        for (int64_t j = 0; j < count; ++j) {
            const float *k = key + j * stride, *qr = q + r * ld_q;
            float acc[LANES] = {0}, sum = 0.0f;
            for (int i = 0; i < n; i += LANES)
                for (int l = 0; l < LANES; ++l) acc[l] = fmaf(qr[i + l], k[i + l], acc[l]);
            for (int l = 0; l < LANES; ++l) sum += acc[l];
            out[r * ld_out + j] = sum;
        }
}

static void weighted_sums(float *o, int64_t ld_o, int m, const float *w, int64_t ld_w,
                          const float *value, int64_t stride, int64_t count, int n) {
    for (int r = 0; r < m; ++r)
        for (int64_t j = 0; j < count; ++j)
            for (int i = 0; i < n; ++i)
                o[r * ld_o + i] = fmaf(w[r * ld_w + j], value[j * stride + i], o[r * ld_o + i]);
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

/* The scores of one query row: positions 0..the rows' last. */
static int64_t score_length(const Rows *R) {
    int64_t top = 0;
    for (int r = 0; r < R->rows; ++r) top = position_of(R, r) > top ? position_of(R, r) : top;
    return top + 1;
}

int64_t dl_attention_scratch(const AttentionShape *s, const Rows *R) {
    return BLOCK_ROWS * score_length(R) + (1 + BLOCK_ROWS + R->rows) * (int64_t)s->dim;
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

/* Query heads of one key-value head computed together at a position: up to BLOCK_ROWS, fewer
 * where that leaves a thread of the team without a task. */
static int heads_together(const AttentionShape *s, int rows) {
    int group = s->heads / s->kv_heads, m = group < BLOCK_ROWS ? group : BLOCK_ROWS;
    while (m > 1 && (int64_t)s->kv_heads * ((group + m - 1) / m) * rows < omp_get_num_threads())
        m = (m + 1) / 2;
    return m;
}

void dl_attention_rows(const AttentionShape *s, const Rows *R, const float *qkv, int64_t ld_qkv,
                       const float *cos, const float *sin, float *keys, float *values, float *out,
                       int written, float *scratch) {
    int dim = s->dim, heads = s->heads, group = heads / s->kv_heads, rows = R->rows;
    int m = heads_together(s, rows), blocks = (group + m - 1) / m;
    int64_t v_offset = (int64_t)(heads + s->kv_heads) * dim, start = position_of(R, 0);
    int64_t score_n = score_length(R);
    /* a task: m query heads of key-value head g at row r; one key-value head after the other
     * (its keys and values stay in cache), the last rows (most keys) first */
#pragma omp for schedule(dynamic, 1) nowait
    for (int task = 0; task < s->kv_heads * rows * blocks; ++task) {
        int g = task / (rows * blocks), r = rows - 1 - task / blocks % rows;
        int h0 = g * group + task % blocks * m, mh = group - (h0 - g * group);
        mh = mh < m ? mh : m;
        int64_t p = position_of(R, r);
        int64_t lo = s->window > 0 && p - s->window + 1 > 0 ? p - s->window + 1 : 0;
        float *scores = scratch, *normed = scores + BLOCK_ROWS * score_n; /* [mh][score_n] */
        float *qr = normed + dim, *fresh = qr + BLOCK_ROWS * dim; /* unless written: keys 0..r */
        for (int t = 0; t < mh; ++t) {
            const float *q = qkv + (int64_t)r * ld_qkv + (int64_t)(h0 + t) * dim;
            for (int i = 0; i < dim; ++i) normed[i] = q[i];
            head_norm(normed, dim, s->q_norm, s->norm_eps, s->norm_offset);
            rope(normed, table_of(R, cos, r, dim), table_of(R, sin, r, dim), dim, qr + t * dim);
        }
        const float *k = cache_of(R, keys, r) + (int64_t)g * s->kv_stride;
        const float *v = cache_of(R, values, r) + (int64_t)g * s->kv_stride;
        /* positions read from the cache; without `written`, the call's rows are one sequence's
         * consecutive positions start.., whose keys each task computes itself */
        int64_t cached = written ? p + 1 : start;
        if (!written) {
            for (int n = 0; n <= r; ++n)
                new_key(s, R, qkv, ld_qkv, cos, sin, g, n, normed, fresh + n * dim);
            if (h0 == g * group) { /* this row's key and value go into the cache for later calls */
                float *slot = (float *)k + p * dim, *vslot = (float *)v + p * dim;
                const float *value = qkv + (int64_t)r * ld_qkv + v_offset + (int64_t)g * dim;
                for (int i = 0; i < dim; ++i) slot[i] = fresh[r * dim + i], vslot[i] = value[i];
            }
        }
        /* keys and values are the same bits from the cache or computed afresh */
        int64_t from_cache = cached > lo ? cached - lo : 0, first_new = lo > cached ? lo : cached;
        const float *new_values = qkv + v_offset + (int64_t)g * dim;
        scores_of(qr, dim, mh, k + lo * dim, dim, from_cache, dim, scores + lo, score_n);
        scores_of(qr, dim, mh, fresh + (first_new - start) * dim, dim, p + 1 - first_new, dim,
                  scores + first_new, score_n);
        float *o = out + (int64_t)r * heads * dim + (int64_t)h0 * dim, total[BLOCK_ROWS];
        for (int t = 0; t < mh; ++t) {
            float *row = scores + t * score_n;
            for (int64_t j = lo; j <= p; ++j) row[j] *= s->scale;
            total[t] = exp_sum(row + lo, p + 1 - lo, largest(row + lo, p + 1 - lo));
        }
        for (int i = 0; i < mh * dim; ++i) o[i] = 0.0f;
        weighted_sums(o, dim, mh, scores + lo, score_n, v + lo * dim, dim, from_cache, dim);
        weighted_sums(o, dim, mh, scores + first_new, score_n,
                      new_values + (first_new - start) * ld_qkv, ld_qkv, p + 1 - first_new, dim);
        for (int t = 0; t < mh; ++t) {
            float inv = 1.0f / total[t];
            for (int i = 0; i < dim; ++i) o[t * dim + i] *= inv;
        }
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
