/* A row of scores (logits) reduced to what a greedy draft or a statistic needs: the largest
 * (the first of equal maxima) and the log of the sum of the exponentials, in one call per row
 * on the calling thread (PyTorch's max and logsumexp wake its thread pool for each row, which
 * inside a decode step costs more than the reduction). And the mass of a whole row that a
 * sampled draw needs when its bounds do not decide it (`delspec.decoding.sampling`), in one pass
 * (numpy makes a temporary array of the row per operation).
 */
#include <stdint.h>

#include "kernels.h"

/* Largest of v[0..n) and its first index. */
static float row_top(const float *v, int64_t n, int64_t *at) {
    float best = v[0];
    int64_t i = 0, first = 0;
#ifdef __AVX2__
    if (n >= 8) {
        __m256 m = _mm256_loadu_ps(v);
        for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(v + i));
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int l = 0; l < 8; ++l) best = lanes[l] > best ? lanes[l] : best;
    }
#endif
    for (; i < n; ++i) best = v[i] > best ? v[i] : best;
#ifdef __AVX2__
    const __m256 wanted = _mm256_set1_ps(best);
    while (first + 8 <= n && !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + first), wanted, _CMP_EQ_OQ)))
        first += 8;
#endif
    while (first < n && !(v[first] == best)) ++first;
    *at = first < n ? first : 0; /* none equal: a NaN first */
    return best;
}

/* log(sum e^(v[i] - top)) + top, summed in float lanes per stretch and in double across them. */
static float row_logsumexp(const float *v, int64_t n, float top) {
    double total = 0.0;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 shift = _mm256_set1_ps(top);
    while (i + 8 <= n) {
        __m256 sum = _mm256_setzero_ps();
        int64_t end = i + 4096 <= n ? i + 4096 : n;
        for (; i + 8 <= end; i += 8)
            sum = _mm256_add_ps(sum, exp8_approx(_mm256_sub_ps(_mm256_loadu_ps(v + i), shift)));
        float lanes[8];
        _mm256_storeu_ps(lanes, sum);
        for (int l = 0; l < 8; ++l) total += lanes[l];
    }
#endif
    for (; i < n; ++i) total += exp_approx(v[i] - top);
    return top + (float)log(total);
}

/* Per row r of `scores` (row stride `ld`, `width` columns): the position of the largest score
 * (the first of equal maxima), that score and the log of the sum of the exponentials. */
void dl_top_logsumexp(const float *scores, int64_t ld, int rows, int64_t width, int64_t *at,
                      float *top, float *lse) {
    for (int r = 0; r < rows; ++r) {
        const float *row = scores + (int64_t)r * ld;
        top[r] = row_top(row, width, at + r);
        lse[r] = row_logsumexp(row, width, top[r]);
    }
}

/* e^x within a few float32 roundings over [-87, 88] (clamped outside): x = n ln 2 + r with
 * |r| <= ln 2 / 2 (ln 2 split in two so that n times its first part is exact), e^r by its Taylor
 * polynomial of degree 7 (truncation below 1e-8), times 2^n. exp_approx (kernels.h) scales x by
 * log2(e) in float first, which costs up to ~6e-6 of relative error at |x| ~ 20: fine inside a
 * softmax, too coarse for the mass a draw's top-p cut is measured against. */
#define LN2_HIGH 0.693359375f
#define LN2_LOW -2.12194440e-4f
static const float TAYLOR7[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24,
                                 1.0f / 6,    0.5f,       1.0f,       1.0f};

static inline float exp_precise(float x) {
    x = fminf(fmaxf(x, EXP_LOW), EXP_HIGH);
    float n = nearbyintf(x * LOG2_E);
    float r = x - n * LN2_HIGH;
    r = r - n * LN2_LOW;
    float p = TAYLOR7[0];
    for (int i = 1; i < 8; ++i) p = fmaf(p, r, TAYLOR7[i]);
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

#ifdef __AVX2__
static inline __m256 exp8_precise(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LOW)), _mm256_set1_ps(EXP_HIGH));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2_E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HIGH)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(LN2_LOW)));
    __m256 p = _mm256_set1_ps(TAYLOR7[0]);
    for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TAYLOR7[i]));
    __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* The sum over v[0..n) of e^(v[i] * scale - shift) (the scaling and shift in float, as numpy
 * computes them on a float32 row; exp_precise for the exponential), summed in 8 double lanes in
 * order of i, then the lanes in order: the same bits on every x86 path that has AVX2. */
double dl_row_mass(const float *v, int64_t n, float scale, float shift) {
    double total = 0.0;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 s = _mm256_set1_ps(scale), t = _mm256_set1_ps(shift);
    __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8_precise(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), s), t));
        low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double lanes[8];
    _mm256_storeu_pd(lanes, low);
    _mm256_storeu_pd(lanes + 4, high);
    for (int l = 0; l < 8; ++l) total += lanes[l];
#endif
    for (; i < n; ++i) total += exp_precise(v[i] * scale - shift);
    return total;
}
