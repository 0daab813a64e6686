/* A row of scores (logits) reduced to what a greedy draft or a statistic needs: the largest
 * (the first of equal maxima) and the log of the sum of the exponentials, in one call per row
 * on the calling thread (PyTorch's max and logsumexp wake its thread pool for each row, which
 * inside a decode step costs more than the reduction).
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
