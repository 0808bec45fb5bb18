#!/usr/bin/env python3
"""The DRAM arena's set-up, alone: a Strata runtime created with a DRAM budget of --gb, per
fault-in thread count of --threads, timed as strata_runtime_create (the wall) and as the
runtime reports it (dram_fault_seconds: the fault-in threads; dram_pin_seconds: what pinning
added after them, the pinning call running beside the fault-in). This is the "runtime" phase
of st.offload's setup (model.strata.setup_seconds), most of a large model's.

    python bench/setup_bench.py --gb 68 --threads 16                 # the 8B's arena
    python bench/setup_bench.py --gb 20 --threads 8,16,32,64 --keep  # cold pages per count
    python bench/setup_bench.py --gb 2 --backend host --threads 1,2  # no GPU: fault-in only
    python bench/setup_bench.py --gb 100 --threads 0 --pinned 1,0.25 --keep  # pin a quarter

--pinned (fractions of the arena, comma-separated; default 1, the whole arena as before) sets
strata_runtime_config_t.dram_pinned_bytes: only that first part is registered with the device,
the rest faulted in and never registered (what strata.torch does, the weights' and grads' part
pinned and the optimizer's state not). Where pinning is the longer pass (pin_added_seconds >
0) the registration of pinned_gb took the whole arena_seconds, and pin_gb_per_second is its
rate; where it ends first, the arena is bound by the fault-in and the rate is not seen.

On the GPU servers (virtual machines) the first touch of guest memory the host has not backed
yet is what costs: a second runtime of the same size in the same process reuses memory the
first one freed and is faster (and where the VM grows its RAM on demand, MemAvailable bounds
the arena until --host-memory grows it, as train_bench.py's option does). --keep holds every
runtime until the end, so each count faults memory no earlier run touched (the sum of the runs
must fit MemAvailable); without it, only the first run of a process sees cold memory. One line
per run, --json FILE for all of them."""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "bindings", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_memory import huge_page_bytes, mem_available  # noqa: E402
from strata import core  # noqa: E402

HUGE_PAGE = 2 << 20


def memory_zones():
    """GB managed per NUMA node and zone ("0/Normal": 120.3), from /proc/zoneinfo. Memory a VM
    hot-plugs is often onlined into ZONE_MOVABLE, from which a long-term pin
    (cudaHostRegister, io_uring's fixed buffers) must first migrate every page: pinning then
    copies the arena, which this tells apart from a slow registration."""
    zones, key = {}, None
    try:
        with open("/proc/zoneinfo") as f:
            for line in f:
                words = line.split()
                if line.startswith("Node"):
                    key = "%s/%s" % (words[1].rstrip(","), words[3])
                elif key and words[:1] == ["managed"]:
                    gb = int(words[1]) * 4096 / 1e9
                    if gb >= 0.1:
                        zones[key] = round(gb, 1)
                    key = None
    except OSError:
        pass
    return zones


def run_one(gb, threads, backend, hbm_budget, pinned=1.0):
    budget = max(HUGE_PAGE, int(gb * 1e9) // HUGE_PAGE * HUGE_PAGE)
    # A fraction of 1 is 0, the library's "all of it": exactly what ran before --pinned.
    pinned_bytes = 0 if pinned >= 1 else max(4096, int(budget * pinned))
    huge_before = huge_page_bytes()
    started = time.perf_counter()
    rt = core.Runtime(backend=backend, hbm_budget=hbm_budget, dram_budget=budget,
                      dram_fault_threads=threads, dram_pinned=pinned_bytes)
    wall = time.perf_counter() - started
    caps = rt.capabilities()
    fault, pin = caps.dram_fault_seconds, caps.dram_pin_seconds
    gbytes = budget / 1e9
    pinned_gb = caps.dram_pinned_bytes / 1e9
    return rt, {
        "pinned_fraction": pinned, "pinned_gb": pinned_gb,
        "pin_gb_per_second": pinned_gb / (fault + pin) if pin > 0 else None,
        "backend": rt.backend, "arena_gb": gbytes, "threads_asked": threads,
        "threads": caps.dram_fault_threads, "placement": caps.dram_placement.decode(),
        "huge_pages": bool(caps.dram_huge_pages),
        "huge_page_gb": (huge_page_bytes() - huge_before) / 1e9,
        "create_seconds": wall, "fault_seconds": fault, "pin_added_seconds": pin,
        "arena_seconds": fault + pin,
        "fault_gb_per_second": gbytes / fault if fault > 0 else None,
        "arena_gb_per_second": gbytes / (fault + pin) if fault + pin > 0 else None,
        "create_seconds_per_gb": wall / gbytes,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=8.0, help="DRAM arena per runtime, GB (1e9)")
    ap.add_argument("--threads", default="0",
                    help="comma-separated fault-in thread counts (0: the library's default)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "host"])
    ap.add_argument("--hbm-mb", type=int, default=256,
                    help="HBM budget, MB: kept small, the HBM arena is not what is measured")
    ap.add_argument("--repeat", type=int, default=1, help="runs per thread count")
    ap.add_argument("--keep", action="store_true",
                    help="hold every runtime until the end: each run faults fresh memory")
    ap.add_argument("--host-memory", type=float, default=0,
                    help="GB of MemAvailable to make sure of first, touching memory where the "
                         "VM grows its RAM on demand (host_memory.grow_host_memory, as "
                         "train_bench.py --host-memory): its time is reported, not counted")
    ap.add_argument("--pinned", default="1",
                    help="comma-separated fractions of the arena to pin (dram_pinned_bytes; 1, "
                         "the default: all of it), each run per thread count")
    ap.add_argument("--json", help="write every run's numbers to this file")
    args = ap.parse_args()
    if args.host_memory:
        from host_memory import grow_host_memory
        seconds = grow_host_memory(int(args.host_memory * 1e9))
        print("host memory: %.0f GB available (%.0f s to grow it; %.0f GB asked for)"
              % (mem_available() / 1e9, seconds, args.host_memory), flush=True)
    counts = [int(t) for t in args.threads.split(",")]
    fractions = [float(f) for f in args.pinned.split(",")]
    if any(not 0 < f <= 1 for f in fractions):
        sys.exit("--pinned: fractions of the arena in (0, 1], got %s" % args.pinned)
    runs = len(counts) * len(fractions) * args.repeat
    if args.keep and runs * args.gb * 1e9 > mem_available():
        sys.exit("--keep: %d runs of %.1f GB exceed MemAvailable (%.1f GB)"
                 % (runs, args.gb, mem_available() / 1e9))
    print("memory zones (GB managed): %s" % memory_zones(), flush=True)
    kept, results = [], []
    for _ in range(args.repeat):
        for threads in counts:
            for fraction in fractions:
                rt, r = run_one(args.gb, threads, args.backend, args.hbm_mb << 20, fraction)
                results.append(r)
                print("%-5s %6.1f GB  pinned %6.1f GB  threads %3d (asked %d)  create %6.2f s "
                      "= %.3f s/GB  fault %6.2f s (%5.1f GB/s)  +pin %5.2f s%s  arena %5.1f "
                      "GB/s  huge %.1f GB  %s"
                      % (r["backend"], r["arena_gb"], r["pinned_gb"], r["threads"], threads,
                         r["create_seconds"], r["create_seconds_per_gb"], r["fault_seconds"],
                         r["fault_gb_per_second"] or 0, r["pin_added_seconds"],
                         " (pin %.1f GB/s)" % r["pin_gb_per_second"]
                         if r["pin_gb_per_second"] else "",
                         r["arena_gb_per_second"] or 0, r["huge_page_gb"], r["placement"]),
                      flush=True)
                if args.keep:
                    kept.append(rt)
                else:
                    rt.close()
    for rt in kept:
        rt.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
