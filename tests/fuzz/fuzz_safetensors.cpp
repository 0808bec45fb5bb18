// libFuzzer: the safetensors Reader on arbitrary bytes. Every input must end in a status (never a
// crash, a hang, a leak or unbounded memory), and a file that opens must read every tensor.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "runtime/checkpoint/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A memory file: Reader::open takes a path, and /proc/self/fd/N names a regular file.
  const int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  if (fd < 0) return 0;
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = write(fd, data + done, size - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  std::unique_ptr<strata::safetensors::Reader> reader;
  if (strata::safetensors::Reader::open(path, &reader, 4096).is_ok()) {
    uint64_t total = 0;
    for (const auto& t : reader->header().tensors) {
      (void)reader->has_checksum(t);
      (void)reader->read_tensor(t, 7, [&](const void*, uint64_t, uint64_t bytes) {
        total += bytes;
        return strata::Status::ok();
      });
    }
  }
  close(fd);
  return 0;
}
