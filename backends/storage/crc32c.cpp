#include "backends/storage/crc32c.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <climits>

namespace strata {

uint32_t crc32c(const void* data, std::size_t bytes) {
  // ISA-L's crc32_iscsi takes the running CRC without the final inversion and an int length.
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFu;
  while (bytes > 0) {
    const std::size_t n = std::min<std::size_t>(bytes, INT_MAX / 2);
    crc = crc32_iscsi(const_cast<unsigned char*>(p), static_cast<int>(n), crc);
    p += n;
    bytes -= n;
  }
  return crc ^ 0xFFFFFFFFu;
}

}  // namespace strata
