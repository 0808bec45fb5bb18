// strata-bench: one CLI, one output format (bench_report.h), a subcommand per part of the system.
//   strata-bench io [--size 1G] [--block 1M] [--qd 32] [--reps 3] [--dir .] [--fio fio]
//                   [--engine auto|uring|posix] [--backend auto|cuda|host] [--link-size 256M]
//                   [--no-nvme] [--dram-direct] [--checksums] [--json]
//   strata-bench stream [--layers 24] [--layer-bytes 256M] [--steps 3] [--compute-ratio 1.2]
//                       [--grads] [--slot-budget 0] [--backend auto|cuda|host] [--trace F]
//   strata-bench links [--size 1G] [--dram-size 1G] [--threads 0] [--dir .] [--fio fio]
#include <cstdio>
#include <exception>
#include <string>

#include "bench_options.h"
#include "bench_report.h"

namespace strata_bench {
int run_io(const Options& opt, Report* report);
int run_stream(const Options& opt, Report* report);
int run_links(const Options& opt, Report* report);
int run_optim(const Options& opt, Report* report);
}  // namespace strata_bench

namespace {
void usage() {
  std::fprintf(stderr,
               "usage: strata-bench SUBCOMMAND [options] [--json]\n"
               "  io   NVMe read/write vs fio, DRAM<->HBM vs cudaMemcpyAsync, pinning rate\n"
               "       --size 1G --block 1M --qd 32 --reps 3 --dir . --fio fio\n"
               "       --engine auto|uring|posix --backend auto|cuda|host --link-size 256M "
               "--no-nvme --dram-direct --checksums\n"
               "  stream  a synthetic graph through the executor: h2d vs the link ceiling,\n"
               "       compute-stream waits, predicted vs measured step time\n"
               "       --layers 24 --layer-bytes 256M --steps 3 --compute-ratio 1.2 --grads\n"
               "       --slot-budget 0 --backend auto|cuda|host --trace FILE (overhead + trace)\n"
               "  links  every link's ceiling on this machine: pinned h2d/d2h/both, pageable,\n"
               "       DRAM triad, NVMe read/write (fio)\n"
               "       --size 1G --dram-size 1G --threads 0 --dir . --fio fio --backend\n"
               "  optim  AdamW updates/s and the bandwidth they imply vs a STREAM triad,\n"
               "       and vs torch.optim.AdamW (foreach, fused) on the CPU\n"
               "       --params 256M --chunk 16M --threads 0 --reps 5 --python python3 "
               "--no-torch\n");
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  try {
    strata_bench::Options opt(argc, argv, 2);
    const bool json = opt.flag("json");
    strata_bench::Report report;
    report.bench = command;
    int rc = 0;
    if (command == "io") {
      rc = strata_bench::run_io(opt, &report);
    } else if (command == "stream") {
      rc = strata_bench::run_stream(opt, &report);
    } else if (command == "links") {
      rc = strata_bench::run_links(opt, &report);
    } else if (command == "optim") {
      rc = strata_bench::run_optim(opt, &report);
    } else {
      std::fprintf(stderr, "strata-bench: unknown subcommand '%s'\n", command.c_str());
      usage();
      return 2;
    }
    if (const auto unused = opt.unused(); !unused.empty()) {
      std::fprintf(stderr, "strata-bench: unknown option %s\n", unused.front().c_str());
      return 2;
    }
    if (json) {
      report.print_json();
    } else {
      report.print_table();
    }
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-bench %s: %s\n", command.c_str(), e.what());
    return 1;
  }
}
