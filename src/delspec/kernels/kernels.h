/* What the compiled kernels share across their sources: block products (gguf_blocks.c),
 * attention (attention.c), a layer's small operations (layer_ops.c), used one call at a time
 * from Python or all together by a whole layer range (layers.c), and rows of scores reduced to
 * their greedy pick and logsumexp (scores.c).
 *
 * Functions marked "work-shared" split their work with `#pragma omp for ... nowait`: called
 * inside a parallel region by every thread of it, they share the work and end *without* a
 * barrier (the caller waits where it needs the results: layers.c with its own team barrier,
 * the others at the end of their parallel region); called outside one, the calling thread does
 * it all.
 */
#ifndef DELSPEC_KERNELS_H
#define DELSPEC_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* x quantised per group of 32 values for the block products, group by group so that one
 * group's rows lie together: values q [G][M][32], and per group and row the scale d, d times the
 * sum of q over the group (`sum`, [G][M]) and over each half (`half`, [G][M][2]); and x itself
 * (row r at x + r * ldx, for the float16 / bfloat16 weights, multiplied in float: it must stay
 * as it is until the products are done). */
typedef struct {
    int8_t *q;
    float *d, *sum, *half;
    int64_t K, G, M;
    const float *x;
    int64_t ldx;
    const uint16_t *bf16; /* a prompt's rows rounded to bfloat16 (dl_prompt_tiles), or NULL */
    int twin; /* one row laid out as two, the second a copy of the first (dl_set_twin_row) */
} Activations;

/* Bytes of Activations for M rows of K values (for one row, room for its twin);
 * `dl_activations_at` lays them out in `memory` (64-byte aligned). */
size_t dl_activation_bytes(int64_t M, int64_t K);
void dl_activations_at(Activations *a, void *memory, int64_t M, int64_t K);
/* Quantise rows [first, first + count) of x (row stride ldx) into `a`, which keeps x too. */
void dl_quantise_rows(const float *x, int64_t ldx, int64_t first, int64_t count, Activations *a);
/* Bytes from one tile of 8 weight rows of K values to the next (0 for an unknown type). */
int64_t dl_tile_stride(int type, int64_t K);
/* y[m * ldy + c] = x[first + m] . W[c] for m < count and the first `width` (<= 32) rows c of
 * the tile at `tile` and the tiles after it, as many as `width` reaches (AVX-512 computes a pair
 * of tiles, or four, at once; the bits are those of one tile at a time). */
void dl_tile(int type, const uint8_t *tile, const Activations *a, int64_t first, int64_t count,
             float *y, int64_t ldy, int width);
/* Whether dl_tile computes four tiles at once where the build and type allow it (on != 0; the
 * default) or pairs of tiles: the same bits either way, the faster one measured per machine.
 * Process-wide; returns the previous setting, or -1 where the build has no four-tile path. */
int dl_set_four_tiles(int on);
/* Whether a product of one row runs the two-row loop on the row and a copy of it (on != 0) or
 * the one-row loop (0, the default). On some CPUs the one-row loop, with the least arithmetic
 * per weight byte, streams the weights from memory slower than two rows do; the row's bits are
 * the same either way (the copy's are dropped), and the machine measures which is faster.
 * Applies to activations laid out after the call (`dl_activations_at`). Process-wide; returns
 * the previous setting. */
int dl_set_twin_row(int on);
/* How many rows of activations with K values a product takes at a time: a block that stays in
 * the core's L2 while the weights stream past it (each row's bits are the same whatever the
 * block). `dl_set_block_bytes` sets the L2 bytes it may fill (0: half of the reported L2) and
 * returns the previous setting. */
int64_t dl_row_block(int64_t K);
int64_t dl_set_block_bytes(int64_t bytes);
/* y[m * ldy + n] = x[m] . W[n] for the M rows of `a`, n < N, W tiled (dl_pack) in `type`.
 * Work-shared over tiles, `dl_row_block` rows at a time. */
void dl_tile_product(int type, const uint8_t *tiles, int64_t N, const Activations *a, int64_t M,
                     float *y, int64_t ldy);
/* Thread-local scratch buffer `which` of at least `bytes` (grown as needed, kept for the next
 * call: no allocation per call); NULL when out of memory. */
enum {
    SCRATCH_ACTIVATIONS,  /* a product's quantised activations */
    SCRATCH_TILE_WEIGHTS, /* a prompt tile product's unpacked weights */
    SCRATCH_TILE_OUTPUTS, /* and its outputs */
    SCRATCH_ATTENTION,    /* a prompt's attention on tiles: keys, values, scores, weights */
    SCRATCH_BUFFERS
};
void *dl_scratch(int which, size_t bytes);
/* Loads the tile shapes the tile kernels use (8 tiles of 16 rows of 64 bytes) on this thread: at
 * every call, since other code on the thread (a library's own tile kernels) may have loaded
 * others, or released the tiles, since the last one. A no-op without tile kernels. */
void dl_tile_shapes(void);
/* Whether this build and CPU multiply a prompt's rows on bfloat16 tiles (AMX-BF16; the process
 * is granted the tiles' state at the first call). */
int dl_prompt_tiles_ready(void);
/* Rows [first, first + count) of x (row stride ldx, K values) rounded to bfloat16 into xb (row
 * stride K). */
void dl_bf16_rows(const float *x, int64_t ldx, int64_t first, int64_t count, int64_t K,
                  uint16_t *xb);
/* y[m * ldy + c] = xb[m] . W[c] for m < M and the first `width` (<= 32) weight rows c from the
 * tile at `tile` on (up to 4 tiles), the weights rounded to bfloat16, summed in float32 by tile
 * instructions: xb as dl_bf16_rows leaves it, M rounded up to 32 rows readable. Each row's bits
 * depend on its own x alone. Returns 0, -1 without tile products (dl_prompt_tiles_ready) or for
 * float16 / bfloat16 weights, -2 when out of memory. */
int dl_prompt_tiles(int type, const uint8_t *tile, int64_t K, int width, const uint16_t *xb,
                    int64_t M, float *y, int64_t ldy);

/* The shape of one layer's attention. */
typedef struct {
    int heads, kv_heads, dim;
    int64_t kv_stride; /* floats between key-value heads in the cache */
    int64_t window;    /* a sliding window's length, or 0 */
    float scale;       /* softmax scale */
    const float *q_norm, *k_norm; /* per-head RMS norm weights, or NULL */
    float norm_eps, norm_offset;
    float softcap; /* scaled scores capped to softcap * tanh(score / softcap) (Gemma 2), or 0 */
} AttentionShape;

/* Where a call's rows are: row r at position positions[r] (start + r when positions is NULL)
 * of cache slot slots[r] (slot 0 when slots is NULL); slots are slot_stride floats apart in the
 * keys and in the values; the RoPE tables passed with them begin at position table_first. */
typedef struct {
    int rows;
    const int64_t *positions;
    int64_t start;
    const int64_t *slots;
    int64_t slot_stride;
    int64_t table_first;
} Rows;

/* Writes the keys (normed, rotated) and values of the rows, from their fused projection `qkv`
 * ([rows][ld_qkv]), into the cache. Work-shared over rows and key-value heads. */
void dl_attention_write(const AttentionShape *s, const Rows *R, const float *qkv, int64_t ld_qkv,
                        const float *cos, const float *sin, float *keys, float *values);
/* The attention output of the rows [rows][heads * dim]. With `written`, the cache already holds
 * them (dl_attention_write); otherwise the rows must be one sequence's consecutive positions,
 * and each task computes the new keys it needs and writes its row's key and value into the
 * cache itself (no step and barrier before; the bits are the same). `scratch`: per thread,
 * dl_attention_scratch floats. Work-shared over (row, key-value head, block of its query
 * heads). */
void dl_attention_rows(const AttentionShape *s, const Rows *R, const float *qkv, int64_t ld_qkv,
                       const float *cos, const float *sin, float *keys, float *values, float *out,
                       int written, float *scratch);
int64_t dl_attention_scratch(const AttentionShape *s, const Rows *R);
/* Whether the tasks of a sequence's last row first read its cached keys and values once in
 * order, a share each (on != 0, the default), or leave them to the products' own reads: the
 * same results either way (reads only), the faster measured per machine. Process-wide; returns
 * the previous setting. */
int dl_set_fetch_first(int on);
/* dl_attention_rows for a prompt's rows on bfloat16 tiles (dl_prompt_tiles_ready; head size a
 * multiple of 32), the cache already written (dl_attention_write): keys, values, queries and
 * the softmax weights rounded to bfloat16, summed in float by tile instructions. Each row's bits
 * depend on its own query, keys and values alone. Work-shared over (up to 16 consecutive rows of
 * one sequence, key-value head). Returns 0, -1 where it does not apply, -2 when out of memory. */
int dl_attention_tiles(const AttentionShape *s, const Rows *R, const float *qkv, int64_t ld_qkv,
                       const float *cos, const float *sin, const float *keys, const float *values,
                       float *out);

/* One row's RMS norm: out = x / rms(x) * (offset + weight) (out may be x). */
void dl_rms_norm_row(const float *x, const float *weight, float eps, float offset, int dim,
                     float *out);
/* One row's gated activation: out[i] = act(gate[i]) * up[i], SiLU or GELU (tanh). */
void dl_gated_row(const float *gate, const float *up, int width, int gelu, float *out);


/* e^x for x in [-87, 88] (clamped outside): 2^(x log2 e) split into integer and fraction, the
 * fraction by a polynomial, with fused multiply-adds. Relative error ~2e-7 near 0, growing with
 * |x| (x log2 e is rounded in float first: up to ~6e-6 around -20): for softmax terms and
 * activations, not for sums that must be exact to float32 (scores.c's exp_precise). */
#define EXP_LOW -87.0f
#define EXP_HIGH 88.0f
#define LOG2_E 1.44269504088896341f
/* The polynomial's coefficients, the highest power's first (each vector width uses them in this
 * order: the same bits). */
static const float EXP_POLY[7] = {1.535336188319500e-4f, 1.339887440266574e-3f,
                                  9.618437357674640e-3f, 5.550332471162809e-2f,
                                  2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

static inline float exp_approx(float x) {
    float t = fminf(fmaxf(x, EXP_LOW), EXP_HIGH) * LOG2_E;
    float whole = floorf(t), f = t - whole;
    float p = EXP_POLY[0];
    for (int i = 1; i < 7; ++i) p = fmaf(p, f, EXP_POLY[i]);
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)whole + 127) << 23};
    return p * scale.f;
}

/* Where the compiler can build them (Linux, AVX-512 with VNNI, GCC 11+ or clang): a prompt's
 * products (gguf_blocks.c) and attention (attention.c) on bfloat16 tiles (AMX), run only where
 * the CPU has them (`dl_prompt_tiles_ready`). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) &&                 \
    defined(__AVX512VL__) && defined(__linux__) && (defined(__clang__) || __GNUC__ >= 11)
#define BF16_TILES 1
#define TILE_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16")))

/* Value k and k + 1 of 16 columns (f0, f1) as 16 pairs of bfloat16 (64 bytes at `to`): a row of
 * a B tile. */
TILE_TARGET static inline void bf16_pairs(__m512 f0, __m512 f1, uint8_t *to) {
    __m512i both = (__m512i)_mm512_cvtne2ps_pbh(f1, f0); /* f0's 16, then f1's */
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    _mm512_storeu_si512(to, _mm512_permutexvar_epi16(order, both));
}
#endif

#ifdef __AVX2__
/* exp_approx of eight values at once (the same operations, so the same bits). */
static inline __m256 exp8_approx(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LOW)), _mm256_set1_ps(EXP_HIGH));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(LOG2_E));
    __m256 whole = _mm256_floor_ps(t), f = _mm256_sub_ps(t, whole);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_POLY[i]));
    __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#endif
