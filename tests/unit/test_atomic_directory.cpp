#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <stdexcept>
#include <string>

#include "runtime/checkpoint/atomic_directory.h"
#include "tests/support/core_support.h"

using strata::Code;
using strata::Status;
namespace fs = std::filesystem;

using strata_test::ScratchDir;

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

// The names directly in `dir`.
std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

// A save: begin, write `files` (name -> contents, "sub/x" allowed), commit.
void save(const std::string& final_path, const std::map<std::string, std::string>& files) {
  std::string staging;
  REQUIRE_OK(strata::begin_atomic_directory(final_path, &staging));
  for (const auto& [name, text] : files) {
    fs::create_directories(fs::path(staging + "/" + name).parent_path());
    write_file(staging + "/" + name, text);
  }
  REQUIRE_OK(strata::commit_atomic_directory(staging, final_path));
}

}  // namespace

TEST_CASE("atomic directory: a fresh commit", "[atomic_directory]") {
  ScratchDir dir;
  const std::string final_path = dir.file("ckpt");
  std::string staging;
  REQUIRE_OK(strata::begin_atomic_directory(final_path, &staging));
  REQUIRE(staging == final_path + ".partial");
  REQUIRE(fs::is_directory(staging));
  REQUIRE(fs::is_empty(staging));
  write_file(staging + "/model.safetensors", "weights");
  fs::create_directory(staging + "/optim");
  write_file(staging + "/optim/state", "moments");
  REQUIRE_OK(strata::commit_atomic_directory(staging, final_path));

  REQUIRE(entries(dir.path()) == std::set<std::string>{"ckpt"});
  REQUIRE(read_file(final_path + "/model.safetensors") == "weights");
  REQUIRE(read_file(final_path + "/optim/state") == "moments");
  std::string existing;
  REQUIRE_OK(strata::resolve_atomic_directory(final_path, &existing));
  REQUIRE(existing == final_path);
}

TEST_CASE("atomic directory: replacing an existing directory", "[atomic_directory]") {
  ScratchDir dir;
  const std::string final_path = dir.file("ckpt");
  save(final_path, {{"old.bin", "old"}, {"shared", "v1"}});
  save(final_path, {{"new.bin", "new"}, {"shared", "v2"}});
  REQUIRE(entries(dir.path()) == std::set<std::string>{"ckpt"});  // no .partial, no .old
  REQUIRE(entries(final_path) == std::set<std::string>{"new.bin", "shared"});
  REQUIRE(read_file(final_path + "/shared") == "v2");
}

TEST_CASE("atomic directory: a trailing slash names the same directory", "[atomic_directory]") {
  ScratchDir dir;
  const std::string final_path = dir.file("ckpt");
  std::string staging;
  REQUIRE_OK(strata::begin_atomic_directory(final_path + "/", &staging));
  REQUIRE(staging == final_path + ".partial");
  write_file(staging + "/a", "1");
  REQUIRE_OK(strata::commit_atomic_directory(staging + "/", final_path + "//"));
  save(final_path + "/", {{"b", "2"}});
  REQUIRE(entries(dir.path()) == std::set<std::string>{"ckpt"});
  REQUIRE(entries(final_path) == std::set<std::string>{"b"});
  std::string existing;
  REQUIRE_OK(strata::resolve_atomic_directory(final_path + "/", &existing));
  REQUIRE(existing == final_path);
}

TEST_CASE("atomic directory: begin removes the leftover of a crashed save", "[atomic_directory]") {
  ScratchDir dir;
  const std::string final_path = dir.file("ckpt");
  save(final_path, {{"good", "committed"}});
  // A save that crashed before its commit.
  fs::create_directories(final_path + ".partial/deep/er");
  write_file(final_path + ".partial/deep/er/junk", "half written");
  std::string staging;
  REQUIRE_OK(strata::begin_atomic_directory(final_path, &staging));
  REQUIRE(fs::is_directory(staging));
  REQUIRE(fs::is_empty(staging));
  REQUIRE(read_file(final_path + "/good") == "committed");  // the committed version is untouched
}

TEST_CASE("atomic directory: begin creates missing parents", "[atomic_directory]") {
  ScratchDir dir;
  const std::string final_path = dir.file("runs/a/step-100");
  save(final_path, {{"x", "1"}});
  REQUIRE(read_file(final_path + "/x") == "1");
  REQUIRE(entries(dir.file("runs/a")) == std::set<std::string>{"step-100"});
}

TEST_CASE("atomic directory: resolve after an interrupted two-rename replacement",
          "[atomic_directory]") {
  ScratchDir dir;
  const std::string final_path = dir.file("ckpt");
  std::string existing;
  Status s = strata::resolve_atomic_directory(final_path, &existing);
  REQUIRE(s.code() == Code::kNotFound);
  REQUIRE_THAT(s.message(), Catch::Contains(final_path));

  // The state between "final -> .old" and "staging -> final".
  fs::create_directory(final_path + ".old");
  write_file(final_path + ".old/v", "previous");
  fs::create_directory(final_path + ".partial");
  write_file(final_path + ".partial/v", "next");
  REQUIRE_OK(strata::resolve_atomic_directory(final_path, &existing));
  REQUIRE(existing == final_path + ".old");
  REQUIRE(read_file(existing + "/v") == "previous");

  // Redoing the save still commits, and clears the stale .old once the new version is in place.
  save(final_path, {{"v", "redone"}});
  REQUIRE(entries(dir.path()) == std::set<std::string>{"ckpt"});
  REQUIRE_OK(strata::resolve_atomic_directory(final_path, &existing));
  REQUIRE(existing == final_path);
  REQUIRE(read_file(existing + "/v") == "redone");
}

TEST_CASE("atomic directory: misuse is reported, not thrown", "[atomic_directory]") {
  ScratchDir dir;
  std::string out;
  write_file(dir.file("file"), "not a directory");
  Status s = strata::begin_atomic_directory(dir.file("file"), &out);
  REQUIRE(s.code() == Code::kInvalidArgument);
  REQUIRE_THAT(s.message(), Catch::Contains(dir.file("file")));
  REQUIRE(strata::resolve_atomic_directory(dir.file("file"), &out).code() ==
          Code::kInvalidArgument);
  REQUIRE(strata::begin_atomic_directory("", &out).code() == Code::kInvalidArgument);
  REQUIRE(strata::begin_atomic_directory("/", &out).code() == Code::kInvalidArgument);
  REQUIRE(strata::begin_atomic_directory(dir.path() + "/..", &out).code() ==
          Code::kInvalidArgument);
  s = strata::commit_atomic_directory(dir.file("nothing.partial"), dir.file("nothing"));
  REQUIRE(s.code() == Code::kNotFound);
  REQUIRE_THAT(s.message(), Catch::Contains(dir.file("nothing.partial")));
  REQUIRE(!fs::exists(dir.file("nothing")));
}
