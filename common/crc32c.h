// CRC-32C (Castagnoli) of the bytes written to the NVMe tier and to checkpoints, from Intel's
// ISA-L (libisal), which folds with PCLMULQDQ and runs at tens of GB/s per core, where it is
// installed; it is loaded at run time, and without it the CPU's SSE4.2 crc32 instruction
// (~8 GB/s per core) does the work, so libstrata loads on machines without libisal.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// Standard CRC-32C (initial value and final XOR 0xFFFFFFFF): crc32c("123456789") == 0xE3069283.
uint32_t crc32c(const void* data, std::size_t bytes);

// Continues a CRC-32C over more bytes, for data that arrives in pieces:
// crc32c_extend(crc32c(a), b) == crc32c(a + b), and crc32c_extend(0, a) == crc32c(a).
uint32_t crc32c_extend(uint32_t crc, const void* data, std::size_t bytes);

// The same without ISA-L (the CPU's crc32 instruction), and whether ISA-L was found at run
// time (STRATA_CRC32C=builtin turns it off); both for tests and diagnostics.
uint32_t crc32c_extend_builtin(uint32_t crc, const void* data, std::size_t bytes);
bool crc32c_uses_isal();

}  // namespace strata
