/* What the compiled kernels share across their sources: block products (gguf_blocks.c),
 * attention (attention.c), a layer's small operations (layer_ops.c), used one call at a time
 * from Python or all together by a whole layer range (layers.c).
 *
 * Functions marked "work-shared" split their work with `#pragma omp for`: called inside a
 * parallel region by every thread of it, they share the work (and end with a barrier); called
 * outside one, the calling thread does it all.
 */
#ifndef DELSPEC_KERNELS_H
#define DELSPEC_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* x quantised per group of 32 values for the block products: values q [M][K], and per row and
 * group the scale d, d times the sum of q over the group (`sum`) and over each half (`half`,
 * [M][G][2]). */
typedef struct {
    int8_t *q;
    float *d, *sum, *half;
    int64_t K, G;
} Activations;

/* Bytes of Activations for M rows of K values; `dl_activations_at` lays them out in `memory`
 * (64-byte aligned). */
size_t dl_activation_bytes(int64_t M, int64_t K);
void dl_activations_at(Activations *a, void *memory, int64_t M, int64_t K);
/* Quantise rows [first, first + count) of x (row stride ldx) into `a`. */
void dl_quantise_rows(const float *x, int64_t ldx, int64_t first, int64_t count, Activations *a);
/* Bytes from one tile of 8 weight rows of K values to the next (0 for an unknown type). */
int64_t dl_tile_stride(int type, int64_t K);
/* y[m * ldy + c] = x[m] . W[c] for the M rows of `a` and the first `width` (<= 8) rows c of the
 * tile at `tile`. */
void dl_tile(int type, const uint8_t *tile, const Activations *a, int64_t M, float *y,
             int64_t ldy, int width);
/* y[m * ldy + n] = x[m] . W[n] for the M rows of `a`, n < N, W tiled (dl_pack) in `type`.
 * Work-shared over tiles. */
void dl_tile_product(int type, const uint8_t *tiles, int64_t N, const Activations *a, int64_t M,
                     float *y, int64_t ldy);

/* The shape of one layer's attention. */
typedef struct {
    int heads, kv_heads, dim;
    int64_t kv_stride; /* floats between key-value heads in the cache */
    int64_t window;    /* a sliding window's length, or 0 */
    float scale;       /* softmax scale */
    const float *q_norm, *k_norm; /* per-head RMS norm weights, or NULL */
    float norm_eps, norm_offset;
} AttentionShape;

/* Writes the keys (normed, rotated) and values of `rows` new positions start.. from their fused
 * projection `qkv` ([rows][ld_qkv]) into the cache. Work-shared over rows and key-value heads.
 * `cos`/`sin`: the rows' RoPE tables [rows][dim]. */
void dl_attention_write(const AttentionShape *s, const float *qkv, int64_t ld_qkv,
                        const float *cos, const float *sin, float *keys, float *values, int rows,
                        int64_t start);
/* The attention output of those rows [rows][heads * dim]. With `written`, the cache already
 * holds the new rows (dl_attention_write); otherwise each task computes the new keys it needs
 * and writes its row's key and value into the cache itself (no step and barrier before; the bits
 * are the same). `scratch`: per thread, dl_attention_scratch floats. Work-shared over (head, row). */
void dl_attention_rows(const AttentionShape *s, const float *qkv, int64_t ld_qkv,
                       const float *cos, const float *sin, float *keys, float *values, float *out,
                       int rows, int64_t start, int written, float *scratch);
int64_t dl_attention_scratch(const AttentionShape *s, int64_t start, int64_t rows);

/* One row's RMS norm: out = x / rms(x) * (offset + weight) (out may be x). */
void dl_rms_norm_row(const float *x, const float *weight, float eps, float offset, int dim,
                     float *out);
/* One row's gated activation: out[i] = act(gate[i]) * up[i], SiLU or GELU (tanh). */
void dl_gated_row(const float *gate, const float *up, int width, int gelu, float *out);

#endif
