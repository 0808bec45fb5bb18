#include "fio_peer.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace strata_bench {

// Runs fio on `file` and returns its bandwidth in bytes/s for `rw` (read or write).
double run_fio(const std::string& fio, const std::string& file, const std::string& rw,
               uint64_t size, uint64_t block, unsigned depth) {
  const std::string cmd = fio + " --name=peer --filename=" + file + " --rw=" + rw +
                          " --bs=" + std::to_string(block) + " --iodepth=" + std::to_string(depth) +
                          " --size=" + std::to_string(size) +
                          " --ioengine=io_uring --direct=1 --fixedbufs=1 --registerfiles=1"
                          " --allow_file_create=0 --output-format=json 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("cannot run " + fio);
  std::string out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int rc = pclose(p);
  const std::size_t section = out.find("\"" + rw + "\" : {");
  const std::size_t field =
      section == std::string::npos ? section : out.find("\"bw_bytes\"", section);
  if (rc != 0 || field == std::string::npos) {
    throw std::runtime_error("fio failed (" + cmd + "):\n" + out.substr(0, 2000));
  }
  return std::strtod(out.c_str() + out.find(':', field) + 1, nullptr);
}

bool fio_available(const std::string& fio) {
  return std::system((fio + " --version >/dev/null 2>&1").c_str()) == 0;
}

}  // namespace strata_bench
