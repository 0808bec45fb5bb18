// Command-line parsing shared by the subcommands: --name value pairs and flags.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace strata_bench {

class Options {
 public:
  // Parses argv[first..]; a "--x" followed by a non-"--" word is a value, else a flag.
  Options(int argc, char** argv, int first);
  bool flag(const std::string& name) const;
  std::string str(const std::string& name, const std::string& fallback) const;
  // Accepts a plain number or one with K/M/G suffix (powers of 1024).
  uint64_t bytes(const std::string& name, uint64_t fallback) const;
  long integer(const std::string& name, long fallback) const;
  // Names given but never read: reported as an error so typos do not silently run defaults.
  std::vector<std::string> unused() const;

 private:
  std::map<std::string, std::string> values_;
  mutable std::map<std::string, bool> used_;
};

}  // namespace strata_bench
