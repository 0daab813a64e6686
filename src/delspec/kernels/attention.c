/* Causal attention over a KV cache whose result for a query row never depends on the other rows.
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

#define LANES 8

/* e^x for x <= 0: 2^(x log2 e) split into integer and fraction, the fraction by a polynomial
 * (relative error ~2e-7); written so that loops over it vectorise. */
static inline float exp_nonpositive(float x) {
    float t = fmaxf(x, -87.0f) * 1.44269504088896341f;
    float whole = floorf(t), f = t - whole;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)whole + 127) << 23};
    return p * scale.f;
}

/* a . b over n values (n a multiple of LANES), summed lane-wise, then lanes in a fixed order. */
static inline float dot(const float *a, const float *b, int n) {
    float acc[LANES] = {0};
    for (int i = 0; i < n; i += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += a[i + l] * b[i + l];
    float sum = 0.0f;
    for (int l = 0; l < LANES; ++l) sum += acc[l];
    return sum;
}

/* out[h][r] = attention of q[h][r] (position start + r) over keys/values [kv_head(h)][0..p].
 * q, out: [heads][rows][dim]; keys, values: [kv_heads][kv_stride / dim][dim]. Returns 0, or -1
 * when dim is not a multiple of 8, -2 when out of memory. */
int dl_attention(const float *q, const float *keys, const float *values, float *out, int heads,
                 int kv_heads, int dim, int rows, int64_t start, int64_t kv_stride,
                 int64_t window, float scale, int threads) {
    if (dim % LANES) return -1;
    int group = heads / kv_heads, failed = 0;
    int64_t positions = start + rows;
#pragma omp parallel num_threads(threads) if (threads > 1 && (int64_t)heads * rows * positions > 4096)
    {
        float *scores = malloc((size_t)positions * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < heads * rows; ++task) {
            if (!scores) continue;
            int h = task / rows, r = task % rows;
            int64_t p = start + r, lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            const float *qr = q + ((int64_t)h * rows + r) * dim;
            const float *k = keys + (int64_t)(h / group) * kv_stride;
            const float *v = values + (int64_t)(h / group) * kv_stride;
            float top = -INFINITY;
            for (int64_t j = lo; j <= p; ++j) {
                scores[j] = scale * dot(qr, k + j * dim, dim);
                top = fmaxf(top, scores[j]);
            }
            float total = 0.0f;
            for (int64_t j = lo; j <= p; ++j) {
                scores[j] = exp_nonpositive(scores[j] - top);
                total += scores[j];
            }
            float *o = out + ((int64_t)h * rows + r) * dim;
            for (int i = 0; i < dim; ++i) o[i] = 0.0f;
            for (int64_t j = lo; j <= p; ++j) {
                const float *vj = v + j * dim;
                for (int i = 0; i < dim; ++i) o[i] += scores[j] * vj[i];
            }
            float inv = 1.0f / total;
            for (int i = 0; i < dim; ++i) o[i] *= inv;
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
