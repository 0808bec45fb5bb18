#include "bench_report.h"

#include <cmath>
#include <cstdio>

namespace strata_bench {
namespace {
std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
      continue;
    }
    out += c;
  }
  return out;
}
}  // namespace

void Report::add_vs(std::string metric, double value, std::string unit, std::string baseline,
                    double baseline_value, bool lower_is_better, std::string note) {
  Result r;
  r.metric = std::move(metric);
  r.value = value;
  r.unit = std::move(unit);
  r.baseline = std::move(baseline);
  r.baseline_value = baseline_value;
  if (baseline_value > 0 && value > 0) {
    r.ratio = lower_is_better ? baseline_value / value : value / baseline_value;
  }
  r.note = std::move(note);
  results.push_back(std::move(r));
}

void Report::print_table() const {
  std::printf("strata-bench %s on %s\n", bench.c_str(), device.c_str());
  std::printf("%-26s %12s %-6s  %-28s %12s %7s\n", "metric", "value", "unit", "baseline",
              "baseline", "ratio");
  for (const Result& r : results) {
    if (r.baseline.empty()) {
      std::printf("%-26s %12.3f %-6s  %-28s %12s %7s  %s\n", r.metric.c_str(), r.value,
                  r.unit.c_str(), "-", "-", "-", r.note.c_str());
    } else {
      std::printf("%-26s %12.3f %-6s  %-28s %12.3f %7.3f  %s\n", r.metric.c_str(), r.value,
                  r.unit.c_str(), r.baseline.c_str(), r.baseline_value, r.ratio, r.note.c_str());
    }
  }
}

void Report::print_json() const {
  std::printf("{\"bench\": \"%s\", \"device\": \"%s\", \"results\": [", json_escape(bench).c_str(),
              json_escape(device).c_str());
  for (std::size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    std::printf("%s{\"metric\": \"%s\", \"value\": %.6g, \"unit\": \"%s\"", i ? ", " : "",
                json_escape(r.metric).c_str(), r.value, json_escape(r.unit).c_str());
    if (!r.baseline.empty()) {
      std::printf(", \"baseline\": \"%s\", \"baseline_value\": %.6g, \"ratio\": %.4f",
                  json_escape(r.baseline).c_str(), r.baseline_value, r.ratio);
    }
    std::printf("}");
  }
  std::printf("]}\n");
}

void progress(const std::string& line) {
  std::fprintf(stderr, "[strata-bench] %s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace strata_bench
