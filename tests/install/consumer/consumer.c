/* Links the installed libstrata and checks that header and library agree. */
#include <stdio.h>
#include <strata/strata.h>

int main(void) {
  strata_runtime_config_t config;
  strata_runtime_t* rt = NULL;
  if (strata_version() != STRATA_VERSION_NUMBER) {
    fprintf(stderr, "header %d, library %u\n", STRATA_VERSION_NUMBER, strata_version());
    return 1;
  }
  strata_runtime_config_init(&config);
  config.device_backend = STRATA_DEVICE_BACKEND_HOST;
  config.hbm_budget_bytes = 1 << 20;
  config.dram_budget_bytes = 1 << 20;
  if (strata_runtime_create(&config, &rt) != STRATA_OK) {
    fprintf(stderr, "%s\n", strata_last_error_message());
    return 1;
  }
  strata_runtime_destroy(rt);
  printf("consumer linked strata %s\n", strata_version_string());
  return 0;
}
