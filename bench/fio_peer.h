// fio, the peer for storage numbers: run on a file with a block size and queue depth, its
// bandwidth parsed from its JSON output.
#pragma once

#include <cstdint>
#include <string>

namespace strata_bench {

// Bytes/s of `rw` ("read" or "write") over `size` bytes of `file` (which must exist), with
// io_uring, O_DIRECT, fixed buffers and registered files. Throws with fio's output on failure.
double run_fio(const std::string& fio, const std::string& file, const std::string& rw,
               uint64_t size, uint64_t block, unsigned depth);
bool fio_available(const std::string& fio);

}  // namespace strata_bench
