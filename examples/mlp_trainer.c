/* strata-mlp-trainer: a C trainer that trains through Strata's step plan.
 *
 * The model is a stack of residual MLP blocks, y = x + relu(x W1) W2 (x: batch x width, W1:
 * width x ffn, W2: ffn x width), fp32, trained with AdamW to imitate a random "teacher" block on
 * fresh random batches (mean squared error). Forward and backward are plain C loops.
 *
 * What Strata does for it:
 *   - Every block's weights and grads live in Strata's DRAM tier and stream through the
 *     executor's HBM slots (strata_layer_acquire / strata_layer_release, forward then backward).
 *   - An attached AdamW optimizer (STRATA_UPDATE_AUTO) keeps the state in DRAM and updates each
 *     block as soon as its grads have landed.
 *   - The step plan (strata_step_plan_*) decides where each block's checkpoint waits: its input,
 *     kept from its forward pass to its backward pass, which recomputes the rest from it. Either
 *     on the device, in a buffer this program registers in Strata's HBM tier, or in host memory:
 *     then the block declares a DRAM activation tensor in its layer of the graph, copies its
 *     input into the executor's activation view in the forward pass, and reads it back, restored
 *     by the executor, in the backward pass.
 *
 * The "device" is Strata's HBM tier: its budget (--hbm-kib) is all the device memory this program
 * has, and its batch, its activations and the checkpoints it keeps there are tensors registered
 * in it beside the executor's slots. At the default sizes keeping every checkpoint on the device
 * does not fit: the plan sends the first blocks' checkpoints to DRAM and the step fits. With
 * --no-spill every checkpoint stays on the device whatever the plan says, and the runtime
 * refuses the memory (STRATA_ERROR_OUT_OF_MEMORY).
 *
 * Every step is checked against a plain implementation of the same model in this file (the same
 * loops over malloc'd arrays, no Strata) and of AdamW as Strata's CPU kernel computes it
 * (runtime/optimizer/kernels_impl.h, in the same operation order). With the library's generic
 * kernel (STRATA_OPTIMIZER_ISA=generic: no FMA contraction) every loss and weight must be equal
 * bit for bit; with its AVX2 / AVX-512 kernels (which contract into FMAs) within 1e-5.
 *
 * Host backend only: the blocks are computed by the CPU, which reads the executor's views and the
 * HBM tensors as host memory. That is what they are on the host backend (its HBM is simulated in
 * host memory); on the cuda backend they are device memory, so --backend cuda is refused.
 *
 * Usage: strata-mlp-trainer [--blocks N] [--width D] [--ffn F] [--batch B] [--steps S]
 *                           [--lr LR] [--seed SEED] [--hbm-kib K] [--no-spill]
 *                           [--backend host|cuda]
 * Exit status: 0 trained and matched the reference; 1 an ABI call failed (the library's message
 * is printed) or a check failed; 2 bad arguments or an unsupported backend. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata/strata.h"

#define CHECK(call)                                                                               \
  do {                                                                                            \
    strata_status_t s_ = (call);                                                                  \
    if (s_ != STRATA_OK) {                                                                        \
      fprintf(stderr, "strata-mlp-trainer: %s failed: %s: %s\n", #call, strata_status_string(s_), \
              strata_last_error_message());                                                       \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

static void fail(const char* what) {
  fprintf(stderr, "strata-mlp-trainer: %s\n", what);
  exit(1);
}

static void* xcalloc(size_t count, size_t size) {
  void* p = calloc(count, size);
  if (p == NULL) fail("out of host memory");
  return p;
}

/* ------------------------------------------------------------------------------------------
 * Options */

typedef struct options {
  int blocks, width, ffn, batch, steps;
  float lr;
  uint64_t seed;
  uint64_t hbm_bytes;
  int no_spill;
} options_t;

static long parse_long(const char* flag, const char* text, long lo, long hi) {
  char* end = NULL;
  long v = strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < lo || v > hi) {
    fprintf(stderr, "strata-mlp-trainer: %s wants an integer in [%ld, %ld], not '%s'\n", flag, lo,
            hi, text);
    exit(2);
  }
  return v;
}

static void parse(int argc, char** argv, options_t* o) {
  int i;
  o->blocks = 12;
  o->width = 128;
  o->ffn = 64;
  o->batch = 512;
  o->steps = 20;
  o->lr = 2e-3f;
  o->seed = 1;
  o->hbm_bytes = 4096u << 10;
  o->no_spill = 0;
  for (i = 1; i < argc; ++i) {
    const char* flag = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(flag, "--no-spill") == 0) {
      o->no_spill = 1;
      continue;
    }
    if (value == NULL) {
      fprintf(stderr, "strata-mlp-trainer: unknown flag or missing value: %s\n", flag);
      exit(2);
    }
    ++i;
    if (strcmp(flag, "--blocks") == 0) {
      o->blocks = (int)parse_long(flag, value, 1, 1024);
    } else if (strcmp(flag, "--width") == 0) {
      o->width = (int)parse_long(flag, value, 1, 4096);
    } else if (strcmp(flag, "--ffn") == 0) {
      o->ffn = (int)parse_long(flag, value, 1, 16384);
    } else if (strcmp(flag, "--batch") == 0) {
      o->batch = (int)parse_long(flag, value, 1, 65536);
    } else if (strcmp(flag, "--steps") == 0) {
      o->steps = (int)parse_long(flag, value, 1, 100000);
    } else if (strcmp(flag, "--seed") == 0) {
      o->seed = (uint64_t)parse_long(flag, value, 0, 2147483647L);
    } else if (strcmp(flag, "--hbm-kib") == 0) {
      o->hbm_bytes = (uint64_t)parse_long(flag, value, 64, 16L << 20) << 10;
    } else if (strcmp(flag, "--lr") == 0) {
      char* end = NULL;
      o->lr = strtof(value, &end);
      if (end == value || *end != '\0' || !(o->lr > 0.f && o->lr < 1.f)) {
        fprintf(stderr, "strata-mlp-trainer: --lr wants a number in (0, 1), not '%s'\n", value);
        exit(2);
      }
    } else if (strcmp(flag, "--backend") == 0) {
      if (strcmp(value, "cuda") == 0) {
        fprintf(stderr,
                "strata-mlp-trainer: refusing the cuda backend: this example computes its blocks "
                "with plain C loops on the CPU, which reads the executor's views and its HBM "
                "tensors as host memory; that holds on the host backend only. Run it with "
                "--backend host (the default).\n");
        exit(2);
      }
      if (strcmp(value, "host") != 0) {
        fprintf(stderr, "strata-mlp-trainer: --backend must be host or cuda, not '%s'\n", value);
        exit(2);
      }
    } else {
      fprintf(stderr, "strata-mlp-trainer: unknown flag %s\n", flag);
      exit(2);
    }
  }
}

/* ------------------------------------------------------------------------------------------
 * The model's arithmetic, shared by the Strata run and the reference: the same loops in the
 * same order, so any difference between the two runs is Strata's. Row-major throughout;
 * x, y, g: batch x width; a, da: batch x ffn; w1: width x ffn; w2: ffn x width. */

typedef struct dims {
  int batch, width, ffn;
} dims_t;

/* a = relu(x w1) */
static void up_relu(dims_t n, const float* x, const float* w1, float* a) {
  int b, d, f;
  for (b = 0; b < n.batch; ++b) {
    float* ab = a + (size_t)b * n.ffn;
    for (f = 0; f < n.ffn; ++f) ab[f] = 0.f;
    for (d = 0; d < n.width; ++d) {
      const float xd = x[(size_t)b * n.width + d];
      const float* row = w1 + (size_t)d * n.ffn;
      for (f = 0; f < n.ffn; ++f) ab[f] += xd * row[f];
    }
    for (f = 0; f < n.ffn; ++f) ab[f] = ab[f] > 0.f ? ab[f] : 0.f;
  }
}

/* y = x + a w2 */
static void down_residual(dims_t n, const float* x, const float* a, const float* w2, float* y) {
  int b, d, f;
  for (b = 0; b < n.batch; ++b) {
    float* yb = y + (size_t)b * n.width;
    for (d = 0; d < n.width; ++d) yb[d] = 0.f;
    for (f = 0; f < n.ffn; ++f) {
      const float af = a[(size_t)b * n.ffn + f];
      const float* row = w2 + (size_t)f * n.width;
      if (af == 0.f) continue;
      for (d = 0; d < n.width; ++d) yb[d] += af * row[d];
    }
    for (d = 0; d < n.width; ++d) yb[d] += x[(size_t)b * n.width + d];
  }
}

/* One block's forward pass: y = x + relu(x w1) w2, with `a` (batch x ffn) as scratch. */
static void block_forward(dims_t n, const float* x, const float* w1, const float* w2, float* a,
                          float* y) {
  up_relu(n, x, w1, a);
  down_residual(n, x, a, w2, y);
}

/* One block's backward pass from its checkpoint x and the grad g of its output: recomputes
 * a = relu(x w1) (the block keeps nothing else from its forward pass), adds the weights' grads
 * into gw1 and gw2, and writes the input's grad into dx. a, da: batch x ffn scratch. */
static void block_backward(dims_t n, const float* x, const float* w1, const float* w2,
                           const float* g, float* a, float* da, float* gw1, float* gw2, float* dx) {
  int b, d, f;
  up_relu(n, x, w1, a);
  for (b = 0; b < n.batch; ++b) { /* gw2 += a^T g */
    const float* gb = g + (size_t)b * n.width;
    for (f = 0; f < n.ffn; ++f) {
      const float af = a[(size_t)b * n.ffn + f];
      float* row = gw2 + (size_t)f * n.width;
      if (af == 0.f) continue;
      for (d = 0; d < n.width; ++d) row[d] += af * gb[d];
    }
  }
  for (b = 0; b < n.batch; ++b) { /* da = (g w2^T) where a > 0, else 0 */
    const float* gb = g + (size_t)b * n.width;
    for (f = 0; f < n.ffn; ++f) {
      const float* row = w2 + (size_t)f * n.width;
      float s = 0.f;
      if (a[(size_t)b * n.ffn + f] > 0.f) {
        for (d = 0; d < n.width; ++d) s += gb[d] * row[d];
      }
      da[(size_t)b * n.ffn + f] = s;
    }
  }
  for (b = 0; b < n.batch; ++b) { /* gw1 += x^T da */
    const float* dab = da + (size_t)b * n.ffn;
    for (d = 0; d < n.width; ++d) {
      const float xd = x[(size_t)b * n.width + d];
      float* row = gw1 + (size_t)d * n.ffn;
      for (f = 0; f < n.ffn; ++f) row[f] += xd * dab[f];
    }
  }
  for (b = 0; b < n.batch; ++b) { /* dx = g + da w1^T */
    const float* dab = da + (size_t)b * n.ffn;
    for (d = 0; d < n.width; ++d) {
      const float* row = w1 + (size_t)d * n.ffn;
      float s = 0.f;
      for (f = 0; f < n.ffn; ++f) s += dab[f] * row[f];
      dx[(size_t)b * n.width + d] = g[(size_t)b * n.width + d] + s;
    }
  }
}

/* Mean squared error over all batch x width outputs, halved: returns the loss, writes its grad
 * with respect to y into g. */
static double mse_loss(size_t count, const float* y, const float* target, float* g) {
  const float inv = 1.f / (float)count;
  double sum = 0.0;
  size_t i;
  for (i = 0; i < count; ++i) {
    const float e = y[i] - target[i];
    sum += (double)e * (double)e;
    g[i] = e * inv;
  }
  return sum / (2.0 * (double)count);
}

/* AdamW as Strata's CPU kernel computes it (runtime/optimizer/kernels_impl.h, adamw_loop, and
 * optimizer_update.cpp's scalars: products and bias corrections in double, rounded once), for
 * update t >= 1 of an fp32 param that is its own master, with no loss scale or clipping. */
typedef struct adamw {
  float lr, weight_decay, beta1, beta2, eps;
} adamw_t;

static void adamw_update(const adamw_t* h, uint64_t t, size_t count, float* p, float* m, float* v,
                         const float* grad) {
  const double lr = h->lr, wd = h->weight_decay, td = (double)t;
  const float lr_decay = (float)(lr * wd);
  const float step_size = (float)(lr / (1.0 - pow((double)h->beta1, td)));
  const float ib2 = (float)(1.0 / sqrt(1.0 - pow((double)h->beta2, td)));
  const float omb1 = 1.f - h->beta1, b2 = h->beta2, omb2 = 1.f - h->beta2;
  const float scale = 1.f, l2 = 0.f; /* no loss scale; AdamW's decay is decoupled */
  size_t i;
  for (i = 0; i < count; ++i) {
    const float p0 = p[i];
    const float gi = grad[i] * scale + l2 * p0;
    const float mi = m[i] + omb1 * (gi - m[i]);
    const float vi = v[i] * b2 + omb2 * (gi * gi);
    const float denom = sqrtf(vi) * ib2 + h->eps;
    p[i] = (p0 - p0 * lr_decay) - step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
  }
}

/* ------------------------------------------------------------------------------------------
 * Data: a seeded generator (splitmix64), uniform values of unit variance, a random teacher
 * block y = x + relu(x t1) t2 whose outputs the model learns to produce from fresh batches. */

static uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Uniform in [-scale, scale), from 24 random bits (exact in a float). */
static void fill_uniform(uint64_t* state, float* out, size_t count, float scale) {
  size_t i;
  for (i = 0; i < count; ++i) {
    const float u = (float)(splitmix64(state) >> 40) * (1.f / 16777216.f);
    out[i] = (2.f * u - 1.f) * scale;
  }
}

typedef struct teacher {
  float *t1, *t2, *scratch;
} teacher_t;

/* The batch of step `step`: x uniform of unit variance, target the teacher's output. */
static void make_batch(dims_t n, uint64_t seed, int step, const teacher_t* teacher, float* x,
                       float* target) {
  uint64_t state = seed * 1000003ull + (uint64_t)step;
  fill_uniform(&state, x, (size_t)n.batch * n.width, 1.7320508f);
  block_forward(n, x, teacher->t1, teacher->t2, teacher->scratch, target);
}

/* FNV-1a over the bits of some floats: a fingerprint of the trained weights. */
static uint64_t fnv1a(uint64_t h, const float* values, size_t count) {
  const unsigned char* bytes = (const unsigned char*)values;
  size_t i;
  for (i = 0; i < count * sizeof(float); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  return h;
}

static uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* ------------------------------------------------------------------------------------------
 * Strata's side */

static strata_tensor_t* make_tensor(strata_runtime_t* rt, const char* name, int64_t rows,
                                    int64_t cols, strata_role_t role, strata_tier_t tier) {
  const int64_t shape[2] = {rows, cols};
  strata_tensor_desc_t d;
  strata_tensor_t* t = NULL;
  memset(&d, 0, sizeof d);
  d.struct_size = STRATA_TENSOR_DESC_STRUCT_SIZE;
  d.name = name;
  d.dtype = STRATA_DTYPE_F32;
  d.ndim = 2;
  d.shape = shape;
  d.role = role;
  d.home_tier = tier;
  CHECK(strata_tensor_register(rt, &d, &t));
  return t;
}

/* The address of an HBM tensor, read and written by the CPU: host memory on the host backend. */
static float* device_floats(strata_runtime_t* rt, strata_tensor_t* t) {
  void* p = NULL;
  CHECK(strata_tensor_data_pointer(rt, t, &p));
  return (float*)p;
}

static uint64_t hbm_free(strata_runtime_t* rt) {
  strata_tier_usage_t u;
  memset(&u, 0, sizeof u);
  u.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
  CHECK(strata_runtime_tier_usage(rt, STRATA_TIER_HBM, &u));
  return u.budget_bytes - u.used_bytes;
}

static uint64_t align_up(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

typedef struct block {
  strata_tensor_t *w1, *w2, *g1, *g2; /* DRAM: streamed weights, grads sent back */
  /* Its checkpoint: a DRAM activation tensor of its layer (spilled), or an HBM buffer, whose
   * address is `kept`. */
  strata_tensor_t* checkpoint;
  float* kept;
  int spilled;
} block_t;

/* The Strata side: the runtime, the executor and the program's device buffers. */
typedef struct trainer {
  strata_runtime_t* rt;
  strata_executor_t* ex;
  block_t* blocks;
  int count;
  dims_t n;
  /* HBM: the batch and its target, two activations (forward: a block's input and output;
   * backward: the grads of its output and input), relu(x w1) and its grad. */
  strata_tensor_t *x_t, *target_t, *buf_t[2], *a_t, *da_t;
  float *x, *target, *buf[2], *a, *da;
} trainer_t;

/* One training step through the executor; returns the loss (before this step's update, which
 * the attached optimizer runs as each block's grads land). */
static double trainer_step(trainer_t* t, const float* host_x, const float* host_target) {
  const size_t bytes = (size_t)t->n.batch * (size_t)t->n.width * sizeof(float);
  double loss;
  int i, cur = 0;
  CHECK(strata_tensor_write(t->rt, t->x_t, 0, host_x, bytes));
  CHECK(strata_tensor_write(t->rt, t->target_t, 0, host_target, bytes));
  CHECK(strata_step_begin(t->ex));
  memcpy(t->buf[cur], t->x, bytes);
  for (i = 0; i < t->count; ++i) {
    const block_t* b = &t->blocks[i];
    strata_layer_views_t v;
    memset(&v, 0, sizeof v);
    v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
    /* HOST_WAIT: the data is in place when the call returns (the CPU computes, not a stream). */
    CHECK(strata_layer_acquire(t->ex, (uint32_t)i, STRATA_PHASE_FORWARD, NULL,
                               STRATA_ACQUIRE_HOST_WAIT, &v));
    /* The checkpoint: into the activation view, which the executor parks in DRAM after the
     * release, or into the block's HBM buffer. */
    memcpy(b->spilled ? v.activations[0] : b->kept, t->buf[cur], bytes);
    block_forward(t->n, t->buf[cur], (const float*)v.weights[0], (const float*)v.weights[1], t->a,
                  t->buf[1 - cur]);
    CHECK(strata_layer_release(t->ex, (uint32_t)i, STRATA_PHASE_FORWARD, NULL));
    cur = 1 - cur;
  }
  loss = mse_loss((size_t)t->n.batch * (size_t)t->n.width, t->buf[cur], t->target, t->buf[1 - cur]);
  cur = 1 - cur; /* buf[cur]: the grad of the last block's output */
  for (i = t->count - 1; i >= 0; --i) {
    const block_t* b = &t->blocks[i];
    strata_layer_views_t v;
    memset(&v, 0, sizeof v);
    v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
    CHECK(strata_layer_acquire(t->ex, (uint32_t)i, STRATA_PHASE_BACKWARD, NULL,
                               STRATA_ACQUIRE_HOST_WAIT, &v));
    /* A spilled checkpoint is back from DRAM in the activation view; the grad views are zeroed. */
    block_backward(t->n, b->spilled ? (const float*)v.activations[0] : b->kept,
                   (const float*)v.weights[0], (const float*)v.weights[1], t->buf[cur], t->a, t->da,
                   (float*)v.grads[0], (float*)v.grads[1], t->buf[1 - cur]);
    CHECK(strata_layer_release(t->ex, (uint32_t)i, STRATA_PHASE_BACKWARD, NULL));
    cur = 1 - cur;
  }
  CHECK(strata_step_end(t->ex));
  return loss;
}

/* The reference: the same model over malloc'd arrays, every checkpoint kept, AdamW as Strata's
 * kernel computes it. */
typedef struct reference {
  dims_t n;
  int count;
  float **w1, **w2, **m1, **v1, **m2, **v2, **checkpoint; /* per block */
  float *g1, *g2, *buf[2], *a, *da;
} reference_t;

static float** block_arrays(int count, size_t elements) {
  float** arrays = xcalloc((size_t)count, sizeof *arrays);
  int i;
  for (i = 0; i < count; ++i) arrays[i] = xcalloc(elements, sizeof(float));
  return arrays;
}

static void reference_init(reference_t* r, dims_t n, int count) {
  const size_t act = (size_t)n.batch * (size_t)n.width, par = (size_t)n.width * (size_t)n.ffn;
  r->n = n;
  r->count = count;
  r->w1 = block_arrays(count, par);
  r->w2 = block_arrays(count, par);
  r->m1 = block_arrays(count, par);
  r->v1 = block_arrays(count, par);
  r->m2 = block_arrays(count, par);
  r->v2 = block_arrays(count, par);
  r->checkpoint = block_arrays(count, act);
  r->g1 = xcalloc(par, sizeof(float));
  r->g2 = xcalloc(par, sizeof(float));
  r->buf[0] = xcalloc(act, sizeof(float));
  r->buf[1] = xcalloc(act, sizeof(float));
  r->a = xcalloc((size_t)n.batch * (size_t)n.ffn, sizeof(float));
  r->da = xcalloc((size_t)n.batch * (size_t)n.ffn, sizeof(float));
}

static void free_block_arrays(float** arrays, int count) {
  int i;
  for (i = 0; i < count; ++i) free(arrays[i]);
  free(arrays);
}

static void reference_free(reference_t* r) {
  float** per_block[7];
  int i;
  per_block[0] = r->w1;
  per_block[1] = r->w2;
  per_block[2] = r->m1;
  per_block[3] = r->v1;
  per_block[4] = r->m2;
  per_block[5] = r->v2;
  per_block[6] = r->checkpoint;
  for (i = 0; i < 7; ++i) free_block_arrays(per_block[i], r->count);
  free(r->g1);
  free(r->g2);
  free(r->buf[0]);
  free(r->buf[1]);
  free(r->a);
  free(r->da);
}

static double reference_step(reference_t* r, const adamw_t* h, uint64_t t, const float* x,
                             const float* target) {
  const size_t act = (size_t)r->n.batch * (size_t)r->n.width;
  const size_t par = (size_t)r->n.width * (size_t)r->n.ffn;
  double loss;
  int i, cur = 0;
  memcpy(r->buf[cur], x, act * sizeof(float));
  for (i = 0; i < r->count; ++i) {
    memcpy(r->checkpoint[i], r->buf[cur], act * sizeof(float));
    block_forward(r->n, r->buf[cur], r->w1[i], r->w2[i], r->a, r->buf[1 - cur]);
    cur = 1 - cur;
  }
  loss = mse_loss(act, r->buf[cur], target, r->buf[1 - cur]);
  cur = 1 - cur;
  for (i = r->count - 1; i >= 0; --i) {
    memset(r->g1, 0, par * sizeof(float));
    memset(r->g2, 0, par * sizeof(float));
    block_backward(r->n, r->checkpoint[i], r->w1[i], r->w2[i], r->buf[cur], r->a, r->da, r->g1,
                   r->g2, r->buf[1 - cur]);
    adamw_update(h, t, par, r->w1[i], r->m1[i], r->v1[i], r->g1);
    adamw_update(h, t, par, r->w2[i], r->m2[i], r->v2[i], r->g2);
    cur = 1 - cur;
  }
  return loss;
}

int main(int argc, char** argv) {
  options_t o;
  dims_t n;
  size_t act, hid, par; /* elements: a batch x width activation, a batch x ffn one, a weight */
  uint64_t checkpoint_bytes, saved_bytes, slot_bytes, held_bytes, free_bytes;
  strata_runtime_config_t config;
  trainer_t t;
  reference_t ref;
  teacher_t teacher;
  strata_step_block_t* plan_blocks;
  const strata_step_block_t** plan_block_ptrs;
  strata_step_profile_t profile;
  strata_step_plan_t* step_plan = NULL;
  strata_step_plan_info_t step_info;
  strata_graph_t* graph = NULL;
  strata_plan_config_t pc;
  strata_plan_t* plan = NULL;
  strata_plan_info_t plan_info;
  strata_optimizer_config_t oc;
  strata_optimizer_t* opt = NULL;
  strata_optimizer_stats_t ostats;
  adamw_t hyper;
  float *host_x, *host_target, *w;
  int i, step, spilled = 0, generic, loss_mismatches = 0;
  uint64_t weight_mismatches = 0, state;
  double first_loss = 0, last_loss = 0, worst_loss = 0, worst_weight = 0;
  uint64_t hash = 1469598103934665603ull;
  char name[64];
  size_t text_length = 0;
  char* text;

  parse(argc, argv, &o);
  n.batch = o.batch;
  n.width = o.width;
  n.ffn = o.ffn;
  act = (size_t)o.batch * (size_t)o.width;
  hid = (size_t)o.batch * (size_t)o.ffn;
  par = (size_t)o.width * (size_t)o.ffn;
  /* The step's arithmetic. A checkpoint is a block's input, batch x width fp32. What one
   * block's backward pass recomputes and holds beyond its checkpoint and the grads of its input
   * and output: relu(x w1) and its grad, batch x ffn each. A streaming slot holds one block's
   * weights and grads, and its checkpoint when spilled, each rounded up as the executor's planner
   * lays them out (weights to DRAM pages, slot entries to 256 bytes): an upper bound of the slot
   * strata_plan_create will find. */
  checkpoint_bytes = act * 4;
  saved_bytes = 2 * hid * 4;
  slot_bytes =
      2 * align_up(par * 4, 4096) + 2 * align_up(par * 4, 256) + align_up(checkpoint_bytes, 256);

  printf(
      "strata-mlp-trainer: %d residual MLP blocks (%d -> %d -> %d, relu), batch %d, fp32, "
      "%d steps of AdamW (lr %g), seed %llu\n",
      o.blocks, o.width, o.ffn, o.width, o.batch, o.steps, (double)o.lr,
      (unsigned long long)o.seed);

  /* The runtime: the host backend, whose HBM tier is all the device memory this program has;
   * DRAM for every block's weights, grads, AdamW moments (8 weight-sized tensors) and spilled
   * checkpoint, twice that for the arena's rounding, and 16 MiB to spare. */
  CHECK(strata_runtime_config_init(&config));
  config.device_backend = STRATA_DEVICE_BACKEND_HOST;
  config.hbm_budget_bytes = o.hbm_bytes;
  config.dram_budget_bytes =
      align_up((uint64_t)o.blocks * (8 * par * 4 + checkpoint_bytes) * 2, 1u << 20) + (16u << 20);
  memset(&t, 0, sizeof t);
  t.n = n;
  t.count = o.blocks;
  CHECK(strata_runtime_create(&config, &t.rt));

  /* The program's own device memory, registered in the HBM tier. */
  t.x_t = make_tensor(t.rt, "batch.x", o.batch, o.width, STRATA_ROLE_OTHER, STRATA_TIER_HBM);
  t.target_t =
      make_tensor(t.rt, "batch.target", o.batch, o.width, STRATA_ROLE_OTHER, STRATA_TIER_HBM);
  for (i = 0; i < 2; ++i) {
    snprintf(name, sizeof name, "activations.%d", i);
    t.buf_t[i] = make_tensor(t.rt, name, o.batch, o.width, STRATA_ROLE_ACTIVATION, STRATA_TIER_HBM);
  }
  t.a_t = make_tensor(t.rt, "relu", o.batch, o.ffn, STRATA_ROLE_ACTIVATION, STRATA_TIER_HBM);
  t.da_t = make_tensor(t.rt, "relu.grad", o.batch, o.ffn, STRATA_ROLE_ACTIVATION, STRATA_TIER_HBM);
  held_bytes = 4 * checkpoint_bytes + 2 * hid * 4;
  free_bytes = hbm_free(t.rt);
  if (free_bytes < 2 * slot_bytes) fail("the HBM budget cannot hold the executor's two slots");
  printf(
      "device: Strata's HBM tier (host backend), %llu bytes: this program holds %llu (batch, "
      "target, 2 activations, relu and its grad), the executor's 2 slots will take up to "
      "%llu, %llu left\n",
      (unsigned long long)o.hbm_bytes, (unsigned long long)held_bytes,
      (unsigned long long)(2 * slot_bytes), (unsigned long long)(free_bytes - 2 * slot_bytes));
  printf("checkpoints: %llu bytes each (batch %d x width %d x 4), %llu for all %d blocks\n",
         (unsigned long long)checkpoint_bytes, o.batch, o.width,
         (unsigned long long)(checkpoint_bytes * (uint64_t)o.blocks), o.blocks);

  /* The step profile, from that arithmetic. Every block is streamed and recomputes its forward
   * pass from its checkpoint. The device is the HBM tier: what the slots will take is not free.
   * The framework is this program: it holds its buffers, of which the batch and its target are
   * in use as the forward pass begins. Tokens: the batch's rows. */
  plan_blocks = xcalloc((size_t)o.blocks, sizeof *plan_blocks);
  plan_block_ptrs = xcalloc((size_t)o.blocks, sizeof *plan_block_ptrs);
  for (i = 0; i < o.blocks; ++i) {
    CHECK(strata_step_block_init(&plan_blocks[i]));
    plan_blocks[i].elements = 2 * par;
    plan_blocks[i].residency = STRATA_RESIDENCY_STREAMED;
    plan_blocks[i].keep = STRATA_KEEP_RECOMPUTE;
    plan_block_ptrs[i] = &plan_blocks[i];
  }
  CHECK(strata_step_profile_init(&profile));
  profile.blocks = plan_block_ptrs;
  profile.block_count = (uint32_t)o.blocks;
  profile.device_total_bytes = o.hbm_bytes;
  profile.device_free_bytes = free_bytes - 2 * slot_bytes;
  profile.framework_held_bytes = held_bytes;
  /* Checkpoint homes are the decision asked for; the saved bytes are this program's own. */
  profile.flags = STRATA_STEP_PLAN_CHECKPOINTS | STRATA_STEP_BLOCK_SAVED_MEASURED;
  profile.tokens = (uint64_t)o.batch;
  profile.checkpoint_bytes = checkpoint_bytes;
  profile.block_saved_bytes = saved_bytes;
  profile.in_use_bytes = 2 * checkpoint_bytes;
  /* No host figures: the plan's host budget counts spilled checkpoints beside the DRAM arena
   * (strata.torch's pinned pool); here they are tensors in the arena, sized above. */
  CHECK(strata_step_plan_create(&profile, &step_plan));
  CHECK(strata_step_plan_dump(step_plan, STRATA_PLAN_FORMAT_TEXT, NULL, 0, &text_length));
  text = xcalloc(text_length + 1, 1);
  CHECK(strata_step_plan_dump(step_plan, STRATA_PLAN_FORMAT_TEXT, text, text_length + 1, NULL));
  printf("%s", text);
  free(text);
  memset(&step_info, 0, sizeof step_info);
  step_info.struct_size = STRATA_STEP_PLAN_INFO_STRUCT_SIZE;
  CHECK(strata_step_plan_get_info(step_plan, &step_info));
  if (!(step_info.planned & STRATA_STEP_PLANNED_CHECKPOINTS)) {
    fail("the step plan did not plan the checkpoints");
  }
  if (!step_info.fits) {
    fail(
        "the step plan predicts the step short of device memory even with every checkpoint "
        "in DRAM: raise --hbm-kib or lower --batch");
  }

  /* Execute the plan: each block's checkpoint where it says (all on the device with
   * --no-spill). A spilled block's checkpoint is a DRAM activation tensor of its layer, which
   * the executor parks in DRAM and restores; the others' are HBM buffers. */
  t.blocks = xcalloc((size_t)o.blocks, sizeof *t.blocks);
  for (i = 0; i < o.blocks; ++i) {
    strata_step_block_t b;
    memset(&b, 0, sizeof b);
    b.struct_size = STRATA_STEP_BLOCK_STRUCT_SIZE;
    CHECK(strata_step_plan_get_block(step_plan, (uint32_t)i, &b));
    t.blocks[i].spilled = b.checkpoint_tier == STRATA_TIER_DRAM && !o.no_spill;
    spilled += t.blocks[i].spilled;
  }
  printf(
      "executing the plan: %d of %d checkpoints to DRAM (the executor's activation views), "
      "%d on the device (HBM buffers)%s\n",
      spilled, o.blocks, o.blocks - spilled, o.no_spill ? " (--no-spill: none spilled)" : "");
  if (o.no_spill) {
    printf(
        "--no-spill: %llu bytes of checkpoints on the device, %llu bytes free there before "
        "the slots\n",
        (unsigned long long)(checkpoint_bytes * (uint64_t)o.blocks),
        (unsigned long long)hbm_free(t.rt));
    fflush(stdout);
  }
  for (i = 0; i < o.blocks; ++i) {
    if (t.blocks[i].spilled) continue;
    snprintf(name, sizeof name, "blocks.%d.checkpoint", i);
    t.blocks[i].checkpoint =
        make_tensor(t.rt, name, o.batch, o.width, STRATA_ROLE_ACTIVATION, STRATA_TIER_HBM);
    t.blocks[i].kept = device_floats(t.rt, t.blocks[i].checkpoint);
  }

  /* The layer graph: per block its two weights (registered back to back, so they travel as one
   * copy), their grads, and a spilled block's checkpoint. */
  CHECK(strata_graph_create(t.rt, &graph));
  for (i = 0; i < o.blocks; ++i) {
    block_t* b = &t.blocks[i];
    strata_tensor_t* weights[2];
    strata_tensor_t* grads[2];
    strata_layer_desc_t d;
    snprintf(name, sizeof name, "blocks.%d.w1", i);
    b->w1 = make_tensor(t.rt, name, o.width, o.ffn, STRATA_ROLE_WEIGHT, STRATA_TIER_DRAM);
    snprintf(name, sizeof name, "blocks.%d.w2", i);
    b->w2 = make_tensor(t.rt, name, o.ffn, o.width, STRATA_ROLE_WEIGHT, STRATA_TIER_DRAM);
    snprintf(name, sizeof name, "blocks.%d.w1.grad", i);
    b->g1 = make_tensor(t.rt, name, o.width, o.ffn, STRATA_ROLE_GRAD, STRATA_TIER_DRAM);
    snprintf(name, sizeof name, "blocks.%d.w2.grad", i);
    b->g2 = make_tensor(t.rt, name, o.ffn, o.width, STRATA_ROLE_GRAD, STRATA_TIER_DRAM);
    if (b->spilled) {
      snprintf(name, sizeof name, "blocks.%d.checkpoint", i);
      b->checkpoint =
          make_tensor(t.rt, name, o.batch, o.width, STRATA_ROLE_ACTIVATION, STRATA_TIER_DRAM);
    }
    weights[0] = b->w1;
    weights[1] = b->w2;
    grads[0] = b->g1;
    grads[1] = b->g2;
    memset(&d, 0, sizeof d);
    d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    snprintf(name, sizeof name, "blocks.%d", i);
    d.name = name;
    d.weights = weights;
    d.weight_count = 2;
    d.grads = grads;
    d.grad_count = 2;
    d.activations = b->spilled ? &b->checkpoint : NULL;
    d.activation_count = b->spilled ? 1 : 0;
    CHECK(strata_graph_add_layer(graph, &d, NULL));
  }
  CHECK(strata_plan_config_init(&pc));
  pc.hbm_slot_budget_bytes = 2 * slot_bytes;
  pc.h2d_bytes_per_second = 10e9; /* given, not measured: the host backend's copies are memcpy */
  pc.d2h_bytes_per_second = 10e9;
  CHECK(strata_plan_create(graph, &pc, &plan));
  memset(&plan_info, 0, sizeof plan_info);
  plan_info.struct_size = STRATA_PLAN_INFO_STRUCT_SIZE;
  CHECK(strata_plan_get_info(plan, &plan_info));
  CHECK(strata_executor_create(plan, &t.ex));
  /* Nothing more is allocated on the device: what the tier holds now is the step's peak. */
  printf(
      "executor: %u slots of %llu bytes; the step holds %llu of the HBM tier's %llu bytes "
      "(the plan's margin: %llu)\n",
      plan_info.slots, (unsigned long long)plan_info.slot_bytes,
      (unsigned long long)(o.hbm_bytes - hbm_free(t.rt)), (unsigned long long)o.hbm_bytes,
      (unsigned long long)step_info.margin_bytes);
  t.x = device_floats(t.rt, t.x_t);
  t.target = device_floats(t.rt, t.target_t);
  t.buf[0] = device_floats(t.rt, t.buf_t[0]);
  t.buf[1] = device_floats(t.rt, t.buf_t[1]);
  t.a = device_floats(t.rt, t.a_t);
  t.da = device_floats(t.rt, t.da_t);

  /* Deterministic weights: a teacher, and the model's (w1 of variance 1 / width, w2 small, so
   * every block starts near the identity), written to Strata's and the reference's. */
  reference_init(&ref, n, o.blocks);
  state = o.seed;
  teacher.t1 = xcalloc(par, sizeof(float));
  teacher.t2 = xcalloc(par, sizeof(float));
  teacher.scratch = xcalloc(hid, sizeof(float));
  fill_uniform(&state, teacher.t1, par, 1.7320508f / sqrtf((float)o.width));
  fill_uniform(&state, teacher.t2, par, 1.7320508f / sqrtf((float)o.ffn));
  for (i = 0; i < o.blocks; ++i) {
    fill_uniform(&state, ref.w1[i], par, 1.7320508f / sqrtf((float)o.width));
    fill_uniform(&state, ref.w2[i], par, 0.1f / sqrtf((float)o.ffn));
    CHECK(strata_tensor_write(t.rt, t.blocks[i].w1, 0, ref.w1[i], par * sizeof(float)));
    CHECK(strata_tensor_write(t.rt, t.blocks[i].w2, 0, ref.w2[i], par * sizeof(float)));
  }

  /* AdamW over every weight, attached: each block's update runs as its grads land. */
  CHECK(strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &oc));
  oc.lr = o.lr;
  oc.weight_decay = 0.01f;
  CHECK(strata_optimizer_create(t.rt, &oc, &opt));
  for (i = 0; i < o.blocks; ++i) {
    strata_param_desc_t p;
    memset(&p, 0, sizeof p);
    p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
    p.weight = t.blocks[i].w1;
    p.grad = t.blocks[i].g1;
    CHECK(strata_optimizer_add_param(opt, &p));
    p.weight = t.blocks[i].w2;
    p.grad = t.blocks[i].g2;
    CHECK(strata_optimizer_add_param(opt, &p));
  }
  CHECK(strata_optimizer_attach(opt, t.ex));
  hyper.lr = oc.lr;
  hyper.weight_decay = oc.weight_decay;
  hyper.beta1 = oc.beta1;
  hyper.beta2 = oc.beta2;
  hyper.eps = oc.eps;
  memset(&ostats, 0, sizeof ostats);
  ostats.struct_size = STRATA_OPTIMIZER_STATS_STRUCT_SIZE;
  CHECK(strata_optimizer_get_stats(opt, &ostats));
  generic = strcmp(ostats.isa, "generic") == 0;
  printf("optimizer: AdamW, %s kernel: the reference must match %s\n", ostats.isa,
         generic ? "bit for bit" : "within 1e-5 (that kernel contracts into FMAs)");

  host_x = xcalloc(act, sizeof(float));
  host_target = xcalloc(act, sizeof(float));
  for (step = 1; step <= o.steps; ++step) {
    double loss, ref_loss;
    make_batch(n, o.seed, step, &teacher, host_x, host_target);
    loss = trainer_step(&t, host_x, host_target);
    ref_loss = reference_step(&ref, &hyper, (uint64_t)step, host_x, host_target);
    if (step == 1) first_loss = loss;
    last_loss = loss;
    if (loss != ref_loss) {
      ++loss_mismatches;
      if (fabs(loss - ref_loss) / ref_loss > worst_loss)
        worst_loss = fabs(loss - ref_loss) / ref_loss;
    }
    printf("step %3d  loss %.6f  reference %.6f%s\n", step, loss, ref_loss,
           loss == ref_loss ? "  (same bits)" : "");
  }

  /* The trained weights, read back through the runtime once the last updates are done. */
  CHECK(strata_optimizer_synchronize(opt));
  w = xcalloc(par, sizeof(float));
  for (i = 0; i < 2 * o.blocks; ++i) {
    const block_t* b = &t.blocks[i / 2];
    const float* expected = i % 2 == 0 ? ref.w1[i / 2] : ref.w2[i / 2];
    size_t j;
    CHECK(strata_tensor_read(t.rt, i % 2 == 0 ? b->w1 : b->w2, 0, w, par * sizeof(float)));
    hash = fnv1a(hash, w, par);
    for (j = 0; j < par; ++j) {
      const double diff = fabs((double)w[j] - (double)expected[j]);
      weight_mismatches += float_bits(w[j]) != float_bits(expected[j]);
      if (diff > worst_weight) worst_weight = diff;
    }
  }
  CHECK(strata_optimizer_get_stats(opt, &ostats));
  printf("trained: loss %.6f -> %.6f over %d steps (%llu AdamW updates)\n", first_loss, last_loss,
         o.steps, (unsigned long long)ostats.step);
  printf("spilled %d of %d checkpoints to DRAM\n", spilled, o.blocks);
  printf("final loss %.9g bits 0x%08x weights fnv1a 0x%016llx\n", last_loss,
         float_bits((float)last_loss), (unsigned long long)hash);

  CHECK(strata_optimizer_destroy(opt));
  CHECK(strata_executor_destroy(t.ex));
  CHECK(strata_plan_destroy(plan));
  CHECK(strata_graph_destroy(graph));
  CHECK(strata_step_plan_destroy(step_plan));
  CHECK(strata_runtime_destroy(t.rt));
  reference_free(&ref);
  free(teacher.t1);
  free(teacher.t2);
  free(teacher.scratch);
  free(t.blocks);
  free(plan_blocks);
  free(plan_block_ptrs);
  free(host_x);
  free(host_target);
  free(w);

  if (!(last_loss < first_loss)) fail("the loss did not fall");
  if (generic && (loss_mismatches != 0 || weight_mismatches != 0)) {
    fprintf(stderr,
            "strata-mlp-trainer: not bit for bit: %d step losses differ from the reference (by "
            "up to %g, relative), %llu weights (by up to %g)\n",
            loss_mismatches, worst_loss, (unsigned long long)weight_mismatches, worst_weight);
    return 1;
  }
  if (!generic && (worst_loss > 1e-5 || worst_weight > 1e-5)) {
    fprintf(stderr,
            "strata-mlp-trainer: the reference differs: losses by up to %g (relative), "
            "weights by up to %g\n",
            worst_loss, worst_weight);
    return 1;
  }
  if (loss_mismatches == 0 && weight_mismatches == 0) {
    printf("reference: every loss and weight equal bit for bit\n");
  } else {
    printf("reference: losses within %.2g (relative), weights within %.2g\n", worst_loss,
           worst_weight);
  }
  return 0;
}
