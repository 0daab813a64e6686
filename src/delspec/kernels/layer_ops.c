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

void dl_gated_row(const float *g, const float *u, int width, int gelu, float *o) {
    if (gelu) {
        for (int i = 0; i < width; ++i) {
            float x = g[i], inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            o[i] = 0.5f * x * (1.0f + tanhf(inner)) * u[i];
        }
    } else {
        for (int i = 0; i < width; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
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
