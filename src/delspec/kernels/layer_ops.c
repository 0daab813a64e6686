/* A layer's small per-row operations, each one call instead of several of PyTorch's eager ops
 * (whose dispatch costs tens of microseconds per decode step on a CPU). Each row is computed by
 * the same operations whatever the number of rows, like the products and attention.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#define LANES 8

void dl_rms_norm_row(const float *v, const float *weight, float eps, float offset, int dim,
                     float *o) {
    float squares[LANES] = {0}, sum = 0.0f;
    int i = 0;
    for (; i + LANES <= dim; i += LANES)
        for (int l = 0; l < LANES; ++l) squares[l] += v[i + l] * v[i + l];
    for (int l = 0; l < LANES; ++l) sum += squares[l];
    for (; i < dim; ++i) sum += v[i] * v[i];
    float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    for (i = 0; i < dim; ++i) o[i] = v[i] * inv * (offset + weight[i]);
}

/* act(x) * u: SiLU x / (1 + e^-x), or GELU (tanh) 0.5 x (1 + tanh(c (x + 0.044715 x^3))) with
 * tanh(z) = 1 - 2 / (e^2z + 1) */
static inline float gated(float x, float u, int gelu) {
    if (gelu) {
        float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.0f + (1.0f - 2.0f / (exp_approx(2.0f * inner) + 1.0f))) * u;
    }
    return x / (1.0f + exp_approx(-x)) * u;
}

#ifdef __AVX2__
static inline __m256 gated8(__m256 x, __m256 u, int gelu) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (gelu) {
        __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), x), x);
        __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_add_ps(x, cube));
        __m256 e = exp8_approx(_mm256_mul_ps(_mm256_set1_ps(2.0f), inner));
        __m256 tanh = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
        __m256 half_x = _mm256_mul_ps(_mm256_set1_ps(0.5f), x);
        return _mm256_mul_ps(_mm256_mul_ps(half_x, _mm256_add_ps(one, tanh)), u);
    }
    __m256 e = exp8_approx(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), u);
}
#endif

void dl_gated_row(const float *g, const float *u, int width, int gelu, float *o) {
    int i = 0;
#ifdef __AVX2__
    for (; i + LANES <= width; i += LANES)
        _mm256_storeu_ps(o + i, gated8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i), gelu));
#endif
    for (; i < width; ++i) o[i] = gated(g[i], u[i], gelu);
}

/* out[r] = x[r] / rms(x[r]) * (offset + weight), rms = sqrt(mean(x^2) + eps); x and out are
 * [rows][dim] with row strides ldx and ldo (out may be x). */
void dl_rms_norm(const float *x, int64_t ldx, const float *weight, float eps, float offset,
                 int rows, int dim, float *out, int64_t ldo) {
    for (int r = 0; r < rows; ++r) dl_rms_norm_row(x + r * ldx, weight, eps, offset, dim, out + r * ldo);
}

/* out[r][i] = act(gate_up[r][i]) * gate_up[r][width + i] for i < width: SiLU, or GELU with the
 * tanh approximation when `gelu`; gate_up is [rows][2 * width], out [rows][width]. */
void dl_gated(const float *gate_up, int rows, int width, int gelu, float *out) {
    for (int r = 0; r < rows; ++r) {
        const float *g = gate_up + (int64_t)r * 2 * width;
        dl_gated_row(g, g + width, width, gelu, out + (int64_t)r * width);
    }
}
