#include "bench_options.h"

#include <cstdlib>
#include <stdexcept>

namespace strata_bench {

Options::Options(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument '" + a + "'");
    a = a.substr(2);
    if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      values_[a] = argv[++i];
    } else {
      values_[a] = "";
    }
    used_[a] = false;
  }
}

bool Options::flag(const std::string& name) const {
  if (values_.count(name) == 0) return false;
  used_[name] = true;
  return true;
}

std::string Options::str(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  used_[name] = true;
  if (it->second.empty()) throw std::invalid_argument("--" + name + " needs a value");
  return it->second;
}

uint64_t Options::bytes(const std::string& name, uint64_t fallback) const {
  const std::string v = str(name, "");
  if (v.empty()) return fallback;
  char* end = nullptr;
  const double number = std::strtod(v.c_str(), &end);
  const std::string suffix = end;
  double scale = 1;
  if (suffix == "K" || suffix == "k")
    scale = 1024.0;
  else if (suffix == "M" || suffix == "m")
    scale = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "g")
    scale = 1024.0 * 1024 * 1024;
  else if (!suffix.empty())
    throw std::invalid_argument("--" + name + ": bad size '" + v + "'");
  if (number <= 0) throw std::invalid_argument("--" + name + " must be positive");
  return static_cast<uint64_t>(number * scale);
}

long Options::integer(const std::string& name, long fallback) const {
  const std::string v = str(name, "");
  if (v.empty()) return fallback;
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (*end != '\0') throw std::invalid_argument("--" + name + ": not an integer '" + v + "'");
  return n;
}

std::vector<std::string> Options::unused() const {
  std::vector<std::string> out;
  for (const auto& [name, used] : used_) {
    if (!used) out.push_back("--" + name);
  }
  return out;
}

}  // namespace strata_bench
