// The one output format of every strata-bench subcommand (docs/benchmarks.md, "How to read them"):
// a table for people, and with --json one JSON object for tools. `ratio` is always
// higher-is-better: the fraction of a ceiling reached or the speed-up over a peer, both measured in
// the same run.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace strata_bench {

struct Result {
  std::string metric;
  double value = 0;
  std::string unit;
  std::string baseline;  // empty: no baseline, and the three fields are left out
  double baseline_value = 0;
  double ratio = 0;
  std::string note;  // shown in the table only
};

struct Report {
  std::string bench;
  std::string device;
  std::vector<Result> results;

  void add(Result r) { results.push_back(std::move(r)); }
  // Adds a result with a peer or ceiling; ratio = value / baseline_value, or its inverse when
  // lower is better (times).
  void add_vs(std::string metric, double value, std::string unit, std::string baseline,
              double baseline_value, bool lower_is_better = false, std::string note = "");
  void print_table() const;
  void print_json() const;
};

// Progress for long runs, on stderr so --json output stays clean.
void progress(const std::string& line);

}  // namespace strata_bench
