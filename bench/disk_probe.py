"""The runtime's disk probe (what strata_placement_create measures when NVMe rates are left at
0: the disk written, read, then read and written at once), several times back to back on an
NVMe tier at PATH, to see how much one probe varies on a machine
(docs/journal/2026-11-24-s10-issue14-prediction.md, "the placement's prediction within 10%").

    python bench/disk_probe.py PATH [--runs 3] [--dram-gib 6] [--nvme-gib 24]
"""
import argparse
import time

import strata.core as core

GiB = 1 << 30


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="the NVMe tier's file (created; removed by the caller)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dram-gib", type=float, default=6)
    p.add_argument("--nvme-gib", type=float, default=24)
    a = p.parse_args()
    rt = core.Runtime(backend="host", dram_budget=int(a.dram_gib * GiB), nvme=[a.path],
                      nvme_budget=int(a.nvme_gib * GiB))
    layers = core.placement_layers([[1 << 20]] * 2, 2)  # any that fit: the probe is the disk's
    for k in range(a.runs):
        t = time.perf_counter()
        info = core.place(layers, runtime=rt, dram_budget=1 << 40).info
        print("probe %d: read %.2f write %.2f GB/s mixed %.2f (%.1f s)" % (
            k, info["nvme_read_bytes_per_second"] / 1e9,
            info["nvme_write_bytes_per_second"] / 1e9, info["nvme_mixed"],
            time.perf_counter() - t), flush=True)


if __name__ == "__main__":
    main()
