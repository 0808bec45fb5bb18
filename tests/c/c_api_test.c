/* A C program using the C ABI end to end: create a runtime, register tensors, write, move
 * through the tiers, read back, export with DLPack, read the link counters, tear down.
 * Exits 0 on success, 1 with a message on the first failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata/strata.h"

#define CHECK(call)                                                       \
  do {                                                                    \
    strata_status_t s_ = (call);                                          \
    if (s_ != STRATA_OK) {                                                \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call, \
              strata_status_string(s_), strata_last_error_message());     \
      return 1;                                                           \
    }                                                                     \
  } while (0)

#define EXPECT(cond)                                                      \
  do {                                                                    \
    if (!(cond)) {                                                        \
      fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                           \
    }                                                                     \
  } while (0)

static int run(strata_runtime_t* rt) {
  const int64_t shape[2] = {256, 1024};
  strata_tensor_desc_t desc;
  strata_tensor_t* w = NULL;
  strata_tensor_t* found = NULL;
  strata_event_t* ev = NULL;
  strata_tier_t tier = -1;
  strata_link_stats_t h2d;
  strata_tensor_info_t info;
  DLManagedTensorVersioned* dl = NULL;
  float* src = NULL;
  float* dst = NULL;
  size_t i, n = 256 * 1024;

  memset(&desc, 0, sizeof desc);
  desc.struct_size = STRATA_TENSOR_DESC_STRUCT_SIZE;
  desc.name = "layers.0.mlp.weight";
  desc.dtype = STRATA_DTYPE_F32;
  desc.ndim = 2;
  desc.shape = shape;
  desc.role = STRATA_ROLE_WEIGHT;
  desc.home_tier = STRATA_TIER_DRAM;
  CHECK(strata_tensor_register(rt, &desc, &w));
  CHECK(strata_tensor_find(rt, "layers.0.mlp.weight", &found));
  EXPECT(found == w);

  src = malloc(n * sizeof *src);
  dst = malloc(n * sizeof *dst);
  EXPECT(src != NULL && dst != NULL);
  for (i = 0; i < n; ++i) src[i] = (float)i * 0.5f;
  CHECK(strata_tensor_write(rt, w, 0, src, n * sizeof *src));

  CHECK(strata_tensor_move(rt, w, STRATA_TIER_HBM, NULL, &ev));
  CHECK(strata_event_wait(ev, -1));
  CHECK(strata_event_destroy(ev));
  CHECK(strata_tensor_tier(rt, w, &tier));
  EXPECT(tier == STRATA_TIER_HBM);

  CHECK(strata_tensor_export_dlpack(rt, w, &dl));
  EXPECT(dl->dl_tensor.ndim == 2 && dl->dl_tensor.shape[1] == 1024);
  EXPECT(dl->dl_tensor.dtype.code == kDLFloat && dl->dl_tensor.dtype.bits == 32);
  dl->deleter(dl);

  CHECK(strata_tensor_move(rt, w, STRATA_TIER_DRAM, NULL, &ev));
  CHECK(strata_event_wait(ev, -1));
  CHECK(strata_event_destroy(ev));
  CHECK(strata_tensor_read(rt, w, 0, dst, n * sizeof *dst));
  EXPECT(memcmp(src, dst, n * sizeof *src) == 0);

  memset(&info, 0, sizeof info);
  info.struct_size = STRATA_TENSOR_INFO_STRUCT_SIZE;
  CHECK(strata_tensor_get_info(rt, w, &info));
  EXPECT(info.nbytes == n * sizeof(float));
  EXPECT(strcmp(info.name, "layers.0.mlp.weight") == 0);

  memset(&h2d, 0, sizeof h2d);
  h2d.struct_size = STRATA_LINK_STATS_STRUCT_SIZE;
  CHECK(strata_runtime_link_stats(rt, STRATA_LINK_H2D, &h2d));
  EXPECT(h2d.bytes == n * sizeof(float) && h2d.transfers == 1);

  CHECK(strata_tensor_unregister(rt, w));
  EXPECT(strata_tensor_find(rt, "layers.0.mlp.weight", &found) == STRATA_ERROR_NOT_FOUND);
  free(src);
  free(dst);
  return 0;
}

int main(void) {
  strata_runtime_config_t config;
  strata_runtime_t* rt = NULL;
  strata_capabilities_t caps;
  int rc;

  EXPECT(strata_version() == STRATA_VERSION_NUMBER);
  CHECK(strata_runtime_config_init(&config));
  config.hbm_budget_bytes = 64u << 20;
  config.dram_budget_bytes = 64u << 20;
  CHECK(strata_runtime_create(&config, &rt));
  memset(&caps, 0, sizeof caps);
  caps.struct_size = STRATA_CAPABILITIES_STRUCT_SIZE;
  CHECK(strata_runtime_capabilities(rt, &caps));
  printf("strata %s on %s backend: %s\n", strata_version_string(),
         strata_device_backend_name(caps.device_backend), caps.device_name);
  rc = run(rt);
  CHECK(strata_runtime_destroy(rt));
  if (rc == 0) printf("c_api_test: all checks passed\n");
  return rc;
}
