// ScratchDir: a fresh directory for a test's files, removed at the end. Shared by the C ABI
// tests (test_support.h) and the core's unit tests (core_support.h).
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata_test {

// A fresh directory for NVMe tier files, on a real file system (O_DIRECT does not work on
// tmpfs): under $STRATA_TEST_SCRATCH if set, else the working directory. Removed at the end.
class ScratchDir {
 public:
  ScratchDir() {
    const char* root = std::getenv("STRATA_TEST_SCRATCH");
    std::string pattern = std::string(root != nullptr ? root : ".") + "/strata-test-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed: " + pattern);
    path_ = buf.data();
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace strata_test
