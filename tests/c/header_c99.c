/* Proves strata.h compiles as strict C99 (DLPack's habit: a C file that exists for this), with
 * and without its STRATA_EXPERIMENTAL section. The size macros' values are checked against their
 * structs by the generated layout probe (tests/abi/gen_layout_probe.py). */
#include "strata/strata.h"

/* Every size macro must be usable in a constant expression. */
typedef char strata_config_size_is_constant[STRATA_RUNTIME_CONFIG_STRUCT_SIZE > 0 ? 1 : -1];

int strata_header_compiles_as_c99(void) {
  return STRATA_VERSION_NUMBER;
}
