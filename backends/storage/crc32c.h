// CRC-32C (Castagnoli) of the bytes written to the NVMe tier, from Intel's ISA-L (libisal),
// which folds with PCLMULQDQ and runs at tens of GB/s per core: fast enough to check every
// extent on the I/O path without slowing a multi-GB/s disk.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// Standard CRC-32C (initial value and final XOR 0xFFFFFFFF): crc32c("123456789") == 0xE3069283.
uint32_t crc32c(const void* data, std::size_t bytes);

// Continues a CRC-32C over more bytes, for data that arrives in pieces:
// crc32c_extend(crc32c(a), b) == crc32c(a + b), and crc32c_extend(0, a) == crc32c(a).
uint32_t crc32c_extend(uint32_t crc, const void* data, std::size_t bytes);

}  // namespace strata
