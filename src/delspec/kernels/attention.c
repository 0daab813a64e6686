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
#include <string.h>

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

/* Whether the tasks of a sequence's last row fetch its cache first (dl_set_fetch_first). */
static int fetch_first = 1;

int dl_set_fetch_first(int on) {
    int before = fetch_first;
    fetch_first = on != 0;
    return before;
}

/* Reads share `part` of `parts` of the `count` cached keys and values from `k` and `v` (dim
 * floats each) once, in order: one stream each, which the hardware prefetchers follow at the
 * memory's pace. The products below read 8 keys at once, and a quarter of each value at a time:
 * after a step's weights have streamed through the caches, such patterns wait on each line,
 * at a third to a half of that pace. Only reads: no result changes. */
static void fetch_rows(const float *k, const float *v, int64_t count, int dim, int part,
                       int parts) {
#ifdef __AVX2__
    int64_t total = count * dim / 8; /* vectors of 8 floats */
    int64_t from = total * part / parts, to = total * (part + 1) / parts;
    __m256 a = _mm256_setzero_ps(), b = a;
    for (int64_t x = from; x < to; ++x) {
        a = _mm256_or_ps(a, _mm256_loadu_ps(k + 8 * x));
        b = _mm256_or_ps(b, _mm256_loadu_ps(v + 8 * x));
    }
    __asm__ volatile("" ::"x"(a), "x"(b)); /* kept, never used */
#else
    (void)k, (void)v, (void)count, (void)dim, (void)part, (void)parts;
#endif
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
        /* the tasks of a sequence's last row (its most keys) run first: they fetch its cache,
         * a share each, for the tasks of its other rows too */
        if (fetch_first && (r == rows - 1 || cache_of(R, keys, r + 1) != cache_of(R, keys, r)))
            fetch_rows(k + lo * dim, v + lo * dim, from_cache, dim, task % blocks, blocks);
        const float *new_values = qkv + v_offset + (int64_t)g * dim;
        scores_of(qr, dim, mh, k + lo * dim, dim, from_cache, dim, scores + lo, score_n);
        scores_of(qr, dim, mh, fresh + (first_new - start) * dim, dim, p + 1 - first_new, dim,
                  scores + first_new, score_n);
        float *o = out + (int64_t)r * heads * dim + (int64_t)h0 * dim, total[BLOCK_ROWS];
        for (int t = 0; t < mh; ++t) {
            float *row = scores + t * score_n;
            for (int64_t j = lo; j <= p; ++j) row[j] *= s->scale;
            if (s->softcap > 0.0f)
                for (int64_t j = lo; j <= p; ++j) row[j] = s->softcap * tanhf(row[j] / s->softcap);
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

#ifdef BF16_TILES
/* ---- a prompt's attention on bfloat16 tiles (AMX) ------------------------------------------
 * A task: up to QUERY_ROWS consecutive rows of one sequence, one key-value head, all its query
 * heads. Its keys and values (from the first KEY_BLOCK-aligned block any of its rows sees, to its
 * last row; zeros after) are rounded to bfloat16 once for the heads; the tile unit multiplies the
 * rows' queries by the keys (scores), then the softmax weights (rounded) by the values, summing in
 * float over key blocks aligned to position 0. The softmax runs row by row in vectors whose lane
 * is the key's position modulo 16. A row's bits then depend on its own query, keys and values
 * alone, not on the rows of its task: keys a row does not see have weight zero and add nothing,
 * wherever its task's blocks begin and end. */
#define QUERY_ROWS 16
#define KEY_BLOCK 32

/* The 16 values x[0..15] rounded to bfloat16, and back in float. */
TILE_TARGET static inline __m512 bf16_rounded(__m512 x) {
    __m256i half = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* 16 pairs of bfloat16 (32-bit units): values 2i, 2i + 1 of x[0..31] in unit i. */
TILE_TARGET static inline __m512i bf16_pairs_of(const float *x) {
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
}

/* exp_approx of 16 values at once (the same operations, so the same bits). */
TILE_TARGET static inline __m512 exp16_approx(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LOW)), _mm512_set1_ps(EXP_HIGH));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(LOG2_E));
    __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, whole), p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_POLY[i]));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* The keys and values of positions [first, first + count) (count a multiple of KEY_BLOCK) of one
 * key-value head, those after `last` as zeros, in tile layouts: keys as B tiles of the scores
 * (per 16 keys and 32 values of dim, row i holds values 2i, 2i + 1 of each key: 1 KB), values as
 * B tiles of the sums (per KEY_BLOCK keys and 16 values of dim, row i holds keys 2i, 2i + 1's
 * value of each: 1 KB). */
TILE_TARGET static void tile_keys_values(const float *k, const float *v, int dim, int64_t first,
                                         int64_t count, int64_t last, uint8_t *kt, uint8_t *vt) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                             5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    for (int64_t j = 0; j < count; ++j) {
        int64_t p = first + j;
        for (int c = 0; c < dim / 32; ++c) {
            __m512i pairs = p <= last ? bf16_pairs_of(k + p * dim + c * 32) : _mm512_setzero_si512();
            int32_t *tile = (int32_t *)(kt + ((j / 16) * (dim / 32) + c) * 1024) + j % 16;
            _mm512_i32scatter_epi32(tile, rows, pairs, 4);
        }
    }
    for (int64_t j = 0; j < count; j += 2)
        for (int c = 0; c < dim / 16; ++c) {
            int64_t p = first + j;
            __m512 v0 = p <= last ? _mm512_loadu_ps(v + p * dim + c * 16) : _mm512_setzero_ps();
            __m512 v1 = p + 1 <= last ? _mm512_loadu_ps(v + (p + 1) * dim + c * 16)
                                      : _mm512_setzero_ps();
            bf16_pairs(v0, v1, vt + ((j / KEY_BLOCK) * (dim / 16) + c) * 1024 + (j % KEY_BLOCK) / 2 * 64);
        }
}

/* The softmax weights of one row (scores s[0..n), keys first.. of which it sees [lo, hi]) rounded
 * to bfloat16 into w, zeros for the keys it does not see; returns their sum. */
TILE_TARGET static float row_weights(const float *s, int64_t n, int64_t first, int64_t lo,
                                     int64_t hi, float scale, uint16_t *w) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps(), by = _mm512_set1_ps(scale);
    __mmask16 seen[n / 16];
    for (int64_t i = 0; i < n; i += 16) {
        __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)(first + i)));
        seen[i / 16] = _mm512_cmpge_epi32_mask(at, _mm512_set1_epi32((int)lo)) &
                       _mm512_cmple_epi32_mask(at, _mm512_set1_epi32((int)hi));
        top = _mm512_mask_max_ps(top, seen[i / 16], top, _mm512_mul_ps(_mm512_loadu_ps(s + i), by));
    }
    __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int64_t i = 0; i < n; i += 16) {
        __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + i), by), most);
        __m512 e = _mm512_maskz_mov_ps(seen[i / 16], bf16_rounded(exp16_approx(x)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(w + i), (__m256i)_mm512_cvtneps_pbh(e));
    }
    float lane[16], total = 0.0f;
    _mm512_storeu_ps(lane, sum);
    for (int l = 0; l < 16; ++l) total += lane[l];
    return total;
}

/* The rows [r0, r0 + n) (n <= QUERY_ROWS) of one sequence for query heads of key-value head g:
 * keys `first`.. of kt and vt (tile_keys_values), `memory` for the rest. */
TILE_TARGET static void row_block(const AttentionShape *s, const Rows *R, const float *qkv,
                                  int64_t ld_qkv, const float *cos, const float *sin,
                                  const uint8_t *kt, const uint8_t *vt, int64_t first, float *out,
                                  int r0, int n, int g, uint8_t *memory) {
    int dim = s->dim, group = s->heads / s->kv_heads;
    int64_t p0 = position_of(R, r0), count = ((p0 + n - 1) / KEY_BLOCK + 1) * KEY_BLOCK - first;
    uint16_t *q = (uint16_t *)memory; /* the rows' queries (normed, rotated) [16][dim] */
    float *scores = (float *)(memory + QUERY_ROWS * dim * 2), *o = scores + QUERY_ROWS * count;
    float *row = o + QUERY_ROWS * dim, total[QUERY_ROWS];
    uint16_t *w = (uint16_t *)(row + 2 * dim);
    if (n < QUERY_ROWS) /* the rows after the block's: no weights */
        memset(w + n * count, 0, (size_t)((QUERY_ROWS - n) * count) * 2);
    for (int h = g * group; h < (g + 1) * group; ++h) {
        for (int r = 0; r < QUERY_ROWS; ++r) {
            if (r < n) {
                const float *x = qkv + (int64_t)(r0 + r) * ld_qkv + (int64_t)h * dim;
                for (int i = 0; i < dim; ++i) row[dim + i] = x[i];
                head_norm(row + dim, dim, s->q_norm, s->norm_eps, s->norm_offset);
                rope(row + dim, table_of(R, cos, r0 + r, dim), table_of(R, sin, r0 + r, dim), dim,
                     row);
            } else {
                memset(row, 0, (size_t)dim * 4);
            }
            for (int i = 0; i < dim; i += 16)
                _mm256_storeu_si256((__m256i *)(q + r * dim + i),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + i)));
        }
        for (int64_t j = 0; j < count; j += 16) { /* scores[r][j..j + 15] */
            _tile_zero(2);
            for (int c = 0; c < dim / 32; ++c) {
                _tile_loadd(0, q + c * 32, dim * 2);
                _tile_loadd(1, kt + ((j / 16) * (dim / 32) + c) * 1024, 64);
                _tile_dpbf16ps(2, 0, 1);
            }
            _tile_stored(2, scores + j, count * 4);
        }
        for (int r = 0; r < n; ++r) {
            int64_t p = p0 + r, lo = s->window > 0 && p - s->window + 1 > 0 ? p - s->window + 1 : 0;
            total[r] = row_weights(scores + r * count, count, first, lo, p, s->scale,
                                   w + r * count);
        }
        for (int c0 = 0; c0 < dim / 16; c0 += 4) { /* o[r][16 c0 ..] by up to 4 tiles */
            int tiles = dim / 16 - c0 < 4 ? dim / 16 - c0 : 4;
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int64_t j = 0; j < count; j += KEY_BLOCK) {
                _tile_loadd(0, w + j, count * 2);
                const uint8_t *b = vt + ((j / KEY_BLOCK) * (dim / 16) + c0) * 1024;
                _tile_loadd(1, b, 64);
                _tile_dpbf16ps(4, 0, 1);
                if (tiles > 1) {
                    _tile_loadd(1, b + 1024, 64);
                    _tile_dpbf16ps(5, 0, 1);
                }
                if (tiles > 2) {
                    _tile_loadd(1, b + 2048, 64);
                    _tile_dpbf16ps(6, 0, 1);
                }
                if (tiles > 3) {
                    _tile_loadd(1, b + 3072, 64);
                    _tile_dpbf16ps(7, 0, 1);
                }
            }
            _tile_stored(4, o + c0 * 16, dim * 4);
            if (tiles > 1) _tile_stored(5, o + (c0 + 1) * 16, dim * 4);
            if (tiles > 2) _tile_stored(6, o + (c0 + 2) * 16, dim * 4);
            if (tiles > 3) _tile_stored(7, o + (c0 + 3) * 16, dim * 4);
        }
        for (int r = 0; r < n; ++r) {
            float inv = 1.0f / total[r], *to = out + (int64_t)(r0 + r) * s->heads * dim + h * dim;
            for (int i = 0; i < dim; ++i) to[i] = o[r * dim + i] * inv;
        }
    }
}

/* A task: rows [r0, r0 + n) of one sequence (consecutive positions), key-value head g: its keys
 * and values once, then blocks of QUERY_ROWS rows. */
TILE_TARGET static void attention_task(const AttentionShape *s, const Rows *R, const float *qkv,
                                       int64_t ld_qkv, const float *cos, const float *sin,
                                       const float *keys, const float *values, float *out, int r0,
                                       int n, int g, uint8_t *memory) {
    int dim = s->dim;
    int64_t p0 = position_of(R, r0), last = p0 + n - 1;
    int64_t lo0 = s->window > 0 && p0 - s->window + 1 > 0 ? p0 - s->window + 1 : 0;
    int64_t first = lo0 / KEY_BLOCK * KEY_BLOCK, count = (last / KEY_BLOCK + 1) * KEY_BLOCK - first;
    uint8_t *kt = memory, *vt = kt + count * dim * 2;
    const float *k = cache_of(R, (float *)keys, r0) + (int64_t)g * s->kv_stride;
    const float *v = cache_of(R, (float *)values, r0) + (int64_t)g * s->kv_stride;
    tile_keys_values(k, v, dim, first, count, last, kt, vt);
    for (int b = 0; b < n; b += QUERY_ROWS)
        row_block(s, R, qkv, ld_qkv, cos, sin, kt, vt, first, out, r0 + b,
                  n - b < QUERY_ROWS ? n - b : QUERY_ROWS, g, vt + count * dim * 2);
}

int dl_attention_tiles(const AttentionShape *s, const Rows *R, const float *qkv, int64_t ld_qkv,
                       const float *cos, const float *sin, const float *keys, const float *values,
                       float *out) {
    /* capped scores (softcap) take the rows path, for every row of every prompt alike */
    if (!dl_prompt_tiles_ready() || s->dim % 32 || s->softcap > 0.0f) return -1;
    int64_t top = score_length(R), count = (top / KEY_BLOCK + 2) * KEY_BLOCK;
    size_t dim = (size_t)s->dim, bytes = (size_t)count * dim * 4 + QUERY_ROWS * dim * 2 +
                                          (size_t)QUERY_ROWS * (size_t)count * 6 +
                                          (QUERY_ROWS + 2) * dim * 4 + (size_t)(R->rows + 1) * 4;
    uint8_t *memory = dl_scratch(SCRATCH_ATTENTION, bytes);
    /* the tasks' first rows: runs of one sequence's consecutive positions, of up to `span` rows
     * (every thread finds the same ones): up to 4 blocks share their keys and values while that
     * leaves 4 tasks a thread */
    int span = R->rows * s->kv_heads / (QUERY_ROWS * 4 * omp_get_num_threads());
    span = QUERY_ROWS * (span < 1 ? 1 : span > 4 ? 4 : span);
    int *starts = memory ? (int *)(memory + bytes - (size_t)(R->rows + 1) * 4) : NULL;
    int tasks = 0, run_start = 0;
    for (int r = 0; r < R->rows; ++r) {
        int same = r > 0 && r - run_start < span &&
                   (R->slots ? R->slots[r] == R->slots[r - 1] : 1) &&
                   position_of(R, r) == position_of(R, r - 1) + 1;
        if (!same) {
            if (starts) starts[tasks] = r;
            run_start = r, ++tasks;
        }
    }
    if (starts) starts[tasks] = R->rows;
    dl_tile_shapes();
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t task = 0; task < (int64_t)tasks * s->kv_heads; ++task) {
        int64_t b = tasks - 1 - task / s->kv_heads; /* the last rows (most keys) first */
        if (starts)
            attention_task(s, R, qkv, ld_qkv, cos, sin, keys, values, out, starts[b],
                           starts[b + 1] - starts[b], (int)(task % s->kv_heads), memory);
    }
    return memory ? 0 : -2;
}
#else
int dl_attention_tiles(const AttentionShape *s, const Rows *R, const float *qkv, int64_t ld_qkv,
                       const float *cos, const float *sin, const float *keys, const float *values,
                       float *out) {
    (void)s, (void)R, (void)qkv, (void)ld_qkv, (void)cos, (void)sin, (void)keys, (void)values;
    (void)out;
    return -1;
}
#endif

/* One layer's attention for `rows` new positions start.. of one sequence from their fused
 * projection `qkv` ([rows][ld_qkv]: heads * dim query values, then kv_heads * dim keys, then as
 * many values). Writes the new keys (normed, rotated) and values into `keys`/`values`
 * ([kv_heads][kv_stride / dim][dim], positions 0..start+rows-1 then cached) and the attention
 * output to `out` ([rows][heads * dim]). `cos`/`sin`: [rows][dim], the rows' RoPE tables.
 * `q_norm`/`k_norm`: per-head RMS norm weights, or NULL; `softcap`: see AttentionShape. Returns
 * 0, or -1 when dim is not a multiple of 8, -2 when out of memory. */
int dl_attention(const float *qkv, int64_t ld_qkv, const float *cos, const float *sin,
                 const float *q_norm, const float *k_norm, float norm_eps, float norm_offset,
                 float *keys, float *values, float *out, int heads, int kv_heads, int dim,
                 int rows, int64_t start, int64_t kv_stride, int64_t window, float scale,
                 float softcap, int threads) {
    if (dim % LANES) return -1;
    AttentionShape s = {heads,  kv_heads, dim,       kv_stride,   window, scale,
                        q_norm, k_norm,   norm_eps, norm_offset, softcap};
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
