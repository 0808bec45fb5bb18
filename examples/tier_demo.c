/* strata-demo: the README's main job until the training example exists.
 *
 * Registers the weights of a Llama-style model (bf16, one tensor per projection) in the DRAM
 * tier, then streams them through HBM the way a training step does: each layer is moved in
 * (prefetching `depth` layers ahead) and out again, forward then backward, for a few steps. It
 * verifies a checksum of every tensor at the end and prints the bytes and GB/s of each link.
 *
 * Usage: strata-demo [--backend auto|cuda|host] [--layers N] [--hidden H] [--steps S]
 *                    [--depth D] */
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

static long arg_long(int argc, char** argv, const char* flag, long fallback) {
  int i;
  for (i = 1; i + 1 < argc; ++i) {
    if (strcmp(argv[i], flag) == 0) return strtol(argv[i + 1], NULL, 10);
  }
  return fallback;
}

static const char* arg_str(int argc, char** argv, const char* flag, const char* fallback) {
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

/* Move every tensor of a layer to `tier`; the events are collected so the caller can wait. */
static void move_layer(strata_runtime_t* rt, strata_tensor_t** layer, strata_tier_t tier,
                       strata_event_t** events) {
  int j;
  for (j = 0; j < kTensorsPerLayer; ++j)
    CHECK(strata_tensor_move(rt, layer[j], tier, NULL, &events[j]));
}

static void wait_layer(strata_event_t** events) {
  int j;
  for (j = 0; j < kTensorsPerLayer; ++j) {
    CHECK(strata_event_wait(events[j], -1));
    CHECK(strata_event_destroy(events[j]));
    events[j] = NULL;
  }
}

/* One pass over the layers in `order`: layer i+depth is prefetched while layer i "computes". */
static void stream_pass(strata_runtime_t* rt, strata_tensor_t** tensors, const int* order, int n,
                        int depth, strata_event_t** in_events, strata_event_t** out_events) {
  int i;
  for (i = 0; i < depth && i < n; ++i) {
    move_layer(rt, &tensors[order[i] * kTensorsPerLayer], STRATA_TIER_HBM,
               &in_events[i * kTensorsPerLayer]);
  }
  for (i = 0; i < n; ++i) {
    const int slot = i % depth;
    wait_layer(&in_events[slot * kTensorsPerLayer]); /* layer order[i] is resident: compute */
    move_layer(rt, &tensors[order[i] * kTensorsPerLayer], STRATA_TIER_DRAM, &out_events[0]);
    wait_layer(&out_events[0]); /* its slot is free again */
    if (i + depth < n) {
      move_layer(rt, &tensors[order[i + depth] * kTensorsPerLayer], STRATA_TIER_HBM,
                 &in_events[slot * kTensorsPerLayer]);
    }
  }
}

int main(int argc, char** argv) {
  const char* backend_name = arg_str(argc, argv, "--backend", "auto");
  const int layers = (int)arg_long(argc, argv, "--layers", 12);
  const int64_t hidden = arg_long(argc, argv, "--hidden", 768);
  const int steps = (int)arg_long(argc, argv, "--steps", 3);
  const int depth = (int)arg_long(argc, argv, "--depth", 2);
  const int64_t mlp = hidden * 8 / 3 / 64 * 64 + 64;
  strata_runtime_config_t config;
  strata_runtime_t* rt = NULL;
  strata_capabilities_t caps;
  strata_tensor_t** tensors;
  uint64_t* sums;
  uint64_t layer_bytes = 0, model_bytes, max_bytes = 0;
  strata_event_t **in_events, *out_events[kTensorsPerLayer];
  int *forward, *backward, i, j, step, link;
  unsigned char* buf;
  double start, elapsed;

  if (layers < 1 || hidden < 64 || steps < 1 || depth < 1) {
    fprintf(stderr, "strata-demo: --layers >= 1, --hidden >= 64, --steps >= 1, --depth >= 1\n");
    return 2;
  }
  CHECK(strata_runtime_config_init(&config));
  if (strcmp(backend_name, "cuda") == 0) {
    config.device_backend = STRATA_DEVICE_BACKEND_CUDA;
  } else if (strcmp(backend_name, "host") == 0) {
    config.device_backend = STRATA_DEVICE_BACKEND_HOST;
  } else if (strcmp(backend_name, "auto") != 0) {
    fprintf(stderr, "strata-demo: --backend must be auto, cuda or host, not '%s'\n", backend_name);
    return 2;
  }
  {
    const int64_t shapes[kTensorsPerLayer][2] = {
        {hidden, hidden}, {hidden, hidden}, {hidden, hidden}, {hidden, hidden},
        {mlp, hidden},    {mlp, hidden},    {hidden, mlp}};
    for (j = 0; j < kTensorsPerLayer; ++j) {
      const uint64_t b = (uint64_t)(shapes[j][0] * shapes[j][1]) * 2;
      layer_bytes += (b + 255) / 256 * 256;
      if (b > max_bytes) max_bytes = b;
    }
    model_bytes = layer_bytes * (uint64_t)layers;
    /* DRAM holds the model; HBM holds `depth` prefetched layers plus the one being evicted. */
    config.dram_budget_bytes = model_bytes + (64u << 20);
    config.hbm_budget_bytes = layer_bytes * (uint64_t)(depth + 1) + (16u << 20);
    CHECK(strata_runtime_create(&config, &rt));

    tensors = calloc((size_t)layers * kTensorsPerLayer, sizeof *tensors);
    sums = calloc((size_t)layers * kTensorsPerLayer, sizeof *sums);
    buf = malloc(max_bytes);
    if (tensors == NULL || sums == NULL || buf == NULL) {
      fprintf(stderr, "strata-demo: out of host memory\n");
      return 1;
    }
    for (i = 0; i < layers; ++i) {
      for (j = 0; j < kTensorsPerLayer; ++j) {
        char name[96];
        strata_tensor_desc_t d;
        strata_tensor_t* t = NULL;
        const uint64_t nbytes = (uint64_t)(shapes[j][0] * shapes[j][1]) * 2;
        uint64_t k;
        snprintf(name, sizeof name, "model.layers.%d.%s.weight", i, kProjections[j]);
        memset(&d, 0, sizeof d);
        d.struct_size = STRATA_TENSOR_DESC_STRUCT_SIZE;
        d.name = name;
        d.dtype = STRATA_DTYPE_BF16;
        d.ndim = 2;
        d.shape = shapes[j];
        d.role = STRATA_ROLE_WEIGHT;
        d.home_tier = STRATA_TIER_DRAM;
        CHECK(strata_tensor_register(rt, &d, &t));
        for (k = 0; k < nbytes; ++k)
          buf[k] = (unsigned char)(k * 31 + (uint64_t)i * 7 + (uint64_t)j);
        CHECK(strata_tensor_write(rt, t, 0, buf, nbytes));
        tensors[i * kTensorsPerLayer + j] = t;
        sums[i * kTensorsPerLayer + j] = checksum(rt, t, nbytes, buf);
      }
    }
  }
  memset(&caps, 0, sizeof caps);
  caps.struct_size = STRATA_CAPABILITIES_STRUCT_SIZE;
  CHECK(strata_runtime_capabilities(rt, &caps));
  printf("strata %s | backend %s | device %s | GPU NUMA node %d\n", strata_version_string(),
         strata_device_backend_name(caps.device_backend), caps.device_name, caps.device_numa_node);
  printf("  (%s)\n", caps.backend_reason);
  printf("model: %d layers x %d bf16 tensors, hidden %lld, mlp %lld: %.1f MB of weights in DRAM\n",
         layers, kTensorsPerLayer, (long long)hidden, (long long)mlp, (double)model_bytes / 1e6);
  printf("streaming %d step(s), forward then backward, prefetch depth %d, HBM budget %.1f MB\n",
         steps, depth, (double)config.hbm_budget_bytes / 1e6);

  forward = malloc(sizeof(int) * (size_t)layers);
  backward = malloc(sizeof(int) * (size_t)layers);
  in_events = calloc((size_t)depth * kTensorsPerLayer, sizeof *in_events);
  if (forward == NULL || backward == NULL || in_events == NULL) return 1;
  for (i = 0; i < layers; ++i) {
    forward[i] = i;
    backward[i] = layers - 1 - i;
  }
  CHECK(strata_runtime_reset_stats(rt));
  start = now_seconds();
  for (step = 0; step < steps; ++step) {
    stream_pass(rt, tensors, forward, layers, depth, in_events, out_events);
    stream_pass(rt, tensors, backward, layers, depth, in_events, out_events);
    printf("  step %d/%d done\n", step + 1, steps);
    fflush(stdout);
  }
  elapsed = now_seconds() - start;

  for (i = 0; i < layers * kTensorsPerLayer; ++i) {
    strata_tensor_info_t info;
    memset(&info, 0, sizeof info);
    info.struct_size = STRATA_TENSOR_INFO_STRUCT_SIZE;
    CHECK(strata_tensor_get_info(rt, tensors[i], &info));
    if (info.tier != STRATA_TIER_DRAM || checksum(rt, tensors[i], info.nbytes, buf) != sums[i]) {
      fprintf(stderr, "strata-demo: tensor %s came back changed\n", info.name);
      return 1;
    }
  }
  printf("all %d tensors verified after streaming\n", layers * kTensorsPerLayer);
  printf("%-6s %12s %10s %12s %14s\n", "link", "bytes", "transfers", "busy (s)", "GB/s (busy)");
  for (link = STRATA_LINK_H2D; link <= STRATA_LINK_D2H; ++link) {
    strata_link_stats_t s;
    memset(&s, 0, sizeof s);
    s.struct_size = STRATA_LINK_STATS_STRUCT_SIZE;
    CHECK(strata_runtime_link_stats(rt, link, &s));
    printf("%-6s %12llu %10llu %12.4f %14.2f\n", strata_link_name(link),
           (unsigned long long)s.bytes, (unsigned long long)s.transfers, (double)s.busy_ns * 1e-9,
           s.busy_ns > 0 ? (double)s.bytes / (double)s.busy_ns : 0.0);
  }
  printf("wall time %.3f s for %.1f GB moved (%.2f GB/s over both links)\n", elapsed,
         2.0 * 2.0 * (double)steps * (double)model_bytes / 1e9,
         4.0 * (double)steps * (double)model_bytes / 1e9 / elapsed);

  CHECK(strata_runtime_destroy(rt));
  free(tensors);
  free(sums);
  free(buf);
  free(forward);
  free(backward);
  free(in_events);
  return 0;
}
