/* Proves strata.h compiles as strict C99 (DLPack's habit: a C file that exists for this). */
#include "strata/strata.h"

/* Every size macro must be usable in a constant expression. */
typedef char strata_config_size_is_constant[STRATA_RUNTIME_CONFIG_STRUCT_SIZE > 0 ? 1 : -1];
/* The v1 size macros cover their whole structs (a field appended without moving the macro, or
 * placed before the last one, breaks this). */
typedef char strata_desc_size_matches[STRATA_TENSOR_DESC_STRUCT_SIZE <= sizeof(strata_tensor_desc_t)
                                          ? 1
                                          : -1];
typedef char strata_info_size_matches[STRATA_TENSOR_INFO_STRUCT_SIZE <= sizeof(strata_tensor_info_t)
                                          ? 1
                                          : -1];
typedef char
    strata_caps_size_matches[STRATA_CAPABILITIES_STRUCT_SIZE <= sizeof(strata_capabilities_t) ? 1
                                                                                              : -1];

int strata_header_compiles_as_c99(void) {
  return STRATA_VERSION_NUMBER;
}
