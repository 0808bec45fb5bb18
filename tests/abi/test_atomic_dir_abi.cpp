// Atomic directories through the C ABI (strata.h "Atomic directories", since 1.5): what each
// function's comment promises, as a framework's save and load use them: the staging path with
// strata_plan_dump's buffer rules and nothing touched; begin clearing a crashed save's leftover
// and creating parents; commit replacing the previous version and removing it; resolve naming
// the directory to load, "<path>.old" after a crash between the two renames, never a staging
// directory; every refusal it lists.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace fs = std::filesystem;

namespace {

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  REQUIRE(out.good());
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

using Query = strata_status_t (*)(const char*, char*, size_t, size_t*);

// A path-returning call as a caller does it: the length first, then the text.
std::string text_of(Query fn, const std::string& path) {
  size_t n = 0;
  STRATA_REQUIRE_OK(fn(path.c_str(), nullptr, 0, &n));
  std::vector<char> buf(n + 1, 'x');
  size_t again = 0;
  STRATA_REQUIRE_OK(fn(path.c_str(), buf.data(), buf.size(), &again));
  REQUIRE(again == n);
  REQUIRE(buf[n] == '\0');
  return std::string(buf.data());
}

// A save of one file through the ABI.
void save(const std::string& path, const std::string& text) {
  STRATA_REQUIRE_OK(strata_atomic_dir_begin(path.c_str()));
  write_file(text_of(strata_atomic_dir_staging, path) + "/data", text);
  STRATA_REQUIRE_OK(strata_atomic_dir_commit(path.c_str()));
}

}  // namespace

TEST_CASE("atomic dir: the staging path, with the dump's buffer rules, touching nothing", "[abi]") {
  strata_test::ScratchDir dir;
  const std::string path = dir.file("ckpt");
  CHECK(text_of(strata_atomic_dir_staging, path) == path + ".partial");
  CHECK(text_of(strata_atomic_dir_staging, path + "//") == path + ".partial");
  CHECK(entries(dir.path()).empty());
  // strlen(path) + 9 suffices; one byte fewer than the text and its NUL is refused.
  std::vector<char> buf(path.size() + 9);
  STRATA_REQUIRE_OK(strata_atomic_dir_staging(path.c_str(), buf.data(), buf.size(), nullptr));
  STRATA_REQUIRE_ERROR(
      strata_atomic_dir_staging(path.c_str(), buf.data(), path.size() + 8, nullptr),
      STRATA_ERROR_INVALID_ARGUMENT, "too small");
}

TEST_CASE("atomic dir: save, replace, resolve", "[abi]") {
  strata_test::ScratchDir dir;
  const std::string path = dir.file("a/b/ckpt");  // begin creates the missing parents
  save(path, "v1");
  CHECK(read_file(path + "/data") == "v1");
  CHECK(text_of(strata_atomic_dir_resolve, path) == path);
  save(path, "v2");
  CHECK(read_file(path + "/data") == "v2");
  CHECK(entries(dir.file("a/b")) == std::set<std::string>{"ckpt"});  // no staging, no .old
  // resolve's buffer: strlen(path) + 5 suffices, fewer than the text and its NUL is refused.
  std::vector<char> buf(path.size() + 5);
  size_t n = 0;
  STRATA_REQUIRE_OK(strata_atomic_dir_resolve(path.c_str(), buf.data(), buf.size(), &n));
  CHECK(n == path.size());
  STRATA_REQUIRE_ERROR(strata_atomic_dir_resolve(path.c_str(), buf.data(), path.size(), nullptr),
                       STRATA_ERROR_INVALID_ARGUMENT, "too small");
}

TEST_CASE("atomic dir: a crash before the commit leaves the previous version to load", "[abi]") {
  strata_test::ScratchDir dir;
  const std::string path = dir.file("ckpt");
  save(path, "v1");
  STRATA_REQUIRE_OK(strata_atomic_dir_begin(path.c_str()));
  const std::string staging = text_of(strata_atomic_dir_staging, path);
  write_file(staging + "/data", "half");  // the process dies here
  CHECK(text_of(strata_atomic_dir_resolve, path) == path);
  CHECK(read_file(path + "/data") == "v1");
  // The next save's begin removes the leftover: nothing of it reaches the new version.
  STRATA_REQUIRE_OK(strata_atomic_dir_begin(path.c_str()));
  CHECK(fs::is_empty(staging));
  write_file(staging + "/other", "v2");
  STRATA_REQUIRE_OK(strata_atomic_dir_commit(path.c_str()));
  CHECK(entries(path) == std::set<std::string>{"other"});
}

TEST_CASE("atomic dir: a crash between the two renames loads <path>.old", "[abi]") {
  strata_test::ScratchDir dir;
  const std::string path = dir.file("ckpt");
  save(path, "v1");
  STRATA_REQUIRE_OK(strata_atomic_dir_begin(path.c_str()));
  write_file(text_of(strata_atomic_dir_staging, path) + "/data", "v2");
  fs::rename(path, path + ".old");  // the first rename of the fallback, then the crash
  CHECK(text_of(strata_atomic_dir_resolve, path) == path + ".old");
  CHECK(read_file(text_of(strata_atomic_dir_resolve, path) + "/data") == "v1");
  // Committing the staged version then puts it in place and removes the stale ".old".
  STRATA_REQUIRE_OK(strata_atomic_dir_commit(path.c_str()));
  CHECK(read_file(path + "/data") == "v2");
  CHECK(entries(dir.path()) == std::set<std::string>{"ckpt"});
  // A ".old" beside a present <path> is stale: resolve returns <path>.
  fs::create_directory(path + ".old");
  CHECK(text_of(strata_atomic_dir_resolve, path) == path);
}

TEST_CASE("atomic dir: refusals", "[abi]") {
  strata_test::ScratchDir dir;
  const std::string path = dir.file("ckpt");
  const std::string file = dir.file("file");
  write_file(file, "x");
  for (const char* bad : {static_cast<const char*>(nullptr), "", "/", ".."}) {
    INFO((bad != nullptr ? bad : "NULL"));
    CHECK(strata_atomic_dir_begin(bad) == STRATA_ERROR_INVALID_ARGUMENT);
    CHECK(strata_atomic_dir_commit(bad) == STRATA_ERROR_INVALID_ARGUMENT);
    CHECK(strata_atomic_dir_staging(bad, nullptr, 0, nullptr) == STRATA_ERROR_INVALID_ARGUMENT);
    CHECK(strata_atomic_dir_resolve(bad, nullptr, 0, nullptr) == STRATA_ERROR_INVALID_ARGUMENT);
  }
  STRATA_REQUIRE_ERROR(strata_atomic_dir_begin(file.c_str()), STRATA_ERROR_INVALID_ARGUMENT,
                       "not a directory");
  STRATA_REQUIRE_ERROR(strata_atomic_dir_resolve(file.c_str(), nullptr, 0, nullptr),
                       STRATA_ERROR_INVALID_ARGUMENT, "not a directory");
  STRATA_REQUIRE_ERROR(strata_atomic_dir_commit(path.c_str()), STRATA_ERROR_NOT_FOUND,
                       "staging directory");
  STRATA_REQUIRE_ERROR(strata_atomic_dir_resolve(path.c_str(), nullptr, 0, nullptr),
                       STRATA_ERROR_NOT_FOUND, ".old");
  CHECK(entries(dir.path()) == std::set<std::string>{"file"});  // nothing was created
}
