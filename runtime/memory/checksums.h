// Checksums of a tensor's NVMe copy, one per piece (a stripe unit or less).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace strata {

// CRC-32C per piece of an NVMe extent. A piece carries a checksum only once Strata wrote it
// (a tensor registered straight on NVMe has undefined contents until written), so reads check
// exactly the pieces whose contents Strata knows.
struct Checksums {
  std::vector<uint32_t> crc;
  std::vector<uint8_t> valid;
  void reset(std::size_t pieces) {
    crc.assign(pieces, 0);
    valid.assign(pieces, 0);
  }
  void set(std::size_t piece, uint32_t value) {
    crc[piece] = value;
    valid[piece] = 1;
  }
};

}  // namespace strata
