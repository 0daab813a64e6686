/* A range of transformer layers in one call, for models whose linear weights are tiled GGUF
 * blocks (gguf_blocks.c), in float32 on a CPU: norms, the fused q/k/v projection, attention with
 * the cache write (attention.c), the output projection, residuals, the gated MLP.
 *
 * One parallel region covers the whole range. Threads share the products (split by tiles of
 * output columns) and attention (split by head and row), and meet at a barrier after each of
 * them: five a layer. Everything done per row between them (residuals, norms, the activations'
 * quantisation) each thread does for itself on its own copy of the states, so it needs no
 * barrier. No step costs a Python call.
 *
 * The barriers are the team's own (`team_wait`), not OpenMP's: a thread that arrives first spins
 * only about as long as its own share of the step took, then sleeps until the last one arrives.
 * OpenMP's spin for a fixed count (libgomp: 300,000 pauses, long on some CPUs), and
 * when another process holds the core of the thread being waited for, the spinner burns its own
 * time slice and the pair falls out of step at every barrier (issue 29: two threads can run
 * slower than one on a busy machine).
 *
 * Every step is row-exact (each row goes through the same operations whatever the number of
 * rows), so running k positions together gives each the bits of k one-position calls.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <sched.h>
#ifdef __x86_64__
#include <immintrin.h>
#endif

#include "kernels.h"

#define TILE 8
#define MAX_PARTS 3
#define WRITE_FIRST 5 /* from this many rows, the cache is written before attention */

/* A linear weight: up to 3 parts of consecutive output rows (each a multiple of 8), each tiled
 * in one GGUF type. */
typedef struct {
    int parts;
    int type[MAX_PARTS];
    const uint8_t *tiles[MAX_PARTS];
    int64_t rows[MAX_PARTS];
    const float *bias; /* [N] or NULL */
    int64_t N, K;
} Linear;

typedef struct {
    Linear qkv, o, gate_up, down;
    const float *attn_norm, *mlp_norm;
    const float *post_attn_norm, *post_mlp_norm; /* NULL without sandwich norms */
    const float *q_norm, *k_norm;                /* NULL without per-head norms */
    float *keys, *values;                        /* the layer's cache [kv_heads][length][dim] */
    const float *cos, *sin;                      /* RoPE tables [length][dim] */
    int64_t window;                              /* sliding window, or 0 */
} Layer;

typedef struct {
    int hidden, heads, kv_heads, dim, intermediate, gelu;
    float eps, norm_offset, scale;
    float residual_scale; /* each layer's attention and MLP outputs scaled by it (Granite; 1) */
    float attn_softcap;   /* AttentionShape's softcap (Gemma 2), or 0 */
    int qk_norm_full;     /* q_norm / k_norm over all heads' queries / keys of a row (OLMo 2) */
    int64_t length;      /* cache positions per slot */
    int64_t slot_stride; /* floats between a layer's cache slots (sequences) */
    int num_layers;
    const Layer *layers;
} Model;

/* ---- the team's barrier ------------------------------------------------------------------ */

/* A barrier for the threads of one parallel region. `phase` counts completed barriers; the last
 * thread to arrive advances it and wakes the sleepers. `slept` counts waits that went to sleep
 * (for the caller: many of them mean the threads are not running at the same time). */
typedef struct {
    atomic_int arrived, phase, sleepers;
    atomic_long slept;
    atomic_int failed; /* a thread ran out of memory */
} Team;

/* A thread's place in its team: when it left the last barrier. */
typedef struct {
    Team *team;
    int size;
    double since;
} Member;

/* Shortest spin before sleeping, in seconds: a sleeping thread takes some microseconds to wake
 * (more in a VM), so a wait shorter than that is better spun. */
#define MIN_SPIN 50e-6

static void team_sleep(atomic_int *phase, int seen) {
#ifdef __linux__
    syscall(SYS_futex, phase, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    (void)phase, (void)seen;
    sched_yield();
#endif
}

static void team_wake(atomic_int *phase) {
#ifdef __linux__
    syscall(SYS_futex, phase, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0);
#else
    (void)phase;
#endif
}

static inline void pause_once(void) {
#ifdef __x86_64__
    _mm_pause();
#endif
}

/* Waits until every thread of the team has called it (a no-op for a team of one). Spins for
 * about as long as this thread's own work since the last barrier (at least MIN_SPIN), then
 * sleeps: a partner that far behind is not running. Orders memory like OpenMP's barrier. */
static void team_wait(Member *me) {
    if (me->size <= 1) return;
    Team *t = me->team;
    double arrival = omp_get_wtime(), spin = arrival - me->since;
    int phase = atomic_load_explicit(&t->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&t->arrived, 1, memory_order_acq_rel) == me->size - 1) {
        atomic_store_explicit(&t->arrived, 0, memory_order_relaxed);
        atomic_store(&t->phase, phase + 1); /* sequentially consistent with the sleepers' count */
        if (atomic_load(&t->sleepers)) team_wake(&t->phase);
        me->since = omp_get_wtime();
        return;
    }
    if (spin < MIN_SPIN) spin = MIN_SPIN;
    for (int i = 1; atomic_load_explicit(&t->phase, memory_order_acquire) == phase; ++i) {
        pause_once();
        if (i % 64 == 0 && omp_get_wtime() - arrival > spin) {
            atomic_fetch_add(&t->sleepers, 1);
            atomic_fetch_add_explicit(&t->slept, 1, memory_order_relaxed);
            while (atomic_load(&t->phase) == phase) team_sleep(&t->phase, phase);
            atomic_fetch_sub(&t->sleepers, 1);
            break;
        }
    }
    me->since = omp_get_wtime();
}

/* Weight rows a thread takes at a time: four tiles (dl_tile's widest, and what the bfloat16
 * tiles of a prompt's rows take at once). */
#define UNIT (4 * TILE)

/* out[m][0..width) for rows m0 + m (m < count) of `a` and weight rows row..row + width - 1 of
 * `w` (row a multiple of 8; width <= UNIT and within one part), plus the bias. A prompt's
 * rows go on bfloat16 tiles, except for float16 / bfloat16 weights (multiplied in float). */
static void linear_tiles(const Linear *w, int64_t row, int width, const Activations *a,
                         int64_t m0, int64_t count, float *out, int64_t ldo, Member *me) {
    int p = 0;
    int64_t first = 0, stride;
    while (row >= first + w->rows[p]) first += w->rows[p++];
    int64_t local = row - first;
    stride = dl_tile_stride(w->type[p], w->K);
    const uint8_t *tile = w->tiles[p] + local / TILE * stride;
    int status = a->bf16 ? dl_prompt_tiles(w->type[p], tile, w->K, width, a->bf16 + m0 * a->K,
                                           count, out, ldo)
                         : -1;
    if (status == -2) atomic_store(&me->team->failed, 1);
    if (status == -1) dl_tile(w->type[p], tile, a, m0, count, out, ldo, width);
    if (w->bias)
        for (int64_t m = 0; m < count; ++m)
            for (int c = 0; c < width; ++c) out[m * ldo + c] += w->bias[row + c];
}

/* A part's rows rounded up to whole units of `unit` rows (its last tiles counting as one). */
static int64_t paired(int64_t rows, int unit) { return (rows + unit - 1) / unit * unit; }

/* Rows of a part from `local` on that one call of linear_tiles takes (a unit, or the part's
 * last tiles). */
static int pair_width(int64_t rows, int64_t local, int unit) {
    return rows - local < unit ? (int)(rows - local) : unit;
}

/* out = x . W (+ bias) for the M rows quantised (or rounded to bfloat16) in `a`. Work-shared
 * over units of tiles (`UNIT` rows, never across parts), then the team's barrier. */
static void linear(const Linear *w, const Activations *a, int64_t M, float *out, Member *me) {
    int unit = UNIT;
    int64_t pairs = 0, block = dl_row_block(a->K);
    for (int p = 0; p < w->parts; ++p) pairs += paired(w->rows[p], unit) / unit;
    for (int64_t m0 = 0; m0 < M; m0 += block) {
        int64_t count = M - m0 < block ? M - m0 : block;
        float *rows = out + m0 * w->N;
#pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < pairs; ++u) {
            int p = 0;
            int64_t first = 0, local = unit * u;
            while (local >= paired(w->rows[p], unit))
                local -= paired(w->rows[p], unit), first += w->rows[p++];
            linear_tiles(w, first + local, pair_width(w->rows[p], local, unit), a, m0, count,
                         rows + first + local, w->N, me);
        }
    }
    team_wait(me);
}

/* act = f(x . W_gate) * (x . W_up), W_gate the first `width` rows of `w` and W_up the next.
 * Work-shared over units of tiles (each thread takes a unit of gate tiles and the matching up
 * tiles), then the team's barrier. */
static void gated_linear(const Model *m, const Linear *w, const Activations *a, int64_t M,
                         float *act, float *scratch, Member *me) {
    int width = m->intermediate, unit = UNIT;
    float *gate = scratch, *up = scratch + M * unit;
    int64_t block = dl_row_block(a->K);
    for (int64_t m0 = 0; m0 < M; m0 += block) {
        int64_t count = M - m0 < block ? M - m0 : block;
#pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < paired(width, unit) / unit; ++u) {
            int64_t col = unit * u;
            int n = pair_width(width, col, unit);
            linear_tiles(w, col, n, a, m0, count, gate, unit, me);
            linear_tiles(w, width + col, n, a, m0, count, up, unit, me);
            for (int64_t r = 0; r < count; ++r)
                dl_gated_row(gate + r * unit, up + r * unit, n, m->gelu,
                             act + (m0 + r) * width + col);
        }
    }
    team_wait(me);
}

/* This thread's states and scratch: its own, or (`split`) the team's shared states, of which
 * it takes rows [from, to) in the per-row steps. */
typedef struct {
    float *h, *x, *delta; /* [rows][hidden] */
    float *gate;          /* [2][rows][32]: gate and up outputs of a unit */
    void *quantised;      /* Activations (or a prompt's bfloat16 rows) for the widest input */
    float *attention;     /* dl_attention_scratch floats */
    int64_t from, to;
    int split, tiles;
} Own;

/* The rows of `source` (row stride ld) this thread takes, quantised into `a` (laid out for all
 * `rows`), or for a prompt's rows rounded to bfloat16 (`a->bf16`); with split rows, the team's
 * barrier after it (a product reads every row). */
static void quantised(const Own *own, const float *source, int64_t ld, Activations *a,
                      int64_t rows, Member *me) {
    dl_activations_at(a, own->quantised, rows, ld);
    if (own->tiles) {
        uint16_t *rounded = own->quantised;
        dl_bf16_rows(source, ld, own->from, own->to - own->from, ld, rounded);
        a->x = source, a->bf16 = rounded;
    } else {
        dl_quantise_rows(source, ld, own->from, own->to - own->from, a);
    }
    if (own->split) team_wait(me);
}

/* x = norm(h) for this thread's rows, quantised into a. */
static void normed(const Model *m, const Own *own, const float *weight, Activations *a,
                   int64_t rows, Member *me) {
    int d = m->hidden;
    if (!weight) { /* no norm before this step (OLMo 2): the states themselves */
        quantised(own, own->h, d, a, rows, me);
        return;
    }
    for (int64_t r = own->from; r < own->to; ++r)
        dl_rms_norm_row(own->h + r * d, weight, m->eps, m->norm_offset, d, own->x + r * d);
    quantised(own, own->x, d, a, rows, me);
}

/* h += norm(delta) (or delta without a norm) for this thread's rows. */
static void residual(const Model *m, const Own *own, const float *delta, const float *norm) {
    int d = m->hidden;
    for (int64_t r = own->from; r < own->to; ++r) {
        const float *dr = delta + r * d;
        if (norm) {
            dl_rms_norm_row(dr, norm, m->eps, m->norm_offset, d, own->delta + r * d);
            dr = own->delta + r * d;
        }
        float *hr = own->h + r * d;
        float rs = m->residual_scale;
        for (int i = 0; i < d; ++i) hr[i] = hr[i] + rs * dr[i];
    }
}

/* The steps of a layer that `profile` times (seconds, summed, on the first thread: each shared
 * step includes waiting for the other threads at its barrier). */
enum { NORM, QKV, ATTENTION, OUTPUT, MLP_NORM, GATE_UP, DOWN, RESIDUAL, STEPS };

static void lap(double *profile, int step, double *since) {
    if (!profile || omp_get_thread_num() != 0) return;
    double now = omp_get_wtime();
    profile[step] += now - *since;
    *since = now;
}

static void layer(const Model *m, const Layer *L, const Own *own, float *qkv, float *att,
                  float *act, float *delta, const Rows *R, int written, double *profile,
                  Member *me) {
    double since = profile ? omp_get_wtime() : 0.0;
    int width = m->intermediate;
    int64_t rows = R->rows, qkv_n = L->qkv.N, att_n = (int64_t)m->heads * m->dim;
    const float *q_norm = m->qk_norm_full ? NULL : L->q_norm;
    const float *k_norm = m->qk_norm_full ? NULL : L->k_norm;
    AttentionShape s = {m->heads, m->kv_heads, m->dim,       m->length * m->dim, L->window,
                        m->scale, q_norm,      k_norm,       m->eps,             m->norm_offset,
                        m->attn_softcap};
    Activations a;
    normed(m, own, L->attn_norm, &a, rows, me);
    lap(profile, NORM, &since);
    linear(&L->qkv, &a, rows, qkv, me);
    if (m->qk_norm_full && L->q_norm) { /* each row's queries, then its keys, normed in place */
        int64_t q_n = att_n, k_n = (int64_t)m->kv_heads * m->dim;
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; ++r) {
            float *row = qkv + r * qkv_n;
            dl_rms_norm_row(row, L->q_norm, m->eps, m->norm_offset, (int)q_n, row);
            dl_rms_norm_row(row + q_n, L->k_norm, m->eps, m->norm_offset, (int)k_n, row + q_n);
        }
        team_wait(me);
    }
    lap(profile, QKV, &since);
    if (written) {
        dl_attention_write(&s, R, qkv, qkv_n, L->cos, L->sin, L->keys, L->values);
        team_wait(me);
    }
    int status = own->tiles ? dl_attention_tiles(&s, R, qkv, qkv_n, L->cos, L->sin, L->keys,
                                                 L->values, att)
                            : -1;
    if (status == -2) atomic_store(&me->team->failed, 1);
    if (status == -1)
        dl_attention_rows(&s, R, qkv, qkv_n, L->cos, L->sin, L->keys, L->values, att, written,
                          own->attention);
    team_wait(me);
    lap(profile, ATTENTION, &since);
    quantised(own, att, att_n, &a, rows, me);
    linear(&L->o, &a, rows, delta, me);
    lap(profile, OUTPUT, &since);
    residual(m, own, delta, L->post_attn_norm);
    normed(m, own, L->mlp_norm, &a, rows, me);
    lap(profile, MLP_NORM, &since);
    gated_linear(m, &L->gate_up, &a, rows, act, own->gate, me);
    lap(profile, GATE_UP, &since);
    quantised(own, act, width, &a, rows, me);
    linear(&L->down, &a, rows, delta, me);
    lap(profile, DOWN, &since);
    residual(m, own, delta, L->post_mlp_norm);
    lap(profile, RESIDUAL, &since);
}

static size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* Runs layers [first, last) on the states h [rows][hidden] in place: row r at position
 * positions[r] of cache slot slots[r] (a sequence), writing their keys and values into the
 * cache. With `collect`, each layer's output is copied to collect[(i - first) * rows * hidden];
 * with `profile`, seconds per step of a layer are added to profile[0..7] (norm, q/k/v,
 * attention, output, MLP norm, gate/up, down, residual). With `waits`, waits[0] gets the
 * number of barrier waits of the call (all threads but the last to arrive, at each barrier)
 * and waits[1] how many of them slept (a partner thread was far behind: not running). With
 * `tiles` (long prompts' rows), the products run on bfloat16 tiles where dl_prompt_tiles_ready,
 * and attention too where the head size is a multiple of 32 (the cache is then written first).
 * With `split`, the threads split the per-row steps (norms, quantising the products' inputs,
 * residuals) between them in shared buffers, with a barrier before each product; without it,
 * each thread does them for every row in its own copy (no barrier). Neither changes a bit.
 * Returns 0, or -2 when out of memory. */
int dl_layers(const Model *m, float *h, int64_t rows, const int64_t *positions,
              const int64_t *slots, int first, int last, float *collect, int threads,
              int tiles, int split, double *profile, int64_t *waits) {
    if (first >= last) return 0;
    int d = m->hidden, width = m->intermediate, team = threads > 1 ? threads : 1;
    int64_t att_n = (int64_t)m->heads * m->dim, widest = width > att_n ? width : att_n;
    if (d > widest) widest = d;
    AttentionShape shape = {m->heads, m->kv_heads, m->dim, 0, 0, 0, NULL, NULL, 0, 0};
    Rows R = {(int)rows, positions, 0, slots, m->slot_stride, 0};
    int contiguous = 1; /* one sequence's consecutive positions */
    for (int64_t r = 1; r < rows; ++r)
        contiguous &= slots[r] == slots[0] && positions[r] == positions[0] + r;
    tiles = tiles && dl_prompt_tiles_ready(); /* their attention reads the cache written */
    int written = rows >= WRITE_FIRST || !contiguous || tiles;
    size_t states = round64((size_t)(rows * d) * 4);
    size_t shared[] = {
        round64((size_t)(rows * m->layers[first].qkv.N) * 4), /* q/k/v */
        round64((size_t)(rows * att_n) * 4),                  /* attention output */
        round64((size_t)(rows * width) * 4),                  /* activation */
        states,                                               /* o / down output */
    };
    /* a prompt's bfloat16 rows, and 32 more that the tile products read (their outputs unused) */
    size_t gates = round64((size_t)(2 * rows * 4 * TILE) * 4),
           quantised = tiles ? round64((size_t)((rows + 32) * widest) * 2)
                              : dl_activation_bytes(rows, widest);
    size_t own_bytes = 3 * states + gates + quantised +
                       round64((size_t)dl_attention_scratch(&shape, &R) * 4);
    size_t total = shared[0] + shared[1] + shared[2] + shared[3] + own_bytes * (size_t)team;
    static __thread char *arena = NULL;
    static __thread size_t capacity = 0;
    if (total > capacity) {
        free(arena);
        arena = aligned_alloc(64, total);
        capacity = arena ? total : 0;
        if (!arena) return -2;
    }
    float *qkv = (float *)arena, *att = (float *)(arena + shared[0]);
    float *act = (float *)(arena + shared[0] + shared[1]);
    float *delta = (float *)(arena + shared[0] + shared[1] + shared[2]);
    char *owned = arena + shared[0] + shared[1] + shared[2] + shared[3];

    Team shared_team = {0};
    int size = 1;
#pragma omp parallel num_threads(team) if (team > 1)
    {
        Member me = {&shared_team, omp_get_num_threads(), omp_get_wtime()};
        int t = omp_get_thread_num();
        if (t == 0) size = me.size;
        char *at = owned + own_bytes * (size_t)t;
        int shared_states = split && me.size > 1;
        char *states_at = shared_states ? owned : at; /* shared: the first thread's */
        Own own = {(float *)states_at, (float *)(states_at + states),
                   (float *)(states_at + 2 * states), (float *)(at + 3 * states),
                   states_at + 3 * states + gates, (float *)(at + 3 * states + gates + quantised),
                   0, rows, shared_states, tiles};
        if (own.split)
            own.from = rows * t / me.size, own.to = rows * (t + 1) / me.size;
        memcpy(own.h + own.from * d, h + own.from * d, (size_t)((own.to - own.from) * d) * 4);
        for (int i = first; i < last; ++i) {
            layer(m, &m->layers[i], &own, qkv, att, act, delta, &R, written, profile, &me);
            if (collect && own.split) team_wait(&me);
            if (collect && t == 0)
                memcpy(collect + (int64_t)(i - first) * rows * d, own.h, (size_t)(rows * d) * 4);
        }
        if (own.split) team_wait(&me);
        if (t == 0) memcpy(h, own.h, (size_t)(rows * d) * 4);
    }
    if (atomic_load(&shared_team.failed)) return -2;
    if (waits) {
        int shared_states = split && size > 1; /* 4 more barriers a layer, and one at the end */
        int per_layer = 5 + (written ? 1 : 0) + (shared_states ? 4 + (collect ? 1 : 0) : 0);
        waits[0] = (int64_t)(size - 1) * (per_layer * (last - first) + shared_states);
        waits[1] = atomic_load(&shared_team.slept);
    }
    return 0;
}
