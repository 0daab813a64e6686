/* Products on GGUF weight blocks as stored: y[m, n] = sum_k x[m, k] * W[n, k].
 *
 * x (float32, M rows) is quantised once per call to 8 bits per block of 32 (scale = amax / 127,
 * round to nearest); each output row is then a sum over weight blocks of integer dot products
 * times one float scale per block (and a block minimum times the block's sum of x, for the
 * types that have one). Every weight block of 32 values is read as (unsigned values q,
 * scale s, minimum m) with w = s * q + m per half of 16 (Q6_K has a scale per 16), except Q8_0,
 * whose values are signed.
 *
 * Each output element is computed by the same sequence of operations whatever M, the row's
 * place in the call and the thread count: outputs are split over threads by weight row only,
 * rows of x are processed in chunks of at most 8 with the same per-row code, and the build
 * turns off floating-point contraction. So a row's bits never depend on what it is batched with.
 *
 * Compiled on the machine at first use (see build.py): AVX2 (+FMA, F16C), with AVX-512 VNNI
 * dot products where the CPU has them, or portable C.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define GROUP 32
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1 /* AVX-512 VNNI dot products on 256-bit vectors */
#else
#define VNNI 0
#endif
#define MAX_ROWS 8 /* rows of x per inner pass */

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* Bytes per block and values per block of each type; 0 for a type this file cannot read. */
static int block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static int block_values(int type) { return type >= Q4_K ? 256 : 32; }

/* Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j from the 12 packed bytes. */
static void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Group g (32 values) of the block at b: values q (unsigned, or signed for Q8_0), and the scale
 * and minimum of each half of 16: w[i] = s[i / 16] * q[i] + m[i / 16]. */
static void unpack_group(int type, const uint8_t *b, int g, int16_t *q, float *s, float *m) {
    switch (type) {
    case Q4_0:
    case Q4_1: {
        const uint8_t *qs = b + (type == Q4_0 ? 2 : 4);
        float d = f16_at(b), mn = type == Q4_0 ? -8.0f * d : f16_at(b + 2);
        for (int i = 0; i < 16; ++i) {
            q[i] = qs[i] & 0x0f;
            q[i + 16] = qs[i] >> 4;
        }
        s[0] = s[1] = d;
        m[0] = m[1] = mn;
        return;
    }
    case Q5_0:
    case Q5_1: {
        const uint8_t *qh = b + (type == Q5_0 ? 2 : 4), *qs = qh + 4;
        float d = f16_at(b), mn = type == Q5_0 ? -16.0f * d : f16_at(b + 2);
        uint32_t high;
        memcpy(&high, qh, 4);
        for (int i = 0; i < 16; ++i) {
            q[i] = (qs[i] & 0x0f) | (((high >> i) & 1) << 4);
            q[i + 16] = (qs[i] >> 4) | (((high >> (i + 16)) & 1) << 4);
        }
        s[0] = s[1] = d;
        m[0] = m[1] = mn;
        return;
    }
    case Q8_0: {
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int i = 0; i < 32; ++i) q[i] = qs[i];
        s[0] = s[1] = f16_at(b);
        m[0] = m[1] = 0.0f;
        return;
    }
    case Q4_K:
    case Q5_K: {
        float d = f16_at(b), dmin = f16_at(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + (type == Q4_K ? 16 : 48);
        int sc, mn;
        k_scale_min(scales, g, &sc, &mn);
        const uint8_t *bytes = ql + 32 * (g / 2);
        for (int i = 0; i < 32; ++i) {
            int v = g % 2 ? bytes[i] >> 4 : bytes[i] & 0x0f;
            if (type == Q5_K) v |= ((qh[i] >> g) & 1) << 4;
            q[i] = (int16_t)v;
        }
        s[0] = s[1] = d * (float)sc;
        m[0] = m[1] = -(dmin * (float)mn);
        return;
    }
    case Q6_K: {
        const uint8_t *ql = b + 64 * (g / 4), *qh = b + 128 + 32 * (g / 4);
        const int8_t *scales = (const int8_t *)(b + 192) + 8 * (g / 4);
        float d = f16_at(b + 208);
        int part = g % 4; /* 0: ql low, 1: ql+32 low, 2: ql high, 3: ql+32 high */
        const uint8_t *lo = ql + (part % 2) * 32;
        for (int i = 0; i < 32; ++i) {
            int low = part < 2 ? lo[i] & 0x0f : lo[i] >> 4;
            q[i] = (int16_t)(low | (((qh[i] >> (2 * part)) & 3) << 4));
        }
        for (int h = 0; h < 2; ++h) {
            s[h] = d * (float)scales[2 * part + h];
            m[h] = -32.0f * s[h];
        }
        return;
    }
    }
}

/* ---- activations ------------------------------------------------------------------------ */

/* x quantised per block of 32, with each block's scale and sums laid out as the eight float
 * lanes the AVX2 loop multiplies with: d8 = the scale eight times; sum8 = a quarter of
 * d * (sum of q) over the first half of the block in lanes 0-3, over the second in lanes 4-7. */
typedef struct {
    int8_t *q;    /* [M][K] */
    float *d8;    /* [M][K / 32][8] */
    float *sum8;  /* [M][K / 32][8] */
} Activations;

/* Points `a` at this thread's scratch space for M rows of K values (grown as needed, kept for
 * the next call: no allocation per product). Returns 0, or -2 when out of memory. */
static int scratch_activations(Activations *a, int64_t M, int64_t K) {
    static __thread void *buffer = NULL;
    static __thread size_t capacity = 0;
    size_t lanes = (size_t)(M * (K / GROUP) * 8), need = (size_t)(M * K) + 2 * lanes * 4 + 64;
    if (need > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, (need + 63) / 64 * 64);
        capacity = buffer ? (need + 63) / 64 * 64 : 0;
        if (!buffer) return -2;
    }
    a->d8 = buffer;
    a->sum8 = a->d8 + lanes;
    a->q = (int8_t *)(a->sum8 + lanes);
    return 0;
}

static void quantise_rows(const float *x, int64_t ldx, int M, int K, Activations *a) {
    int groups = K / GROUP;
    for (int r = 0; r < M; ++r) {
        const float *row = x + (int64_t)r * ldx;
        for (int g = 0; g < groups; ++g) {
            const float *v = row + g * GROUP;
            float amax = 0.0f;
            for (int i = 0; i < GROUP; ++i) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = a->q + (int64_t)r * K + g * GROUP;
            int sums[2] = {0, 0};
            for (int i = 0; i < GROUP; ++i) {
                q[i] = (int8_t)lrintf(v[i] * inv);
                sums[i / 16] += q[i];
            }
            float *d8 = a->d8 + ((int64_t)r * groups + g) * 8;
            float *sum8 = a->sum8 + ((int64_t)r * groups + g) * 8;
            for (int l = 0; l < 8; ++l) {
                d8[l] = d;
                sum8[l] = 0.25f * (d * (float)sums[l / 4]);
            }
        }
    }
}

/* ---- portable product ------------------------------------------------------------------- */
#ifndef __AVX2__
static void row_portable(int type, const uint8_t *w, int K, const Activations *a, int K_ld,
                         int rows, float *out) {
    int bb = block_bytes(type), per = block_values(type) / GROUP, groups = K / GROUP;
    int16_t q[GROUP];
    float s[2], m[2];
    float acc[MAX_ROWS] = {0};
    for (int g = 0; g < groups; ++g) {
        unpack_group(type, w + (int64_t)(g / per) * bb, g % per, q, s, m);
        for (int r = 0; r < rows; ++r) {
            const int8_t *x = a->q + (int64_t)r * K_ld + g * GROUP;
            int32_t dot[2] = {0, 0};
            for (int i = 0; i < GROUP; ++i) dot[i / 16] += (int32_t)q[i] * x[i];
            const float *d8 = a->d8 + ((int64_t)r * groups + g) * 8;
            const float *sum8 = a->sum8 + ((int64_t)r * groups + g) * 8;
            acc[r] += (s[0] * d8[0]) * (float)dot[0] + (s[1] * d8[0]) * (float)dot[1];
            for (int l = 0; l < 8; ++l) acc[r] += m[l / 4] * sum8[l];
        }
    }
    for (int r = 0; r < rows; ++r) out[r] = acc[r];
}
#define row_dispatch row_portable
#endif

/* ---- AVX2 product ----------------------------------------------------------------------- */
#ifdef __AVX2__

/* Eight int32 sums of four u8 x s8 products each (bytes 4j..4j+3 into lane j). */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }

static inline __m256i high_nibbles(__m256i v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
}

/* 16 packed bytes -> 32 values: low nibbles (values 0..15), then high nibbles (16..31). */
static inline __m256i nibbles_32(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return low_nibbles(both);
}

/* 0x10 in byte i where bit i of the 32-bit word at p is set. */
static inline __m256i bit_16s(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

static inline __m256 halves(float lo, float hi) {
    return _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo));
}

/* Group g of weight row w as 32 byte values q with the scale `sv` and minimum `mv` of each half
 * per lane (lanes 0-3: first half, 4-7: second): w = s * q + m. Q8_0's values are signed (and its
 * minimum zero) except under VNNI, where they are shifted to q + 128 with m = -128 d. */
static inline __attribute__((always_inline)) void unpack_avx2(int type, const uint8_t *w, int g,
                                                               __m256i *qv, __m256 *sv,
                                                               __m256 *mv) {
    switch (type) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1:
    case Q8_0: {
        const uint8_t *b = w + (int64_t)g * block_bytes(type);
        float d = f16_at(b);
        *sv = _mm256_set1_ps(d);
        if (type == Q8_0) {
            *qv = _mm256_loadu_si256((const __m256i *)(b + 2));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            *qv = _mm256_xor_si256(*qv, _mm256_set1_epi8((char)0x80));
            *mv = _mm256_set1_ps(-128.0f * d);
#else
            *mv = _mm256_setzero_ps();
#endif
        } else if (type == Q4_0 || type == Q4_1) {
            *mv = _mm256_set1_ps(type == Q4_0 ? -8.0f * d : f16_at(b + 2));
            *qv = nibbles_32(b + (type == Q4_0 ? 2 : 4));
        } else {
            const uint8_t *qh = b + (type == Q5_0 ? 2 : 4);
            *mv = _mm256_set1_ps(type == Q5_0 ? -16.0f * d : f16_at(b + 2));
            *qv = _mm256_or_si256(nibbles_32(qh + 4), bit_16s(qh));
        }
        return;
    }
    case Q4_K:
    case Q5_K: {
        const uint8_t *b = w + (int64_t)(g / 8) * block_bytes(type);
        int j = g % 8, sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        __m256i bytes = _mm256_loadu_si256(
            (const __m256i *)(b + (type == Q4_K ? 16 : 48) + 32 * (j / 2)));
        *qv = j % 2 ? high_nibbles(bytes) : low_nibbles(bytes);
        if (type == Q5_K) { /* bit j of each qh byte -> 0x10 */
            __m256i high = _mm256_loadu_si256((const __m256i *)(b + 16));
            __m256i bit = _mm256_and_si256(high, _mm256_set1_epi8((char)(1 << j)));
            bit = _mm256_cmpeq_epi8(bit, _mm256_set1_epi8((char)(1 << j)));
            *qv = _mm256_or_si256(*qv, _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
        }
        *sv = _mm256_set1_ps(f16_at(b) * (float)sc);
        *mv = _mm256_set1_ps(-(f16_at(b + 2) * (float)mn));
        return;
    }
    case Q6_K: {
        const uint8_t *b = w + (int64_t)(g / 8) * 210;
        int half = (g % 8) / 4, part = g % 4; /* 0: ql low, 1: ql+32 low, 2: ql high, 3: ql+32 high */
        __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (part % 2)));
        __m256i hv = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
        __m256i two = part == 0   ? _mm256_slli_epi16(hv, 4)
                      : part == 1 ? _mm256_slli_epi16(hv, 2)
                      : part == 2 ? hv
                                  : _mm256_srli_epi16(hv, 2);
        two = _mm256_and_si256(two, _mm256_set1_epi8(0x30));
        *qv = _mm256_or_si256(part < 2 ? low_nibbles(bytes) : high_nibbles(bytes), two);
        const int8_t *scales = (const int8_t *)(b + 192) + 8 * half + 2 * part;
        float d = f16_at(b + 208), s0 = d * (float)scales[0], s1 = d * (float)scales[1];
        *sv = halves(s0, s1);
        *mv = halves(-32.0f * s0, -32.0f * s1);
        return;
    }
    }
}

/* out[r] = W . x[r] for one weight row and `rows` rows of x, by the same operations in the same
 * order whatever `rows`: per group, acc += (s * d) * dot and accm += m * sum (two accumulators,
 * so that the two multiply-adds of a group do not wait on each other). */
static inline __attribute__((always_inline)) void row_avx2(int type, const uint8_t *w, int K,
                                                            const Activations *a, int K_ld,
                                                            int rows, float *out) {
    const int8_t *xq = a->q;
    const float *xd8 = a->d8, *xs8 = a->sum8;
    int groups = K / GROUP;
    /* Q8_0 without VNNI: signed values, no minimum; maddubs takes |q| and x with q's sign */
    int sign = type == Q8_0 && !VNNI;
    __m256 acc[MAX_ROWS], accm[MAX_ROWS];
    for (int r = 0; r < rows; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m256i qv = _mm256_setzero_si256();
        __m256 sv = _mm256_setzero_ps(), mv = sv;
        unpack_avx2(type, w, g, &qv, &sv, &mv);
#pragma GCC unroll 8
        for (int r = 0; r < rows; ++r) {
            const int64_t at = ((int64_t)r * groups + g) * 8;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)r * K_ld + g * GROUP));
            __m256i dot = sign ? dot_u8_s8(_mm256_sign_epi8(qv, qv), _mm256_sign_epi8(xv, qv))
                               : dot_u8_s8(qv, xv);
            __m256 scale = _mm256_mul_ps(sv, _mm256_loadu_ps(xd8 + at));
            acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[r]);
            if (!sign) accm[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs8 + at), accm[r]);
        }
    }
    for (int r = 0; r < rows; ++r) out[r] = hsum(_mm256_add_ps(acc[r], accm[r]));
}

/* One specialised copy per type and row count, so that the unpacking is inlined and the
 * accumulators stay in registers. */
#define ROWS_CASE(t, n)                                                                      \
    case n: row_avx2(t, w, K, a, K_ld, n, out); return;
#define ROW_COUNTS(t)                                                                        \
    switch (rows) {                                                                          \
        ROWS_CASE(t, 1) ROWS_CASE(t, 2) ROWS_CASE(t, 3) ROWS_CASE(t, 4) ROWS_CASE(t, 5)       \
        ROWS_CASE(t, 6) ROWS_CASE(t, 7) ROWS_CASE(t, 8)                                      \
    }                                                                                        \
    return;
static void row_dispatch(int type, const uint8_t *w, int K, const Activations *a, int K_ld,
                         int rows, float *out) {
    switch (type) {
    case Q4_0: ROW_COUNTS(Q4_0)
    case Q4_1: ROW_COUNTS(Q4_1)
    case Q5_0: ROW_COUNTS(Q5_0)
    case Q5_1: ROW_COUNTS(Q5_1)
    case Q8_0: ROW_COUNTS(Q8_0)
    case Q4_K: ROW_COUNTS(Q4_K)
    case Q5_K: ROW_COUNTS(Q5_K)
    case Q6_K: ROW_COUNTS(Q6_K)
    }
}
#endif

/* ---- entry points ----------------------------------------------------------------------- */

/* Which instruction path this build uses: 2 = AVX-512 VNNI dot products, 1 = AVX2, 0 = C. */
int dl_simd_level(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* Bytes one row of K values takes in `type`; 0 when unsupported or K is not whole blocks. */
int64_t dl_row_bytes(int type, int64_t K) {
    int bb = block_bytes(type), bv = block_values(type);
    return bb && K % bv == 0 ? K / bv * bb : 0;
}

/* Output column y[.][0] of one weight row for all M rows of x, in chunks of MAX_ROWS. */
static void weight_row(int type, const uint8_t *w, int64_t K, const Activations *a, int64_t M,
                       float *y, int64_t ldy) {
    int64_t groups = K / GROUP;
    float out[MAX_ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        int rows = (int)(M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS);
        Activations part = {a->q + m0 * K, a->d8 + m0 * groups * 8, a->sum8 + m0 * groups * 8};
        row_dispatch(type, w, (int)K, &part, (int)K, rows, out);
        for (int r = 0; r < rows; ++r) y[(m0 + r) * ldy] = out[r];
    }
}

/* y[m * ldy + n] = x[m] . W[n] for m < M, n < N. W: N rows of `row_stride` bytes. Returns 0, or
 * -1 for an unsupported type or shape, -2 when out of memory. */
int dl_matmul(int type, const uint8_t *w, int64_t row_stride, int64_t N, int64_t K,
              const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy, int threads) {
    if (!dl_row_bytes(type, K) || K % GROUP) return -1;
    Activations a;
    if (scratch_activations(&a, M, K)) return -2;
    quantise_rows(x, ldx, (int)M, (int)K, &a);
    /* dynamic chunks: a thread that the OS descheduled (another process on the core) holds up
     * only its current chunk, not a fixed half of the rows */
    int64_t chunk = N / ((int64_t)threads * 16) > 32 ? N / ((int64_t)threads * 16) : 32;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(threads) if (threads > 1 && N >= 64)
    for (int64_t n = 0; n < N; ++n) weight_row(type, w + n * row_stride, K, &a, M, y + n, ldy);
    return 0;
}

/* out[r * K + k] = W[rows[r], k] (float32); rows == NULL means rows 0..count-1. */
int dl_dequantize(int type, const uint8_t *w, int64_t row_stride, int64_t K, const int64_t *rows,
                  int64_t count, float *out, int threads) {
    if (!dl_row_bytes(type, K)) return -1;
    int bb = block_bytes(type), per = block_values(type) / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count >= 64)
    for (int64_t r = 0; r < count; ++r) {
        const uint8_t *row = w + (rows ? rows[r] : r) * row_stride;
        int16_t q[GROUP];
        float s[2], m[2];
        for (int64_t g = 0; g < K / GROUP; ++g) {
            unpack_group(type, row + (g / per) * bb, (int)(g % per), q, s, m);
            float *o = out + r * K + g * GROUP;
            for (int i = 0; i < GROUP; ++i) o[i] = s[i / 16] * (float)q[i] + m[i / 16];
        }
    }
    return 0;
}
