/* strata-demo: the README's main job until the training example exists.
 *
 * Declares a Llama-style model to Strata (bf16 weights and grads, one tensor per projection,
 * all in DRAM; with --nvme, every other layer's weights on NVMe), plans it against an HBM
 * budget of a few layers, prints the plan, and runs training steps the way a framework does:
 * acquire each layer forward, then backward, release it, while the executor streams weights
 * in and grads out. It checks every weight is intact afterwards, and prints the bytes and GB/s
 * of each link and what the executor did.
 *
 * Usage: strata-demo [--backend auto|cuda|host] [--layers N] [--hidden H] [--steps S]
 *                    [--slots K] [--nvme PATH] [--trace FILE] */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "strata/strata.h"

#define CHECK(call)                                                                        \
  do {                                                                                     \
    strata_status_t s_ = (call);                                                           \
    if (s_ != STRATA_OK) {                                                                 \
      fprintf(stderr, "strata-demo: %s failed: %s: %s\n", #call, strata_status_string(s_), \
              strata_last_error_message());                                                \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

enum { kTensorsPerLayer = 7 };
static const char* const kProjections[kTensorsPerLayer] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char* arg(int argc, char** argv, const char* flag, const char* fallback) {
  int i;
  for (i = 1; i + 1 < argc; ++i) {
    if (strcmp(argv[i], flag) == 0) return argv[i + 1];
  }
  return fallback;
}

/* A cheap, order-sensitive checksum of a tensor's bytes as read back through the runtime. */
static uint64_t checksum(strata_runtime_t* rt, strata_tensor_t* t, uint64_t nbytes,
                         unsigned char* buf) {
  uint64_t h = 1469598103934665603ull, i;
  CHECK(strata_tensor_read(rt, t, 0, buf, nbytes));
  for (i = 0; i < nbytes; i += 8) h = (h ^ buf[i]) * 1099511628211ull;
  return h;
}

static strata_tensor_t* make(strata_runtime_t* rt, const char* name, const int64_t* shape,
                             strata_role_t role, strata_tier_t home) {
  strata_tensor_desc_t d;
  strata_tensor_t* t = NULL;
  memset(&d, 0, sizeof d);
  d.struct_size = STRATA_TENSOR_DESC_STRUCT_SIZE;
  d.name = name;
  d.dtype = STRATA_DTYPE_BF16;
  d.ndim = 2;
  d.shape = shape;
  d.role = role;
  d.home_tier = home;
  CHECK(strata_tensor_register(rt, &d, &t));
  return t;
}

/* DRAM and NVMe budgets for the model from what its tensors take of each tier, by the runtime's
 * own rules (strata_layout_query: each tensor's 4 KiB arena block and a page): every layer's
 * bf16 grads in DRAM, its weights too, or on NVMe for the odd layers with --nvme; and 256 MiB
 * of DRAM beyond them for headroom. */
static void layout_budgets(int layers, int64_t shapes[kTensorsPerLayer][2], int with_nvme,
                           uint64_t* dram, uint64_t* nvme) {
  strata_layout_request_t q;
  strata_layout_totals_t totals;
  strata_layout_layer_t* per_layer = calloc((size_t)layers, sizeof *per_layer);
  uint32_t* counts = calloc((size_t)layers, sizeof *counts);
  uint64_t* elements = calloc((size_t)layers * kTensorsPerLayer, sizeof *elements);
  int i, j;
  if (per_layer == NULL || counts == NULL || elements == NULL) exit(1);
  for (i = 0; i < layers; ++i) {
    counts[i] = kTensorsPerLayer;
    per_layer[i].struct_size = STRATA_LAYOUT_LAYER_STRUCT_SIZE;
    for (j = 0; j < kTensorsPerLayer; ++j)
      elements[i * kTensorsPerLayer + j] = (uint64_t)(shapes[j][0] * shapes[j][1]);
  }
  CHECK(strata_layout_request_init(&q));
  q.dtype = STRATA_DTYPE_BF16;
  q.layer_count = (uint32_t)layers;
  q.trainable_counts = counts; /* every weight has a grad */
  q.trainable_elements = elements;
  memset(&totals, 0, sizeof totals);
  totals.struct_size = STRATA_LAYOUT_TOTALS_STRUCT_SIZE;
  CHECK(strata_layout_query(&q, per_layer, &totals));
  *dram = totals.grad_dram_bytes + (256u << 20);
  *nvme = 0;
  for (i = 0; i < layers; ++i) {
    if (with_nvme && i % 2 == 1) {
      *nvme += per_layer[i].weight_bytes;
    } else {
      *dram += per_layer[i].weight_bytes;
    }
  }
  free(elements);
  free(counts);
  free(per_layer);
}

int main(int argc, char** argv) {
  const char* backend = arg(argc, argv, "--backend", "auto");
  const int layers = atoi(arg(argc, argv, "--layers", "12"));
  const int64_t hidden = atoll(arg(argc, argv, "--hidden", "768"));
  const int steps = atoi(arg(argc, argv, "--steps", "3"));
  const int slots = atoi(arg(argc, argv, "--slots", "4"));
  const char* nvme = arg(argc, argv, "--nvme", NULL);
  const char* trace = arg(argc, argv, "--trace", NULL);
  const int64_t mlp = hidden * 8 / 3 / 64 * 64 + 64;
  int64_t shapes[kTensorsPerLayer][2];
  strata_runtime_config_t config;
  strata_runtime_t* rt = NULL;
  strata_capabilities_t caps;
  strata_graph_t* graph = NULL;
  strata_plan_t* plan = NULL;
  strata_executor_t* ex = NULL;
  strata_plan_config_t pc;
  strata_plan_info_t info;
  strata_executor_stats_t st;
  strata_tensor_t **weights, **grads;
  uint64_t *sums, layer_bytes = 0, max_bytes = 0, model_bytes;
  unsigned char* buf;
  size_t text_length = 0;
  char* text;
  double start, elapsed;
  int i, j, step, pass, link;

  if (layers < 1 || hidden < 64 || steps < 1 || slots < 2) {
    fprintf(stderr, "strata-demo: --layers >= 1, --hidden >= 64, --steps >= 1, --slots >= 2\n");
    return 2;
  }
  for (j = 0; j < kTensorsPerLayer; ++j) {
    shapes[j][0] = j == 6 ? hidden : (j >= 4 ? mlp : hidden);
    shapes[j][1] = j == 6 ? mlp : hidden;
    layer_bytes += (uint64_t)(shapes[j][0] * shapes[j][1]) * 2;
    if ((uint64_t)(shapes[j][0] * shapes[j][1]) * 2 > max_bytes)
      max_bytes = (uint64_t)(shapes[j][0] * shapes[j][1]) * 2;
  }
  model_bytes = layer_bytes * (uint64_t)layers;

  CHECK(strata_runtime_config_init(&config));
  if (strcmp(backend, "cuda") == 0) {
    config.device_backend = STRATA_DEVICE_BACKEND_CUDA;
  } else if (strcmp(backend, "host") == 0) {
    config.device_backend = STRATA_DEVICE_BACKEND_HOST;
  } else if (strcmp(backend, "auto") != 0) {
    fprintf(stderr, "strata-demo: --backend must be auto, cuda or host, not '%s'\n", backend);
    return 2;
  }
  /* DRAM holds grads and weights (the odd layers' weights on NVMe with --nvme); HBM holds
   * `slots` layers (weights + grad buffers). */
  layout_budgets(layers, shapes, nvme != NULL, &config.dram_budget_bytes,
                 &config.nvme_budget_bytes);
  config.hbm_budget_bytes = 2 * layer_bytes * (uint64_t)slots + (128u << 20);
  if (nvme != NULL) {
    config.nvme_paths = &nvme;
    config.nvme_path_count = 1;
    config.nvme_checksums = 1;
  }
  CHECK(strata_runtime_create(&config, &rt));
  memset(&caps, 0, sizeof caps);
  caps.struct_size = STRATA_CAPABILITIES_STRUCT_SIZE;
  CHECK(strata_runtime_capabilities(rt, &caps));
  printf("strata %s | backend %s | device %s | GPU NUMA node %d\n", strata_version_string(),
         strata_device_backend_name(caps.device_backend), caps.device_name, caps.device_numa_node);
  printf("  (%s)\n  dram: %s, pinned %.0f MB in %.3f s", caps.backend_reason, caps.dram_placement,
         (double)config.dram_budget_bytes / 1e6, caps.dram_fault_seconds + caps.dram_pin_seconds);
  if (nvme != NULL) printf("; nvme: %s (%s)", nvme, caps.io_engine);
  printf("\n");

  weights = calloc((size_t)layers * kTensorsPerLayer, sizeof *weights);
  grads = calloc((size_t)layers * kTensorsPerLayer, sizeof *grads);
  sums = calloc((size_t)layers * kTensorsPerLayer, sizeof *sums);
  buf = malloc(max_bytes);
  if (weights == NULL || grads == NULL || sums == NULL || buf == NULL) return 1;
  CHECK(strata_graph_create(rt, &graph));
  for (i = 0; i < layers; ++i) {
    strata_layer_desc_t d;
    char name[96];
    const strata_tier_t home = nvme != NULL && i % 2 == 1 ? STRATA_TIER_NVME : STRATA_TIER_DRAM;
    for (j = 0; j < kTensorsPerLayer; ++j) {
      const uint64_t nbytes = (uint64_t)(shapes[j][0] * shapes[j][1]) * 2;
      uint64_t k;
      snprintf(name, sizeof name, "model.layers.%d.%s.weight", i, kProjections[j]);
      weights[i * kTensorsPerLayer + j] = make(rt, name, shapes[j], STRATA_ROLE_WEIGHT, home);
      for (k = 0; k < nbytes; ++k) buf[k] = (unsigned char)(k * 31 + (uint64_t)i * 7 + (uint64_t)j);
      CHECK(strata_tensor_write(rt, weights[i * kTensorsPerLayer + j], 0, buf, nbytes));
      sums[i * kTensorsPerLayer + j] = checksum(rt, weights[i * kTensorsPerLayer + j], nbytes, buf);
    }
    for (j = 0; j < kTensorsPerLayer; ++j) {
      snprintf(name, sizeof name, "model.layers.%d.%s.weight.grad", i, kProjections[j]);
      grads[i * kTensorsPerLayer + j] =
          make(rt, name, shapes[j], STRATA_ROLE_GRAD, STRATA_TIER_DRAM);
    }
    memset(&d, 0, sizeof d);
    d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    snprintf(name, sizeof name, "model.layers.%d", i);
    d.name = name;
    d.weights = &weights[i * kTensorsPerLayer];
    d.weight_count = kTensorsPerLayer;
    d.grads = &grads[i * kTensorsPerLayer];
    d.grad_count = kTensorsPerLayer;
    CHECK(strata_graph_add_layer(graph, &d, NULL));
  }
  CHECK(strata_plan_config_init(&pc));
  pc.hbm_slot_budget_bytes =
      2 * layer_bytes * (uint64_t)slots + 4096u * 2 * kTensorsPerLayer * (uint64_t)slots;
  CHECK(strata_plan_create(graph, &pc, &plan));
  CHECK(strata_plan_dump(plan, STRATA_PLAN_FORMAT_TEXT, NULL, 0, &text_length));
  text = malloc(text_length + 1);
  if (text == NULL) return 1;
  CHECK(strata_plan_dump(plan, STRATA_PLAN_FORMAT_TEXT, text, text_length + 1, NULL));
  printf("%s", text);
  free(text);
  memset(&info, 0, sizeof info);
  info.struct_size = STRATA_PLAN_INFO_STRUCT_SIZE;
  CHECK(strata_plan_get_info(plan, &info));
  CHECK(strata_executor_create(plan, &ex));
  if (trace != NULL) CHECK(strata_trace_start(rt, NULL));

  CHECK(strata_runtime_reset_stats(rt));
  start = now_seconds();
  for (step = 0; step < steps; ++step) {
    CHECK(strata_step_begin(ex));
    for (pass = 0; pass < 2; ++pass) {
      for (i = 0; i < layers; ++i) {
        const uint32_t layer = (uint32_t)(pass == 0 ? i : layers - 1 - i);
        const strata_phase_t phase = pass == 0 ? STRATA_PHASE_FORWARD : STRATA_PHASE_BACKWARD;
        strata_layer_views_t views;
        memset(&views, 0, sizeof views);
        views.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
        CHECK(strata_layer_acquire(ex, layer, phase, NULL, STRATA_ACQUIRE_DEFAULT, &views));
        /* A framework computes here on views.weights (and fills views.grads backward). */
        CHECK(strata_layer_release(ex, layer, phase, NULL));
      }
    }
    CHECK(strata_step_end(ex));
    printf("  step %d/%d done\n", step + 1, steps);
    fflush(stdout);
  }
  elapsed = now_seconds() - start;
  if (trace != NULL) {
    CHECK(strata_trace_flush(rt, trace));
    printf("trace written to %s (tools/strata-prof %s)\n", trace, trace);
  }
  memset(&st, 0, sizeof st);
  st.struct_size = STRATA_EXECUTOR_STATS_STRUCT_SIZE;
  CHECK(strata_executor_get_stats(ex, &st));
  CHECK(strata_executor_destroy(ex));

  for (i = 0; i < layers * kTensorsPerLayer; ++i) {
    strata_tensor_info_t ti;
    memset(&ti, 0, sizeof ti);
    ti.struct_size = STRATA_TENSOR_INFO_STRUCT_SIZE;
    CHECK(strata_tensor_get_info(rt, weights[i], &ti));
    if (checksum(rt, weights[i], ti.nbytes, buf) != sums[i]) {
      fprintf(stderr, "strata-demo: weight %s came back changed\n", ti.name);
      return 1;
    }
  }
  printf("all %d weights verified after %d streamed steps (%.1f MB of weights, %.1f MB of grads)\n",
         layers * kTensorsPerLayer, steps, (double)model_bytes / 1e6, (double)model_bytes / 1e6);
  printf("executor: %llu layer loads, %llu reused from their slot, %.1f MB in, %.1f MB out\n",
         (unsigned long long)st.loads, (unsigned long long)st.reused_loads,
         (double)st.bytes_in / 1e6, (double)st.bytes_out / 1e6);
  printf("%-11s %14s %10s %10s %12s\n", "link", "bytes", "transfers", "busy (s)", "GB/s (busy)");
  for (link = 0; link < STRATA_LINK_COUNT; ++link) {
    strata_link_stats_t s;
    memset(&s, 0, sizeof s);
    s.struct_size = STRATA_LINK_STATS_STRUCT_SIZE;
    CHECK(strata_runtime_link_stats(rt, link, &s));
    printf("%-11s %14llu %10llu %10.4f %12.2f\n", strata_link_name(link),
           (unsigned long long)s.bytes, (unsigned long long)s.transfers, (double)s.busy_ns * 1e-9,
           s.busy_ns > 0 ? (double)s.bytes / (double)s.busy_ns : 0.0);
  }
  printf(
      "wall time %.3f s for %d steps (%.3f s per step; planner predicted %.3f s, bottleneck %s)\n",
      elapsed, steps, elapsed / steps, info.predicted_step_seconds, info.bottleneck);

  CHECK(strata_plan_destroy(plan));
  CHECK(strata_graph_destroy(graph));
  CHECK(strata_runtime_destroy(rt));
  free(weights);
  free(grads);
  free(sums);
  free(buf);
  return 0;
}
