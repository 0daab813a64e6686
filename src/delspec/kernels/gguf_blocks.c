/* Products on GGUF weight blocks: y[m, n] = sum_k x[m, k] * W[n, k].
 *
 * Weights are repacked once, at load, from the file's blocks into tiles of 8 weight rows with
 * the same bits per value and the same scales (no float copy): a tile block holds, for 8 rows,
 * what 8 GGUF blocks hold, interleaved so that one 256-bit vector carries 4 consecutive values of
 * each of the 8 rows. A product then multiplies a vector of weights by 4 broadcast activation
 * bytes and sums each row's products in its own 32-bit lane: one pass over a tile serves 8 output
 * columns with no horizontal sums, and its unpacked weights serve every row of x.
 *
 * x (float32, M rows) is quantised once per call to 8 bits per group of 32 values (scale =
 * amax / 127, round to nearest). Every weight group of 32 values is (unsigned values q, scale s,
 * minimum m) with w = s * q + m per half of 16 (Q2_K, Q3_K and Q6_K have a scale and minimum per
 * 16), except Q8_0, whose values are signed; a group's contribution to an output is
 * (s * d_x) * dot(q, q_x) + m * d_x * sum(q_x), integer dot products and explicit fused
 * multiply-adds. Float16 and bfloat16 weights (F16, BF16) are multiplied in float instead, with
 * x as it is: converted to float32 they are exact, so their products need no error bound beyond
 * float32 accumulation (and 8-bit activations would add one for no saving in bytes).
 *
 * Each output element is computed by the same sequence of operations whatever M, the row's place
 * in the call and the thread count: threads split tiles only, rows of x are taken a few at a time
 * by the same per-row code, and the build turns off floating-point contraction. So a row's bits
 * never depend on what it is batched with (a verification of k tokens equals k plain steps).
 *
 * Compiled on the machine at first use (see build.py): AVX2 (+FMA, F16C), with VNNI dot products
 * (AVX-512 VNNI or AVX-VNNI) where the CPU has them, or portable C. With AVX-512, pairs of tiles
 * are computed at once in 512-bit vectors (tile_pair), or two pairs (tile_four, where the type
 * allows and the machine measured it faster: dl_set_four_tiles), with the bits of one tile at a
 * time. One row may run the two-row loop on itself and a copy (dl_set_twin_row), where the
 * machine measured that faster: the same bits. A
 * long prompt's rows may take another product where the CPU has AMX-BF16 (dl_prompt_tiles, at
 * the end): all of that prompt's rows, and never decoding's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

#include "kernels.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define GROUP 32
#define TILE 8     /* weight rows per tile */
#define MAX_ROWS 8 /* rows of x per pass over a tile */
#define UNIT 32    /* weight rows a thread takes at a time (dl_tile's widest) */
/* F16 / BF16: independent float sums per output (enough to hide the latency of the multiply-adds
 * at M = 1), and rows of x per pass over a tile (their FLOAT_ROWS * FLOAT_CHAINS sums held in
 * registers: 32 vector registers with AVX-512, 16 without). */
#define FLOAT_CHAINS 4
_Static_assert(FLOAT_CHAINS == 4, "the float sums are added in two pairs");
#ifdef __AVX512VL__
#define FLOAT_ROWS 4
#else
#define FLOAT_ROWS 2
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1 /* VNNI dot products on 256-bit vectors: AVX-512's encoding... */
#define dot_bytes _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define VNNI 1 /* ...or AVX-VNNI's (CPUs with VNNI but no AVX-512) */
#define dot_bytes _mm256_dpbusd_avx_epi32
#else
#define VNNI 0
#endif
#if VNNI && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WIDE 1 /* two tiles at once in 512-bit vectors (tile_pair) */
#else
#define WIDE 0
#endif

enum {
    F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
    Q5_K = 13, Q6_K = 14, BF16 = 30
};

/* Types whose groups have a scale and minimum per half of 16 values. */
static inline int per_half(int type) { return type == Q2_K || type == Q3_K || type == Q6_K; }

/* ---- layouts ---------------------------------------------------------------------------- */

/* A type's GGUF block and tile block. A tile block holds 8 rows' `values` values: per-row
 * fields first (float16 scales and minimums, K-quant sub-block scales as bytes), then each group
 * of 32 values at head + g * group_bytes, its bits in two areas: the `low` bits first, then the
 * `high` bits (0, 1 or 2) at 32 * low bytes on. In an area of width w bits, value 4v + i of row l
 * (v = 0..7, i = 0..3) is bits w (v % (8 / w)) of byte 32 (v / (8 / w)) + 4 l + i: one 256-bit
 * vector carries value v's 4 consecutive columns of every row. So:
 *   4 low bits as nibbles (128 bytes), the low nibble for even v, the high one for odd v;
 *   2 low bits as 2-bit planes (64 bytes); 8 bits (Q8_0) as bytes (256 bytes);
 *   a 5th bit (Q5_*) or 3rd (Q3_K) as one bit plane (32 bytes), bit v of byte 4 l + i;
 *   the 5th and 6th bits (Q6_K) as two 2-bit planes (64 bytes).
 * Float16 and bfloat16 (low = 16): value c of row l is the 2 bytes at 16 c + 2 l, so that 16
 * bytes hold one column of every row. */
typedef struct {
    int values;      /* per block: 32 or 256 (F16 / BF16: 32 values, 64 bytes) */
    int gguf_bytes;  /* GGUF block */
    int tile_bytes;  /* tile block (8 rows) */
    int low, high;   /* bits per value in the two areas: low 2, 4, 8 or 16, high 0, 1 or 2 */
    int head;        /* offset of group 0's values in a tile block */
    int group_bytes; /* bytes of one group's values (8 rows) */
} Layout;

static inline __attribute__((always_inline)) int layout_of(int type, Layout *l) {
    switch (type) {
    case F16:
    case BF16: *l = (Layout){32, 64, 512, 16, 0, 0, 512}; return 1;
    case Q4_0: *l = (Layout){32, 18, 144, 4, 0, 16, 128}; return 1;
    case Q4_1: *l = (Layout){32, 20, 160, 4, 0, 32, 128}; return 1;
    case Q5_0: *l = (Layout){32, 22, 176, 4, 1, 16, 160}; return 1;
    case Q5_1: *l = (Layout){32, 24, 192, 4, 1, 32, 160}; return 1;
    case Q8_0: *l = (Layout){32, 34, 272, 8, 0, 16, 256}; return 1;
    case Q2_K: *l = (Layout){256, 84, 672, 2, 0, 160, 64}; return 1;
    case Q3_K: *l = (Layout){256, 110, 912, 2, 1, 144, 96}; return 1;
    case Q4_K: *l = (Layout){256, 144, 1184, 4, 0, 160, 128}; return 1;
    case Q5_K: *l = (Layout){256, 176, 1440, 4, 1, 160, 160}; return 1;
    case Q6_K: *l = (Layout){256, 210, 1680, 4, 2, 144, 192}; return 1;
    default: *l = (Layout){0}; return 0;
    }
}

/* Per-row fields of a tile block: `count` fields of `size` bytes, row l's at offset + f * 8 *
 * size + l * size (float16 scales and minimums; K-quant sub-block scales, one byte each). */
typedef struct {
    int offset, size, count;
} Field;

static int fields_of(int type, Field *f) {
    switch (type) {
    case Q4_0:
    case Q5_0:
    case Q8_0: f[0] = (Field){0, 2, 1}; return 1;
    case Q4_1:
    case Q5_1: f[0] = (Field){0, 2, 2}; return 1;
    case Q2_K: /* d, dmin; per sub-block of 16 the file's byte (scale | minimum << 4) */
    case Q4_K:
    case Q5_K: f[0] = (Field){0, 2, 2}, f[1] = (Field){32, 1, 16}; return 2;
    case Q3_K: /* d; per sub-block of 16 its signed scale */
    case Q6_K: f[0] = (Field){0, 2, 1}, f[1] = (Field){16, 1, 16}; return 2;
    default: return 0;
    }
}

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

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* An F16 or BF16 value from its bits (exact). */
static float float_value(int type, unsigned bits) {
    return type == F16 ? half_to_float((uint16_t)bits) : bf16_to_float((uint16_t)bits);
}

static float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j from the 12 packed bytes. */
static inline __attribute__((always_inline)) void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q3_K: the signed 6-bit scale of sub-block j (0..15) from the 12 packed bytes. */
static inline __attribute__((always_inline)) int q3_scale(const uint8_t *s, int j) {
    int low = j < 8 ? s[j] & 0x0f : s[j - 8] >> 4, high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (low | high << 4) - 32;
}

/* Bits 0..3 of `bits` as bit 0 of bytes 0..3 of a word. */
static inline uint32_t spread_bits(uint32_t bits) { return (bits * 0x00204081u) & 0x01010101u; }

/* The 32 values of group g of a GGUF block of a quantised type (unsigned; Q8_0's as their
 * signed bytes). */
static inline __attribute__((always_inline)) void gguf_values(int type, const uint8_t *b, int g, uint8_t *q) {
    switch (type) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: { /* 4 values (a 32-bit word) at a time; Q5_*'s 5th bit of value i is bit i of qh */
        int five = type == Q5_0 || type == Q5_1;
        const uint8_t *qh = b + (type == Q4_0 || type == Q5_0 ? 2 : 4), *qs = qh + 4 * five;
        uint32_t high = 0;
        if (five) memcpy(&high, qh, 4);
        for (int i = 0; i < 16; i += 4) {
            uint32_t bytes, low, top;
            memcpy(&bytes, qs + i, 4);
            low = (bytes & 0x0f0f0f0fu) | spread_bits((high >> i) & 15) << 4;
            top = ((bytes >> 4) & 0x0f0f0f0fu) | spread_bits((high >> (i + 16)) & 15) << 4;
            memcpy(q + i, &low, 4);
            memcpy(q + i + 16, &top, 4);
        }
        return;
    }
    case Q8_0:
        for (int i = 0; i < 32; ++i) q[i] = b[2 + i];
        return;
    case Q2_K:
    case Q3_K: { /* 2 bits of value 32 g + i at bits 2 (g % 4) of byte 32 (g / 4) + i; Q3_K's
                  * 3rd at bit g of hmask byte i (the value is q - 4) */
        const uint8_t *qs = b + (type == Q2_K ? 16 : 32) + 32 * (g / 4);
        for (int i = 0; i < 32; ++i) {
            int v = (qs[i] >> (2 * (g % 4))) & 3;
            if (type == Q3_K) v |= ((b[i] >> g) & 1) << 2;
            q[i] = (uint8_t)v;
        }
        return;
    }
    case Q4_K:
    case Q5_K: {
        const uint8_t *qh = b + 16, *bytes = b + (type == Q4_K ? 16 : 48) + 32 * (g / 2);
        for (int i = 0; i < 32; ++i) {
            int v = g % 2 ? bytes[i] >> 4 : bytes[i] & 0x0f;
            if (type == Q5_K) v |= ((qh[i] >> g) & 1) << 4;
            q[i] = (uint8_t)v;
        }
        return;
    }
    case Q6_K: {
        const uint8_t *ql = b + 64 * (g / 4), *qh = b + 128 + 32 * (g / 4);
        int part = g % 4; /* 0: ql low, 1: ql+32 low, 2: ql high, 3: ql+32 high */
        const uint8_t *lo = ql + (part % 2) * 32;
        for (int i = 0; i < 32; ++i) {
            int low = part < 2 ? lo[i] & 0x0f : lo[i] >> 4;
            q[i] = (uint8_t)(low | (((qh[i] >> (2 * part)) & 3) << 4));
        }
        return;
    }
    }
}

/* The byte and bit of value 4v + i of row l (at = 4 l + i) in an area of width w (see Layout). */
static inline uint8_t *area_byte(const uint8_t *area, int w, int v, int at, int *shift) {
    *shift = w * (v % (8 / w));
    return (uint8_t *)area + 32 * (v / (8 / w)) + at;
}

/* Value `col` (0..31) of row l in a tile group's value area, read or written. */
static unsigned tile_value(const Layout *L, const uint8_t *area, int l, int col) {
    if (L->low == 16) {
        uint16_t h;
        memcpy(&h, area + 16 * col + 2 * l, 2);
        return h;
    }
    int v = col / 4, at = 4 * l + col % 4, shift;
    unsigned q = (*area_byte(area, L->low, v, at, &shift) >> shift) & ((1u << L->low) - 1);
    if (L->high)
        q |= ((*area_byte(area + 32 * L->low, L->high, v, at, &shift) >> shift) & ((1u << L->high) - 1))
             << L->low;
    return q;
}

static inline __attribute__((always_inline)) void set_tile_value(const Layout *L, uint8_t *area, int l, int col, unsigned q) {
    if (L->low == 16) {
        uint16_t h = (uint16_t)q;
        memcpy(area + 16 * col + 2 * l, &h, 2);
        return;
    }
    int v = col / 4, at = 4 * l + col % 4, shift;
    uint8_t *byte = area_byte(area, L->low, v, at, &shift);
    unsigned mask = (1u << L->low) - 1;
    *byte = (uint8_t)((*byte & ~(mask << shift)) | (q & mask) << shift);
    if (L->high) {
        byte = area_byte(area + 32 * L->low, L->high, v, at, &shift);
        mask = (1u << L->high) - 1;
        *byte = (uint8_t)((*byte & ~(mask << shift)) | ((q >> L->low) & mask) << shift);
    }
}

/* Row l's fields of a tile block from a GGUF block (the tile block's fields start zeroed). */
static inline __attribute__((always_inline)) void put_fields(int type, const uint8_t *b, uint8_t *t, int l) {
    switch (type) {
    case Q4_1:
    case Q5_1: memcpy(t + 16 + 2 * l, b + 2, 2); /* fall through: the scale */
    case Q4_0:
    case Q5_0:
    case Q8_0: memcpy(t + 2 * l, b, 2); return;
    case Q2_K:
        memcpy(t + 2 * l, b + 80, 2);
        memcpy(t + 16 + 2 * l, b + 82, 2);
        for (int k = 0; k < 16; ++k) t[32 + 8 * k + l] = b[k];
        return;
    case Q3_K:
        memcpy(t + 2 * l, b + 108, 2);
        for (int k = 0; k < 16; ++k) t[16 + 8 * k + l] = (uint8_t)(int8_t)q3_scale(b + 96, k);
        return;
    case Q4_K:
    case Q5_K:
        memcpy(t + 2 * l, b, 2);
        memcpy(t + 16 + 2 * l, b + 2, 2);
        for (int j = 0; j < 8; ++j) {
            int sc, mn;
            k_scale_min(b + 4, j, &sc, &mn);
            t[32 + 8 * j + l] = (uint8_t)sc;
            t[96 + 8 * j + l] = (uint8_t)mn;
        }
        return;
    case Q6_K:
        memcpy(t + 2 * l, b + 208, 2);
        for (int k = 0; k < 16; ++k) t[16 + 8 * k + l] = b[192 + k];
        return;
    }
}

/* Row l's scale and minimum for each half of group g of a tile block: w = s * q + m. Q8_0's
 * values are signed and its minimum zero. */
static void tile_scales(int type, const uint8_t *t, int l, int g, float *s, float *m) {
    float d = f16_at(t + 2 * l);
    switch (type) {
    case Q4_0: s[0] = s[1] = d, m[0] = m[1] = -8.0f * d; return;
    case Q5_0: s[0] = s[1] = d, m[0] = m[1] = -16.0f * d; return;
    case Q4_1:
    case Q5_1: s[0] = s[1] = d, m[0] = m[1] = f16_at(t + 16 + 2 * l); return;
    case Q8_0: s[0] = s[1] = d, m[0] = m[1] = 0.0f; return;
    case Q4_K:
    case Q5_K:
        s[0] = s[1] = d * (float)t[32 + 8 * g + l];
        m[0] = m[1] = -(f16_at(t + 16 + 2 * l) * (float)t[96 + 8 * g + l]);
        return;
    case Q2_K:
        for (int h = 0; h < 2; ++h) {
            uint8_t byte = t[32 + 8 * (2 * g + h) + l];
            s[h] = d * (float)(byte & 0x0f);
            m[h] = -(f16_at(t + 16 + 2 * l) * (float)(byte >> 4));
        }
        return;
    case Q3_K:
    case Q6_K:
        for (int h = 0; h < 2; ++h) {
            s[h] = d * (float)(int8_t)t[16 + 8 * (2 * g + h) + l];
            m[h] = (type == Q3_K ? -4.0f : -32.0f) * s[h];
        }
        return;
    default: s[0] = s[1] = m[0] = m[1] = 0.0f; /* F16 / BF16 have none */
    }
}

/* ---- activations ------------------------------------------------------------------------ */

/* Whether one row's activations are laid out with a copy (dl_set_twin_row). */
static int twin_row = 0;

int dl_set_twin_row(int on) {
    int before = twin_row;
    twin_row = on != 0;
    return before;
}

size_t dl_activation_bytes(int64_t M, int64_t K) {
    size_t G = (size_t)(K / GROUP);
    if (M < 2) M = 2; /* one row and its twin, whatever the setting when they are laid out */
    return ((size_t)(M * K) + 4 * (size_t)M * G * 4 + 127) / 64 * 64;
}

void dl_activations_at(Activations *a, void *memory, int64_t M, int64_t K) {
    int64_t G = K / GROUP;
    a->twin = M == 1 && twin_row;
    if (a->twin) M = 2; /* row 1 is row 0's copy: dl_quantise_rows writes it */
    a->d = memory;
    a->sum = a->d + M * G;
    a->half = a->sum + M * G;
    a->q = (int8_t *)(a->half + 2 * M * G);
    a->x = NULL, a->bf16 = NULL;
    a->K = K, a->G = G, a->M = M, a->ldx = K;
}

/* Group of 32 values v: q = round(v / d) with d = amax / 127 (into q); returns d, and the sums
 * of q over each half. */
static inline float quantise_group(const float *v, int8_t *q, int sums[2]) {
#ifdef __AVX2__
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
    __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
    __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                               _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float d = _mm_cvtss_f32(h) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    __m256 scale = _mm256_set1_ps(inv);
    /* rounding to nearest even, as lrintf */
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, scale));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, scale));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, scale));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, scale));
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi32(i0, i1));
    sums[0] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi32(i2, i3));
    sums[1] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
    return d;
#else
    float amax = 0.0f;
    for (int i = 0; i < GROUP; ++i) amax = fmaxf(amax, fabsf(v[i]));
    float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    sums[0] = sums[1] = 0;
    for (int i = 0; i < GROUP; ++i) {
        q[i] = (int8_t)lrintf(v[i] * inv);
        sums[i / 16] += q[i];
    }
    return d;
#endif
}

void dl_quantise_rows(const float *x, int64_t ldx, int64_t first, int64_t count, Activations *a) {
    a->x = x, a->ldx = ldx;
    for (int64_t r = first; r < first + count; ++r) {
        for (int64_t g = 0; g < a->G; ++g) {
            int sums[2];
            int64_t at = g * a->M + r;
            float d = quantise_group(x + r * ldx + g * GROUP, a->q + at * GROUP, sums);
            a->d[at] = d;
            a->sum[at] = d * (float)(sums[0] + sums[1]);
            a->half[2 * at] = d * (float)sums[0];
            a->half[2 * at + 1] = d * (float)sums[1];
        }
    }
    if (a->twin && first == 0 && count > 0)
        for (int64_t g = 0; g < a->G; ++g) {
            int64_t at = 2 * g;
            memcpy(a->q + (at + 1) * GROUP, a->q + at * GROUP, GROUP);
            a->d[at + 1] = a->d[at], a->sum[at + 1] = a->sum[at];
            a->half[2 * at + 2] = a->half[2 * at], a->half[2 * at + 3] = a->half[2 * at + 1];
        }
}

/* ---- portable product ------------------------------------------------------------------- */
#ifndef __AVX2__
/* out[r][l] for the 8 rows of one tile and rows first.. first + rows - 1 of x. */
static void tile_portable(int type, const Layout *L, const uint8_t *tile, const Activations *a,
                          int64_t first, int rows, float out[MAX_ROWS][TILE]) {
    int per = L->values / GROUP;
    for (int l = 0; l < TILE; ++l) {
        for (int r = 0; r < rows; ++r) {
            float acc = 0.0f, accm = 0.0f;
            for (int64_t g = 0; g < a->G; ++g) {
                const uint8_t *t = tile + (g / per) * L->tile_bytes;
                const uint8_t *area = t + L->head + (g % per) * L->group_bytes;
                float s[2], m[2];
                tile_scales(type, t, l, (int)(g % per), s, m);
                int64_t at = g * a->M + first + r;
                const int8_t *x = a->q + at * GROUP;
                int32_t dot[2] = {0, 0};
                for (int i = 0; i < GROUP; ++i) {
                    unsigned q = tile_value(L, area, l, i);
                    dot[i / 16] += (type == Q8_0 ? (int32_t)(int8_t)q : (int32_t)q) * x[i];
                }
                float dx = a->d[at];
                const float *half = a->half + 2 * at;
                if (per_half(type)) {
                    acc += (s[0] * dx) * (float)dot[0];
                    acc += (s[1] * dx) * (float)dot[1];
                    accm += m[0] * half[0];
                    accm += m[1] * half[1];
                } else {
                    acc += (s[0] * dx) * (float)(dot[0] + dot[1]);
                    accm += m[0] * a->sum[at];
                }
            }
            out[r][l] = acc + accm;
        }
    }
}
#define tile_product tile_portable

/* out[r][l] for F16 / BF16 weights: column k's product added to sum k % FLOAT_CHAINS, the sums
 * added in pairs at the end. */
static void tile_float(int type, const Layout *L, const uint8_t *tile, const Activations *a,
                       int64_t first, int rows, float out[MAX_ROWS][TILE]) {
    for (int l = 0; l < TILE; ++l) {
        for (int r = 0; r < rows; ++r) {
            const float *x = a->x + (first + r) * a->ldx;
            float acc[FLOAT_CHAINS] = {0.0f};
            for (int64_t k = 0; k < a->K; ++k) {
                unsigned bits = tile_value(L, tile + k / GROUP * L->tile_bytes, l, (int)(k % GROUP));
                acc[k % FLOAT_CHAINS] += float_value(type, bits) * x[k];
            }
            out[r][l] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
    }
}
#endif

/* ---- AVX2 product ----------------------------------------------------------------------- */
#ifdef __AVX2__

/* The products fetch the tile (or pair) after the next one while they compute: tens of KB
 * ahead for the widest rows, more than a core's L1 holds, so they fetch into L2 (T1), where the
 * lines wait without evicting what the loop is using; L1 fetches would be evicted before use. */
#define AHEAD _MM_HINT_T1

/* bits [at, at + width) of each byte moved to bits [to, to + width) (the others zero); the mask
 * is applied where the bits end up, so that a type's vectors share as few masks as may be (each
 * one more takes a register) */
static inline __m256i bits_to(__m256i v, int at, int width, int to) {
    if (width == 8) return v;
    if (at < to) v = _mm256_slli_epi16(v, to - at);
    if (at > to) v = _mm256_srli_epi16(v, at - to);
    return _mm256_and_si256(v, _mm256_set1_epi8((char)(((1 << width) - 1) << to)));
}

/* Value vector v of an area of width w bits (see Layout), moved to bits [to, to + w). */
static inline __m256i area_vector(const uint8_t *area, int w, int v, int to) {
    __m256i bytes = _mm256_loadu_si256((const __m256i *)(area + 32 * (v / (8 / w))));
    return bits_to(bytes, w * (v % (8 / w)), w, to);
}

static inline __m256 load_halves8(const uint8_t *p) { /* 8 float16 -> 8 floats */
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline __m256 load_bytes8(const uint8_t *p) { /* 8 unsigned bytes -> 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 load_signed8(const uint8_t *p) { /* 8 signed bytes -> 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* One tile group's scales and minimums per row of the tile (32-bit lane), for each half. */
typedef struct {
    __m256 s[2], m[2];
} Scales;

static inline __attribute__((always_inline)) void group_scales(int type, const uint8_t *t, int j,
                                                                Scales *S) {
    __m256 d = load_halves8(t);
    switch (type) {
    case Q4_0: S->s[0] = d, S->m[0] = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)); break;
    case Q5_0: S->s[0] = d, S->m[0] = _mm256_mul_ps(d, _mm256_set1_ps(-16.0f)); break;
    case Q4_1:
    case Q5_1: S->s[0] = d, S->m[0] = load_halves8(t + 16); break;
    case Q8_0: /* under VNNI the values are read as q + 128, with minimum -128 d */
        S->s[0] = d, S->m[0] = _mm256_mul_ps(d, _mm256_set1_ps(VNNI ? -128.0f : 0.0f));
        break;
    case Q4_K:
    case Q5_K:
        S->s[0] = _mm256_mul_ps(d, load_bytes8(t + 32 + 8 * j));
        S->m[0] = _mm256_sub_ps(_mm256_setzero_ps(),
                                _mm256_mul_ps(load_halves8(t + 16), load_bytes8(t + 96 + 8 * j)));
        break;
    case Q2_K:
        for (int h = 0; h < 2; ++h) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(t + 32 + 8 * (2 * j + h)));
            __m256i both = _mm256_cvtepu8_epi32(bytes);
            __m256 sc = _mm256_cvtepi32_ps(_mm256_and_si256(both, _mm256_set1_epi32(0x0f)));
            __m256 mn = _mm256_cvtepi32_ps(_mm256_srli_epi32(both, 4));
            S->s[h] = _mm256_mul_ps(d, sc);
            S->m[h] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(load_halves8(t + 16), mn));
        }
        break;
    case Q3_K:
    case Q6_K:
        for (int h = 0; h < 2; ++h) {
            S->s[h] = _mm256_mul_ps(d, load_signed8(t + 16 + 8 * (2 * j + h)));
            S->m[h] = _mm256_mul_ps(S->s[h], _mm256_set1_ps(type == Q3_K ? -4.0f : -32.0f));
        }
        break;
    }
    if (!per_half(type)) S->s[1] = S->s[0], S->m[1] = S->m[0];
}

/* Vector v (values 4v..4v+3 of each row of the tile) of a group's value area. */
static inline __attribute__((always_inline)) __m256i group_vector(int type, const Layout *L,
                                                                   const uint8_t *area, int v) {
    __m256i w = area_vector(area, L->low, v, 0);
    if (L->low == 8) return VNNI ? _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)) : w;
    if (L->high) w = _mm256_or_si256(w, area_vector(area + 32 * L->low, L->high, v, L->low));
    (void)type;
    return w;
}

static inline __m256i broadcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* Keeps v in a register at this point: without it the compiler regroups a row's 16-bit sums
 * into a tree whose partial sums outnumber the registers and spill (slower code). It only fixes
 * an order the compiler may not undo; the CPU still schedules freely. */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

/* Per row r of x (its 32 values at x + 32 r) and row of the tile (32-bit lane), the integer dot
 * products of a group's values with x's: lo[r] for the whole group, or for the types with a scale
 * per half the first half in lo[r] and the second in hi[r]. Each vector of weights is unpacked once and used for every
 * row of x at once. */
static inline __attribute__((always_inline)) void group_dots(int type, const Layout *L,
                                                              const uint8_t *area,
                                                              const int8_t *x, int rows,
                                                              __m256i *lo, __m256i *hi) {
#if VNNI
    for (int r = 0; r < rows; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
        __m256i w = group_vector(type, L, area, v);
        for (int r = 0; r < rows; ++r) {
            __m256i *sum = per_half(type) && v >= 4 ? &hi[r] : &lo[r];
            *sum = dot_bytes(*sum, w, broadcast4(x + 32 * r + 4 * v));
        }
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (type == Q8_0) { /* |w| times x with w's sign; each pair of products fits in 16 bits */
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
            __m256i w = group_vector(type, L, area, v), magnitude = _mm256_sign_epi8(w, w);
            for (int r = 0; r < rows; ++r) {
                __m256i p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(broadcast4(x + 32 * r + 4 * v), w));
                p = _mm256_madd_epi16(p, ones);
                lo[r] = v ? _mm256_add_epi32(lo[r], p) : p;
                IN_REGISTER(lo[r]);
            }
        }
        return;
    }
    /* values below 2^bits: 16-bit sums of `run` pairs of products cannot overflow (and a run
     * stays within a half for the types with a scale per half) */
    const int bits = L->low + L->high, run = bits <= 4 ? (per_half(type) ? 4 : 8) : bits == 5 ? 4 : 2;
    __m256i p[MAX_ROWS];
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
        __m256i w = group_vector(type, L, area, v);
        for (int r = 0; r < rows; ++r) {
            __m256i q = _mm256_maddubs_epi16(w, broadcast4(x + 32 * r + 4 * v));
            p[r] = v % run ? _mm256_add_epi16(p[r], q) : q;
            IN_REGISTER(p[r]);
            if (v % run == run - 1) { /* a run complete: widened into its 32-bit sum */
                __m256i *sum = per_half(type) && v >= 4 ? &hi[r] : &lo[r];
                __m256i wide = _mm256_madd_epi16(p[r], ones);
                int first = per_half(type) ? v % 4 == run - 1 : v == run - 1;
                *sum = first ? wide : _mm256_add_epi32(*sum, wide);
            }
        }
    }
#endif
}

/* out[r][l] = W[l] . x[r] for the 8 rows of one tile and `rows` (<= MAX_ROWS) rows of x, each
 * row by the same operations in the same order whatever `rows`. */
static inline __attribute__((always_inline)) void tile_avx2(int type, const Layout *L,
                                                             const uint8_t *tile,
                                                             const Activations *a, int64_t first,
                                                             int rows, float out[MAX_ROWS][TILE]) {
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
    /* a's fields as locals, moved to row `first` here: with a copied view of `a` per call and
     * its fields read in the loop, the compiler's code is slower, the more so the more rows */
    const int64_t G = a->G, M = a->M;
    const int8_t *q = a->q + first * GROUP;
    const float *dq = a->d + first, *sums = a->sum + first, *halves = a->half + 2 * first;
    int per = L->values / GROUP;
    /* the tile after next, fetched while this one is computed (the hardware prefetcher alone
     * keeps too few bytes in flight for a stream of tiles) */
    int64_t stride = G / per * L->tile_bytes, share = stride / G;
    const char *ahead = (const char *)tile + 2 * stride;
    for (int64_t g = 0; g < G; ++g) {
        for (int64_t line = 0; line < share; line += 64) _mm_prefetch(ahead + g * share + line, AHEAD);
        const uint8_t *t = tile + (g / per) * L->tile_bytes;
        int j = (int)(g % per);
        int64_t at = g * M; /* this group's first row of x */
        __m256i lo[MAX_ROWS], hi[MAX_ROWS];
        group_dots(type, L, t + L->head + j * L->group_bytes, q + at * GROUP, rows, lo, hi);
        Scales S;
        group_scales(type, t, j, &S);
        const float *d = dq + at, *sum = sums + at, *half = halves + 2 * at;
        for (int r = 0; r < rows; ++r) {
            __m256 dx = _mm256_broadcast_ss(d + r);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(S.s[0], dx), _mm256_cvtepi32_ps(lo[r]), acc[r]);
            if (per_half(type)) {
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(S.s[1], dx), _mm256_cvtepi32_ps(hi[r]), acc[r]);
                acc[r] = _mm256_fmadd_ps(S.m[0], _mm256_broadcast_ss(half + 2 * r), acc[r]);
                acc[r] = _mm256_fmadd_ps(S.m[1], _mm256_broadcast_ss(half + 2 * r + 1), acc[r]);
            } else if (type != Q8_0 || VNNI) {
                acc[r] = _mm256_fmadd_ps(S.m[0], _mm256_broadcast_ss(sum + r), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; ++r) _mm256_storeu_ps(out[r], acc[r]);
}

/* One specialised copy per type and row count, so that the unpacking is inlined and the
 * accumulators stay in registers. */
#define ROWS_CASE(t, n)                                                                      \
    case n: tile_avx2(t, &L, tile, a, first, n, out); return;
#define TYPE_CASE(t, CASE)                                                                   \
    case t: {                                                                                \
        Layout L;                                                                            \
        layout_of(t, &L);                                                                    \
        switch (rows) {                                                                      \
            CASE(t, 1) CASE(t, 2) CASE(t, 3) CASE(t, 4)                                      \
            CASE(t, 5) CASE(t, 6) CASE(t, 7) CASE(t, 8)                                      \
        }                                                                                    \
        return;                                                                              \
    }
#define EVERY_TYPE(CASE)                                                                     \
    TYPE_CASE(Q4_0, CASE) TYPE_CASE(Q4_1, CASE) TYPE_CASE(Q5_0, CASE) TYPE_CASE(Q5_1, CASE)  \
    TYPE_CASE(Q8_0, CASE) TYPE_CASE(Q2_K, CASE) TYPE_CASE(Q3_K, CASE) TYPE_CASE(Q4_K, CASE)  \
    TYPE_CASE(Q5_K, CASE) TYPE_CASE(Q6_K, CASE)
static void tile_product(int type, const Layout *unused, const uint8_t *tile,
                         const Activations *a, int64_t first, int rows, float out[MAX_ROWS][TILE]) {
    (void)unused;
    switch (type) { EVERY_TYPE(ROWS_CASE) }
}

#if WIDE
/* ---- two tiles at once (AVX-512) -------------------------------------------------------- */
/* Two consecutive tiles (`stride` bytes apart) in 512-bit vectors, the first tile's rows in the
 * low 256 bits: every 32-bit lane goes through tile_avx2's integer and float operations in the
 * same order, so each output has the bits tile_avx2 gives it. */

static inline __m512 join_ps(__m256 low, __m256 high) {
    __m512d wide = _mm512_castpd256_pd512(_mm256_castps_pd(low));
    return _mm512_castpd_ps(_mm512_insertf64x4(wide, _mm256_castps_pd(high), 1));
}

/* area_vector of both tiles. */
static inline __m512i area_vector2(const uint8_t *area, int64_t stride, int w, int v, int to) {
    const uint8_t *p = area + 32 * (v / (8 / w));
    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                                      _mm256_loadu_si256((const __m256i *)(p + stride)), 1);
    int at = w * (v % (8 / w));
    if (w == 8) return both;
    if (at < to) both = _mm512_slli_epi16(both, to - at);
    if (at > to) both = _mm512_srli_epi16(both, at - to);
    return _mm512_and_si512(both, _mm512_set1_epi8((char)(((1 << w) - 1) << to)));
}

/* One group's scales and minimums (per half, as group_scales gives them) for a pair of tiles
 * (tile blocks t0 and t1), t0's rows in the low 256 bits. */
static inline __attribute__((always_inline)) void pair_scales(int type, const uint8_t *t0,
                                                               const uint8_t *t1, int j,
                                                               __m512 s[2], __m512 m[2]) {
    Scales S0, S1;
    group_scales(type, t0, j, &S0);
    group_scales(type, t1, j, &S1);
    for (int h = 0; h < 2; ++h) s[h] = join_ps(S0.s[h], S1.s[h]), m[h] = join_ps(S0.m[h], S1.m[h]);
}

/* group_vector of both tiles (under VNNI). */
static inline __attribute__((always_inline)) __m512i group_vector2(const Layout *L,
                                                                    const uint8_t *area,
                                                                    int64_t stride, int v) {
    __m512i w = area_vector2(area, stride, L->low, v, 0);
    if (L->low == 8) return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    if (L->high) w = _mm512_or_si512(w, area_vector2(area + 32 * L->low, stride, L->high, v, L->low));
    return w;
}

/* out[r][c] = W[c] . x[r] for the 16 rows c of two tiles and `rows` (<= MAX_ROWS) rows of x:
 * tile_avx2 on both at once. */
static inline __attribute__((always_inline)) void tile_pair(int type, const Layout *L,
                                                             const uint8_t *tile, int64_t stride,
                                                             const Activations *a, int64_t first,
                                                             int rows, float out[MAX_ROWS][2 * TILE]) {
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t G = a->G, M = a->M;
    const int8_t *q = a->q + first * GROUP;
    const float *dq = a->d + first, *sums = a->sum + first, *halves = a->half + 2 * first;
    int per = L->values / GROUP;
    int64_t share = stride / G;
    const char *ahead = (const char *)tile + 2 * stride; /* the next pair */
    for (int64_t g = 0; g < G; ++g) {
        for (int64_t line = 0; line < share; line += 64) {
            _mm_prefetch(ahead + g * share + line, AHEAD);
            _mm_prefetch(ahead + stride + g * share + line, AHEAD);
        }
        const uint8_t *t = tile + (g / per) * L->tile_bytes;
        int j = (int)(g % per);
        int64_t at = g * M;
        const uint8_t *area = t + L->head + j * L->group_bytes;
        const int8_t *x = q + at * GROUP;
        __m512i lo[MAX_ROWS], hi[MAX_ROWS];
        for (int r = 0; r < rows; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
            __m512i w = group_vector2(L, area, stride, v);
            for (int r = 0; r < rows; ++r) {
                __m512i *sum = per_half(type) && v >= 4 ? &hi[r] : &lo[r];
                int32_t bytes;
                memcpy(&bytes, x + 32 * r + 4 * v, 4);
                *sum = _mm512_dpbusd_epi32(*sum, w, _mm512_set1_epi32(bytes));
            }
        }
        __m512 s[2], m[2];
        pair_scales(type, t, t + stride, j, s, m);
        __m512 s0 = s[0], m0 = m[0], s1 = s[1], m1 = m[1];
        const float *d = dq + at, *sum = sums + at, *half = halves + 2 * at;
        for (int r = 0; r < rows; ++r) {
            __m512 dx = _mm512_set1_ps(d[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s0, dx), _mm512_cvtepi32_ps(lo[r]), acc[r]);
            if (per_half(type)) {
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s1, dx), _mm512_cvtepi32_ps(hi[r]), acc[r]);
                acc[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(half[2 * r]), acc[r]);
                acc[r] = _mm512_fmadd_ps(m1, _mm512_set1_ps(half[2 * r + 1]), acc[r]);
            } else {
                acc[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(sum[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

#define PAIR_CASE(t, n)                                                                      \
    case n: tile_pair(t, &L, tile, stride, a, first, n, out); return;
static void pair_product(int type, const uint8_t *tile, int64_t stride, const Activations *a,
                         int64_t first, int rows, float out[MAX_ROWS][2 * TILE]) {
    switch (type) { EVERY_TYPE(PAIR_CASE) }
}

/* ---- four tiles at once (AVX-512) ------------------------------------------------------- */
/* Two pairs of tiles, each in 512-bit vectors as tile_pair's: every broadcast of x's bytes
 * feeds both pairs' dot products (half the broadcasts per product of tile_pair, which bind at
 * a few rows). Types with one scale per group of 32 only: those with a scale per half would
 * need twice the accumulators, more than the registers hold. Every 32-bit lane goes through
 * tile_avx2's operations in the same order, so each output has the bits tile_avx2 gives it. */
static inline int four_type(int type) { return type != F16 && type != BF16 && !per_half(type); }

/* 8 bytes at p0 and 8 at p1 as 16 32-bit lanes, p0's first. */
static inline __m512i bytes8x2(const uint8_t *p0, const uint8_t *p1) {
    int64_t high;
    memcpy(&high, p1, 8);
    return _mm512_cvtepu8_epi32(_mm_insert_epi64(_mm_loadl_epi64((const __m128i *)p0), high, 1));
}

/* A pair's group scales and minimums for the 8 groups of one Q4_K / Q5_K block (tile blocks
 * t0 and t1), computed once a block as group_scales computes them for each group. */
static inline __attribute__((always_inline)) void block_scales(const uint8_t *t0,
                                                                const uint8_t *t1, __m512 *s,
                                                                __m512 *m) {
    __m512 d = join_ps(load_halves8(t0), load_halves8(t1));
    __m512 dmin = join_ps(load_halves8(t0 + 16), load_halves8(t1 + 16));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
        s[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(bytes8x2(t0 + 32 + 8 * j, t1 + 32 + 8 * j)));
        m[j] = _mm512_sub_ps(
            _mm512_setzero_ps(),
            _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(bytes8x2(t0 + 96 + 8 * j, t1 + 96 + 8 * j))));
    }
}


/* out[r][c] = W[c] . x[r] for the 32 rows c of four tiles and `rows` (<= MAX_ROWS) rows of x. */
static inline __attribute__((always_inline)) void tile_four(int type, const Layout *L,
                                                             const uint8_t *tile, int64_t stride,
                                                             const Activations *a, int64_t first,
                                                             int rows, float out[MAX_ROWS][4 * TILE]) {
    __m512 acc0[MAX_ROWS], acc1[MAX_ROWS];
    for (int r = 0; r < rows; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    const int64_t G = a->G, M = a->M;
    const int8_t *q = a->q + first * GROUP;
    const float *dq = a->d + first, *sums = a->sum + first;
    int per = L->values / GROUP, k_block = type == Q4_K || type == Q5_K;
    int64_t share = stride / G;
    const char *ahead = (const char *)tile + 4 * stride; /* the next four */
    __m512 s0[8], m0[8], s1[8], m1[8];
    for (int64_t g = 0; g < G; ++g) {
        for (int64_t line = 0; line < share; line += 64)
            for (int k = 0; k < 4; ++k) _mm_prefetch(ahead + k * stride + g * share + line, AHEAD);
        const uint8_t *t = tile + (g / per) * L->tile_bytes;
        int j = (int)(g % per), at = k_block ? j : 0;
        if (k_block && j == 0) {
            block_scales(t, t + stride, s0, m0);
            block_scales(t + 2 * stride, t + 3 * stride, s1, m1);
        } else if (!k_block) {
            pair_scales(type, t, t + stride, j, s0, m0);
            pair_scales(type, t + 2 * stride, t + 3 * stride, j, s1, m1);
        }
        const uint8_t *area = t + L->head + j * L->group_bytes;
        const int8_t *x = q + g * M * GROUP;
        __m512i lo0[MAX_ROWS], lo1[MAX_ROWS];
        for (int r = 0; r < rows; ++r) lo0[r] = lo1[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
            __m512i w0 = group_vector2(L, area, stride, v);
            __m512i w1 = group_vector2(L, area + 2 * stride, stride, v);
            for (int r = 0; r < rows; ++r) {
                int32_t bytes;
                memcpy(&bytes, x + 32 * r + 4 * v, 4);
                __m512i b = _mm512_set1_epi32(bytes);
                lo0[r] = _mm512_dpbusd_epi32(lo0[r], w0, b);
                lo1[r] = _mm512_dpbusd_epi32(lo1[r], w1, b);
            }
        }
        const float *d = dq + g * M, *sum = sums + g * M;
        for (int r = 0; r < rows; ++r) {
            __m512 dx = _mm512_set1_ps(d[r]), sx = _mm512_set1_ps(sum[r]);
            acc0[r] = _mm512_fmadd_ps(_mm512_mul_ps(s0[at], dx), _mm512_cvtepi32_ps(lo0[r]), acc0[r]);
            acc0[r] = _mm512_fmadd_ps(m0[at], sx, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(_mm512_mul_ps(s1[at], dx), _mm512_cvtepi32_ps(lo1[r]), acc1[r]);
            acc1[r] = _mm512_fmadd_ps(m1[at], sx, acc1[r]);
        }
    }
    for (int r = 0; r < rows; ++r) {
        _mm512_storeu_ps(out[r], acc0[r]);
        _mm512_storeu_ps(out[r] + 2 * TILE, acc1[r]);
    }
}

#define FOUR_CASE(t, n)                                                                      \
    case n: tile_four(t, &L, tile, stride, a, first, n, out); return;
static void four_product(int type, const uint8_t *tile, int64_t stride, const Activations *a,
                         int64_t first, int rows, float out[MAX_ROWS][4 * TILE]) {
    switch (type) {
        TYPE_CASE(Q4_0, FOUR_CASE) TYPE_CASE(Q4_1, FOUR_CASE) TYPE_CASE(Q5_0, FOUR_CASE)
        TYPE_CASE(Q5_1, FOUR_CASE) TYPE_CASE(Q8_0, FOUR_CASE) TYPE_CASE(Q4_K, FOUR_CASE)
        TYPE_CASE(Q5_K, FOUR_CASE)
    }
}

#endif

/* Column k of an F16 / BF16 tile (one value of each of its 8 rows) as 8 floats. */
static inline __m256 load_column(int type, const uint8_t *p) {
    __m128i bits = _mm_loadu_si128((const __m128i *)p);
    if (type == F16) return _mm256_cvtph_ps(bits);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/* out[r][l] for F16 / BF16 weights and `rows` (<= FLOAT_ROWS) rows of x: column k's product
 * added to sum k % FLOAT_CHAINS with a fused multiply-add, the sums added in pairs at the end. */
static inline __attribute__((always_inline)) void float_rows(int type, const uint8_t *tile,
                                                              const float *x, int64_t ldx,
                                                              int64_t K, int rows, int prefetch,
                                                              float out[][TILE]) {
    __m256 acc[FLOAT_ROWS][FLOAT_CHAINS];
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < FLOAT_CHAINS; ++c) acc[r][c] = _mm256_setzero_ps();
    const char *ahead = (const char *)tile + 2 * 16 * K; /* the tile after next */
    for (int64_t k = 0; k < K; k += FLOAT_CHAINS) {
        if (prefetch) _mm_prefetch(ahead + 16 * k, AHEAD); /* 4 columns: one line */
        for (int c = 0; c < FLOAT_CHAINS; ++c) {
            __m256 w = load_column(type, tile + 16 * (k + c));
            for (int r = 0; r < rows; ++r)
                acc[r][c] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + r * ldx + k + c), acc[r][c]);
        }
    }
    for (int r = 0; r < rows; ++r)
        _mm256_storeu_ps(out[r], _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                               _mm256_add_ps(acc[r][2], acc[r][3])));
}

/* The tile's columns lie 16 bytes apart (the 512-byte tile blocks follow each other). */
static void tile_float(int type, const Layout *unused, const uint8_t *tile, const Activations *a,
                       int64_t first, int rows, float out[MAX_ROWS][TILE]) {
    (void)unused;
    for (int r0 = 0; r0 < rows; r0 += FLOAT_ROWS) {
        const float *x = a->x + (first + r0) * a->ldx;
        int n = rows - r0 < FLOAT_ROWS ? rows - r0 : FLOAT_ROWS, ahead = r0 == 0;
        switch (n * 2 + (type == F16)) { /* one specialised copy per row count and type */
#define FLOAT_CASE(n)                                                                        \
    case 2 * n: float_rows(BF16, tile, x, a->ldx, a->K, n, ahead, out + r0); break;          \
    case 2 * n + 1: float_rows(F16, tile, x, a->ldx, a->K, n, ahead, out + r0); break;
            FLOAT_CASE(1)
            FLOAT_CASE(2)
#if FLOAT_ROWS == 4
            FLOAT_CASE(3)
            FLOAT_CASE(4)
#endif
#undef FLOAT_CASE
        }
    }
}
#endif

/* ---- entry points ----------------------------------------------------------------------- */

/* Which instruction path this build uses: 2 = VNNI dot products (AVX-512 VNNI or AVX-VNNI),
 * 1 = AVX2, 0 = C. */
int dl_simd_level(void) {
#if VNNI
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* Bytes of N rows of K values of `type` repacked in tiles; 0 when unsupported or K is not
 * whole blocks. */
int64_t dl_tile_bytes(int type, int64_t N, int64_t K) {
    Layout L;
    if (!layout_of(type, &L) || K <= 0 || K % L.values) return 0;
    return (N + TILE - 1) / TILE * (K / L.values) * L.tile_bytes;
}

/* Row l's bits [shift, shift + w) (shift + w <= 8) of the 32 values q of a group, written into
 * an area of width w (see area_byte: value 4v + i of row l is in byte 32 (v / (8 / w)) + 4 l + i
 * at bit w (v % (8 / w))): 4 values, one 32-bit word of q, at a time. */
static inline __attribute__((always_inline)) void put_area_row(uint8_t *area, int w, int l,
                                                               const uint8_t *q, int shift) {
    int per = 8 / w;
    uint32_t mask = 0x01010101u * ((1u << w) - 1); /* w bits in each byte */
    for (int vb = 0; vb < w; ++vb) {
        uint32_t word = 0;
        for (int k = 0; k < per; ++k) {
            uint32_t values;
            memcpy(&values, q + 4 * (vb * per + k), 4);
            word |= ((values >> shift) & mask) << (w * k);
        }
        memcpy(area + 32 * vb + 4 * l, &word, 4);
    }
}

/* put_area_row's inverse: row l's values of an area of width w, shifted to bits [shift, shift +
 * w) and or-ed into the 32 values q. */
static inline void get_area_row(const uint8_t *area, int w, int l, uint8_t *q, int shift) {
    int per = 8 / w;
    uint32_t mask = 0x01010101u * ((1u << w) - 1);
    for (int vb = 0; vb < w; ++vb) {
        uint32_t word;
        memcpy(&word, area + 32 * vb + 4 * l, 4);
        for (int k = 0; k < per; ++k) {
            uint8_t *at = q + 4 * ((vb * per + k) & 7); /* vb * per + k < 8 for w <= 8 */
            uint32_t values;
            memcpy(&values, at, 4);
            values |= ((word >> (w * k)) & mask) << shift;
            memcpy(at, &values, 4);
        }
    }
}

/* GGUF row `src` (K values) repacked as row l of a tile row `out` (zeroed first where the tile
 * row is partial): inlined with `type` a constant, so that the layout arithmetic folds away. */
static inline __attribute__((always_inline)) void pack_row(int type, const uint8_t *src,
                                                           int64_t K, uint8_t *out, int l) {
    Layout L;
    layout_of(type, &L);
    int64_t blocks = K / L.values;
    int per = L.values / GROUP;
    for (int64_t b = 0; b < blocks; ++b, src += L.gguf_bytes) {
        uint8_t *t = out + b * L.tile_bytes;
        if (L.low == 16) { /* value c of row l at 16 c + 2 l */
            uint16_t bits[GROUP];
            memcpy(bits, src, sizeof bits);
            for (int c = 0; c < GROUP; ++c) memcpy(t + 16 * c + 2 * l, bits + c, 2);
            continue;
        }
        put_fields(type, src, t, l);
        for (int g = 0; g < per; ++g) {
            uint8_t *area = t + L.head + g * L.group_bytes, q[GROUP];
            gguf_values(type, src, g, q);
            put_area_row(area, L.low, l, q, 0);
            if (L.high) put_area_row(area + 32 * L.low, L.high, l, q, L.low);
        }
    }
}

/* Repack N GGUF rows of K values, row n's blocks at rows[n], into tiles (dl_tile_bytes bytes),
 * on up to `threads` threads: only for PACK_SHARED_BYTES or more, and in small shares taken in
 * turn, so that a thread that has lost its core to another process holds up little (a join per
 * small tensor costs more than it saves when the cores are shared). */
#define PACK_SHARED_BYTES (4 << 20)
int dl_pack(int type, const uint8_t *const *rows, int64_t N, int64_t K, uint8_t *tiles,
            int threads) {
    int64_t bytes = dl_tile_bytes(type, N, K);
    if (!bytes) return -1;
    int64_t tile_rows = (N + TILE - 1) / TILE, stride = bytes / tile_rows;
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads) if (threads > 1 && bytes >= PACK_SHARED_BYTES)
    for (int64_t tn = 0; tn < tile_rows; ++tn) {
        uint8_t *out = tiles + tn * stride;
        int count = N - tn * TILE < TILE ? (int)(N - tn * TILE) : TILE;
        if (count < TILE) memset(out, 0, (size_t)stride);
        for (int l = 0; l < count; ++l) {
            switch (type) {
#define PACK(T) \
    case T: pack_row(T, rows[tn * TILE + l], K, out, l); break;
                PACK(F16) PACK(BF16) PACK(Q4_0) PACK(Q4_1) PACK(Q5_0) PACK(Q5_1) PACK(Q8_0)
                PACK(Q2_K) PACK(Q3_K) PACK(Q4_K) PACK(Q5_K) PACK(Q6_K)
#undef PACK
            }
        }
    }
    return 0;
}

/* Rows index[0..count) of tiled weights `src` of K values written as rows first.. of tiled
 * weights `dst` (whose other rows are left as they are; zero tiles for fresh weights). */
int dl_gather(int type, const uint8_t *src, int64_t K, const int64_t *index, int64_t count,
              uint8_t *dst, int64_t first) {
    Layout L;
    if (!dl_tile_bytes(type, 1, K)) return -1;
    layout_of(type, &L);
    Field fields[2];
    int nfields = fields_of(type, fields);
    int64_t blocks = K / L.values, per = L.values / GROUP;
    for (int64_t r = 0; r < count; ++r) {
        int64_t n = first + r;
        int from = (int)(index[r] % TILE), to = (int)(n % TILE);
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t *s = src + ((index[r] / TILE) * blocks + b) * L.tile_bytes;
            uint8_t *t = dst + ((n / TILE) * blocks + b) * L.tile_bytes;
            for (int f = 0; f < nfields; ++f)
                for (int c = 0; c < fields[f].count; ++c) {
                    int at = fields[f].offset + c * TILE * fields[f].size;
                    memcpy(t + at + to * fields[f].size, s + at + from * fields[f].size,
                           (size_t)fields[f].size);
                }
            for (int g = 0; g < per; ++g) {
                const uint8_t *sa = s + L.head + g * L.group_bytes;
                uint8_t *ta = t + L.head + g * L.group_bytes;
                if (L.low == 16) {
                    for (int i = 0; i < GROUP; ++i) set_tile_value(&L, ta, to, i, tile_value(&L, sa, from, i));
                    continue;
                }
                uint8_t q[GROUP] = {0};
                get_area_row(sa, L.low, from, q, 0);
                put_area_row(ta, L.low, to, q, 0);
                if (L.high) {
                    get_area_row(sa + 32 * L.low, L.high, from, q, L.low);
                    put_area_row(ta + 32 * L.low, L.high, to, q, L.low);
                }
            }
        }
    }
    return 0;
}

/* out[r * K + k] = W[rows[r], k] (float32) of tiled weights; rows == NULL means 0..count-1. */
int dl_dequantize(int type, const uint8_t *tiles, int64_t K, const int64_t *rows, int64_t count,
                  float *out, int threads) {
    Layout L;
    if (!dl_tile_bytes(type, 1, K)) return -1;
    layout_of(type, &L);
    int64_t blocks = K / L.values, per = L.values / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count >= 64)
    for (int64_t r = 0; r < count; ++r) {
        int64_t n = rows ? rows[r] : r;
        int l = (int)(n % TILE);
        for (int64_t g = 0; g < K / GROUP; ++g) {
            const uint8_t *t = tiles + ((n / TILE) * blocks + g / per) * L.tile_bytes;
            const uint8_t *area = t + L.head + (g % per) * L.group_bytes;
            float *o = out + r * K + g * GROUP;
            if (L.low == 16) {
                for (int i = 0; i < GROUP; ++i) o[i] = float_value(type, tile_value(&L, area, l, i));
                continue;
            }
            float s[2], m[2];
            tile_scales(type, t, l, (int)(g % per), s, m);
            for (int i = 0; i < GROUP; ++i) {
                unsigned q = tile_value(&L, area, l, i);
                float value = type == Q8_0 ? (float)(int8_t)q : (float)q;
                o[i] = s[i / 16] * value + m[i / 16];
            }
        }
    }
    return 0;
}

int64_t dl_tile_stride(int type, int64_t K) {
    Layout L;
    return layout_of(type, &L) ? K / L.values * L.tile_bytes : 0;
}

/* Rows a kernel computes for `rows` of `a`: one row and its twin where `a` holds one (only the
 * first row is stored). */
static inline int twinned(const Activations *a, int rows) { return rows == 1 && a->twin ? 2 : rows; }

/* One tile's rows (width <= 8) for rows first.. first + count - 1 of a. */
static void one_tile(int type, const uint8_t *tile, const Activations *a, int64_t first,
                     int64_t count, float *y, int64_t ldy, int width) {
    Layout L;
    layout_of(type, &L);
    float out[MAX_ROWS][TILE];
    for (int64_t m0 = 0; m0 < count; m0 += MAX_ROWS) {
        int rows = (int)(count - m0 < MAX_ROWS ? count - m0 : MAX_ROWS);
        if (L.low == 16)
            tile_float(type, &L, tile, a, first + m0, rows, out);
        else
            tile_product(type, &L, tile, a, first + m0, twinned(a, rows), out);
        for (int r = 0; r < rows; ++r) memcpy(y + (m0 + r) * ldy, out[r], (size_t)width * sizeof(float));
    }
}

/* Whether dl_tile takes four tiles at once where it can (dl_set_four_tiles). */
static int four_tiles = 1;

int dl_set_four_tiles(int on) {
#if WIDE
    int before = four_tiles;
    four_tiles = on != 0;
    return before;
#else
    (void)on;
    return -1;
#endif
}

void dl_tile(int type, const uint8_t *tile, const Activations *a, int64_t first, int64_t count,
             float *y, int64_t ldy, int width) {
    int64_t stride = dl_tile_stride(type, a->K);
    if (width > 2 * TILE) {
#if WIDE
        if (width == 4 * TILE && four_tiles && four_type(type)) {
            float out[MAX_ROWS][4 * TILE];
            for (int64_t m0 = 0; m0 < count; m0 += MAX_ROWS) {
                int rows = (int)(count - m0 < MAX_ROWS ? count - m0 : MAX_ROWS);
                four_product(type, tile, stride, a, first + m0, twinned(a, rows), out);
                for (int r = 0; r < rows; ++r)
                    memcpy(y + (m0 + r) * ldy, out[r], 4 * TILE * sizeof(float));
            }
            return;
        }
#endif
        dl_tile(type, tile, a, first, count, y, ldy, 2 * TILE);
        dl_tile(type, tile + 2 * stride, a, first, count, y + 2 * TILE, ldy, width - 2 * TILE);
        return;
    }
    if (width <= TILE) {
        one_tile(type, tile, a, first, count, y, ldy, width);
        return;
    }
#if WIDE
    if (type != F16 && type != BF16) {
        float out[MAX_ROWS][2 * TILE];
        for (int64_t m0 = 0; m0 < count; m0 += MAX_ROWS) {
            int rows = (int)(count - m0 < MAX_ROWS ? count - m0 : MAX_ROWS);
            pair_product(type, tile, stride, a, first + m0, twinned(a, rows), out);
            for (int r = 0; r < rows; ++r)
                memcpy(y + (m0 + r) * ldy, out[r], (size_t)width * sizeof(float));
        }
        return;
    }
#endif
    one_tile(type, tile, a, first, count, y, ldy, TILE);
    one_tile(type, tile + stride, a, first, count, y + TILE, ldy, width - TILE);
}

/* Bytes of a core's L2 that a block of quantised activation rows may fill (`dl_row_block`):
 * half of the L2 this CPU reports, 128 KB where it reports none; set by dl_set_block_bytes. */
static int64_t block_bytes = 0;

int64_t dl_set_block_bytes(int64_t bytes) {
    int64_t before = block_bytes;
    block_bytes = bytes;
    return before;
}

int64_t dl_row_block(int64_t K) {
    if (block_bytes <= 0) {
        long l2 = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE /* glibc's; elsewhere the default share */
        l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        block_bytes = l2 > 0 ? l2 / 2 : 128 << 10;
    }
    int64_t row = K + K / GROUP * 4 * (int64_t)sizeof(float); /* values, then d, sum, halves */
    int64_t rows = block_bytes / row / MAX_ROWS * MAX_ROWS;
    return rows > MAX_ROWS ? rows : MAX_ROWS;
}

void dl_tile_product(int type, const uint8_t *tiles, int64_t N, const Activations *a, int64_t M,
                     float *y, int64_t ldy) {
    int64_t units = (N + UNIT - 1) / UNIT, stride = dl_tile_stride(type, a->K);
    int64_t block = dl_row_block(a->K);
    for (int64_t m0 = 0; m0 < M; m0 += block) {
        int64_t count = M - m0 < block ? M - m0 : block;
        /* contiguous shares of units of tiles, so that each core's prefetcher follows one
         * stream (faster than chunks of tiles taken in turn) */
#pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < units; ++u)
            dl_tile(type, tiles + UNIT / TILE * u * stride, a, m0, count,
                    y + m0 * ldy + UNIT * u, ldy, N - UNIT * u < UNIT ? (int)(N - UNIT * u) : UNIT);
    }
}

void *dl_scratch(int which, size_t bytes) {
    static __thread void *buffer[SCRATCH_BUFFERS] = {NULL};
    static __thread size_t capacity[SCRATCH_BUFFERS] = {0};
    if (bytes > capacity[which]) {
        free(buffer[which]);
        capacity[which] = (bytes + 63) / 64 * 64;
        buffer[which] = aligned_alloc(64, capacity[which]);
        if (!buffer[which]) capacity[which] = 0;
    }
    return buffer[which];
}

/* y[m * ldy + n] = x[m] . W[n] for m < M, n < N, W tiled (dl_pack). Returns 0, or -1 for an
 * unsupported type or shape, -2 when out of memory. */
int dl_matmul(int type, const uint8_t *tiles, int64_t N, int64_t K, const float *x, int64_t ldx,
              int64_t M, float *y, int64_t ldy, int threads) {
    if (!dl_tile_bytes(type, N, K)) return -1;
    void *memory = dl_scratch(SCRATCH_ACTIVATIONS, dl_activation_bytes(M, K));
    if (!memory) return -2;
    Activations a;
    dl_activations_at(&a, memory, M, K);
    dl_quantise_rows(x, ldx, 0, M, &a);
#pragma omp parallel num_threads(threads) if (threads > 1 && N >= 128)
    dl_tile_product(type, tiles, N, &a, M, y, ldy);
    return 0;
}

#ifdef BF16_TILES
/* ---- a prompt's rows on bfloat16 tiles (AMX) ----------------------------------------------
 * A prompt's many rows make another product pay where the CPU has AMX-BF16: the weights of up to
 * 4 tiles (32 outputs) unpacked once per call into bfloat16 (w = s * q + m in float, rounded),
 * and x rounded to bfloat16, multiplied by tile instructions (16 rows by 16 outputs by 32 values
 * each) summing in float. No per-group float steps per row: those are the VNNI path's limit.
 * The bits differ from the 8-bit path's, so only a prompt's rows take it, all of them (a chunk
 * of one row too): each row's bits still depend on nothing but its own x. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t columns[16]; /* bytes per row */
    uint8_t rows[16];
} TileConfig;

/* Bytes of one group's unpacked weights for 2 pairs of tiles: per pair a B tile of 16 rows (pairs
 * of values 2i, 2i + 1) of 16 outputs' two bfloat16. */
#define QUAD_GROUP_BYTES 2048

/* Group g of a pair of tiles (`stride` bytes apart; 0: one tile, in both halves) into a B tile
 * (`B`, 1 KB): B row i holds values 2i and 2i + 1 of each of the 16 outputs. */
TILE_TARGET static inline __attribute__((always_inline)) void unpack_pair(
    int type, const Layout *L, const uint8_t *tile, int64_t stride, int64_t g, uint8_t *B) {
    int per = L->values / GROUP, j = (int)(g % per);
    const uint8_t *t = tile + (g / per) * L->tile_bytes, *area = t + L->head + j * L->group_bytes;
    const __m512i byte = _mm512_set1_epi32(0xff);
    Scales S0, S1;
    group_scales(type, t, j, &S0);
    group_scales(type, t + stride, j, &S1);
    __m512 s[2] = {join_ps(S0.s[0], S1.s[0]), join_ps(S0.s[1], S1.s[1])};
    __m512 m[2] = {join_ps(S0.m[0], S1.m[0]), join_ps(S0.m[1], S1.m[1])};
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
        __m512i w = group_vector2(L, area, stride, v);
        __m512 sv = s[v >= 4], mv = m[v >= 4];
        __m512 f0 = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(_mm512_and_si512(w, byte)), mv);
        __m512 f1 = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 8), byte)), mv);
        __m512 f2 = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 16), byte)), mv);
        __m512 f3 = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 24)), mv);
        bf16_pairs(f0, f1, B + 2 * v * 64);
        bf16_pairs(f2, f3, B + (2 * v + 1) * 64);
    }
}

/* out[r][c] (32 floats a row) = xb[r] . W[c] for r < M and the outputs c of `tiles` (1 to 4)
 * tiles from `tile` on, the weights of group g unpacked into B (QUAD_GROUP_BYTES a group: the
 * two B tiles) while the first 32 rows multiply group g - 1 (the tile unit runs beside the
 * vector units); later rows reuse B. Tiles 4-7 sum rows 0-15 and 16-31 by outputs 0-15 and
 * 16-31, over the groups in order. */
TILE_TARGET static inline __attribute__((always_inline)) void quad_product(
    int type, const Layout *L, const uint8_t *tile, int64_t stride, int tiles, int64_t K,
    const uint16_t *xb, int64_t M, uint8_t *B, float *out) {
    int64_t G = K / GROUP;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        const uint16_t *x = xb + m0 * K;
        for (int64_t g = 0; g < G; ++g) {
            uint8_t *b = B + g * QUAD_GROUP_BYTES;
            if (m0 == 0) {
                for (int pair = 0; pair < 2; ++pair) {
                    int have = tiles - 2 * pair;
                    if (have > 0)
                        unpack_pair(type, L, tile + 2 * pair * stride, have > 1 ? stride : 0, g,
                                    b + pair * 1024);
                    for (int r = 0; r < 16 && have < 2; ++r) /* outputs without weights: zeros */
                        memset(b + pair * 1024 + r * 64 + (have > 0 ? 32 : 0), 0, have > 0 ? 32 : 64);
                }
            }
            _tile_loadd(0, x + g * GROUP, K * 2);
            _tile_loadd(1, x + 16 * K + g * GROUP, K * 2);
            _tile_loadd(2, b, 64);
            _tile_loadd(3, b + 1024, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
        float *o = out + m0 * 32;
        _tile_stored(4, o, 128);
        _tile_stored(5, o + 16, 128);
        _tile_stored(6, o + 16 * 32, 128);
        _tile_stored(7, o + 16 * 32 + 16, 128);
    }
}

/* A constant in memory: GCC dropped the stores into a local configuration (it does not see that
 * ldtilecfg reads them) and the instruction faulted on what was left there. */
static const TileConfig SHAPES = {.palette = 1,
                                  .columns = {64, 64, 64, 64, 64, 64, 64, 64},
                                  .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

TILE_TARGET void dl_tile_shapes(void) { _tile_loadconfig(&SHAPES); }

int dl_prompt_tiles_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        unsigned a, b, c, d;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        int amx = (d >> 22 & 1) && (d >> 24 & 1); /* AMX-BF16, AMX-TILE */
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
        amx = amx && (a >> 5 & 1); /* AVX512-BF16 */
        ready = amx && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return ready;
}

#define QUAD_CASE(t)                                                                         \
    case t: {                                                                                \
        Layout L;                                                                            \
        layout_of(t, &L);                                                                    \
        quad_product(t, &L, tile, stride, tiles, K, xb, M, B, out);                          \
        break;                                                                               \
    }
TILE_TARGET int dl_prompt_tiles(int type, const uint8_t *tile, int64_t K, int width,
                                const uint16_t *xb, int64_t M, float *y, int64_t ldy) {
    Layout L;
    if (!dl_prompt_tiles_ready() || !layout_of(type, &L) || L.low == 16) return -1;
    int64_t stride = dl_tile_stride(type, K), padded = (M + 31) / 32 * 32;
    uint8_t *B = dl_scratch(SCRATCH_TILE_WEIGHTS, (size_t)(K / GROUP * QUAD_GROUP_BYTES));
    float *out = dl_scratch(SCRATCH_TILE_OUTPUTS, (size_t)(padded * 32) * sizeof(float));
    if (!B || !out) return -2;
    dl_tile_shapes();
    int tiles = (width + TILE - 1) / TILE;
    switch (type) {
        QUAD_CASE(Q4_0) QUAD_CASE(Q4_1) QUAD_CASE(Q5_0) QUAD_CASE(Q5_1) QUAD_CASE(Q8_0)
        QUAD_CASE(Q2_K) QUAD_CASE(Q3_K) QUAD_CASE(Q4_K) QUAD_CASE(Q5_K) QUAD_CASE(Q6_K)
    }
    for (int64_t m = 0; m < M; ++m) memcpy(y + m * ldy, out + m * 32, (size_t)width * sizeof(float));
    return 0;
}

TILE_TARGET void dl_bf16_rows(const float *x, int64_t ldx, int64_t first, int64_t count, int64_t K,
                              uint16_t *xb) {
    for (int64_t r = first; r < first + count; ++r)
        for (int64_t k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(xb + r * K + k),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * ldx + k)));
}
#else
void dl_tile_shapes(void) {}
int dl_prompt_tiles_ready(void) { return 0; }
int dl_prompt_tiles(int type, const uint8_t *tile, int64_t K, int width, const uint16_t *xb,
                    int64_t M, float *y, int64_t ldy) {
    (void)type, (void)tile, (void)K, (void)width, (void)xb, (void)M, (void)y, (void)ldy;
    return -1;
}
void dl_bf16_rows(const float *x, int64_t ldx, int64_t first, int64_t count, int64_t K,
                  uint16_t *xb) {
    (void)x, (void)ldx, (void)first, (void)count, (void)K, (void)xb;
}
#endif
