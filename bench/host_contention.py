"""Does the GPU's DMA traffic over PCIe take host memory bandwidth from the CPU's optimizer
update, or do the two add up?

The answer decides whether updating some streamed layers on the GPU (their optimizer state
copied over PCIe) adds update throughput to the CPU's (it does only when the copies ride on
memory bandwidth the CPU cores cannot use themselves). Three phases of `--seconds` each, one
process: torch's fused CPU AdamW alone (fp32 params, grads and moments: 28 bytes moved per
parameter, what Strata's update moves), pinned host <-> device copies both ways alone, then
both at once. Prints each rate and the ratios against the phases alone; `--json` writes them.

    python bench/host_contention.py --params 512M --copy-gb 4 --seconds 10
"""

import argparse
import json
import threading
import time

import torch


def parse_count(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


class Update:
    """torch's fused CPU AdamW over `params` fp32 elements in 64 Mi-element tensors."""

    def __init__(self, params):
        chunk = 64 << 20
        sizes = [min(chunk, params - i) for i in range(0, params, chunk)]
        self.params = [torch.zeros(n, requires_grad=True) for n in sizes]
        for p in self.params:
            p.grad = torch.full_like(p, 1e-3)
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, fused=True)
        self.elements = params

    def once(self):
        self.opt.step()


class Copies:
    """`gb` GB each way between pinned host memory and the device, on two streams."""

    def __init__(self, gb, device):
        n = int(gb * 1e9)
        self.host_in = torch.empty(n, dtype=torch.uint8).pin_memory()
        self.host_out = torch.empty(n, dtype=torch.uint8).pin_memory()
        self.dev_in = torch.empty(n, dtype=torch.uint8, device=device)
        self.dev_out = torch.empty(n, dtype=torch.uint8, device=device)
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.bytes = 2 * n

    def once(self):
        with torch.cuda.stream(self.h2d):
            self.dev_in.copy_(self.host_in, non_blocking=True)
        with torch.cuda.stream(self.d2h):
            self.host_out.copy_(self.dev_out, non_blocking=True)
        self.h2d.synchronize()
        self.d2h.synchronize()


def run_for(seconds, work, stop):
    """Runs work.once() until `seconds` pass or `stop` is set; (iterations, seconds)."""
    work.once()  # warm
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and not stop.is_set():
        work.once()
        n += 1
    return n, time.perf_counter() - t0


def together(seconds, update, copies):
    """Both loops at once, each in its own thread (torch releases the GIL in both); each rate
    counted over its own loop's time."""
    stop = threading.Event()
    result = {}

    def loop(name, work):
        result[name] = run_for(seconds, work, stop)
        stop.set()  # the other loop's rate counts only while both ran

    threads = [threading.Thread(target=loop, args=("update", update)),
               threading.Thread(target=loop, args=("copies", copies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="512M", help="AdamW elements (K/M/G suffixes)")
    ap.add_argument("--copy-gb", type=float, default=4.0, help="GB each way per copy")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda")
    update = Update(parse_count(args.params))
    copies = Copies(args.copy_gb, device)
    never = threading.Event()

    n, s = run_for(args.seconds, update, never)
    update_alone = n * update.elements / s
    n, s = run_for(args.seconds, copies, never)
    copies_alone = n * copies.bytes / s
    both = together(args.seconds, update, copies)
    n, s = both["update"]
    update_both = n * update.elements / s
    n, s = both["copies"]
    copies_both = n * copies.bytes / s

    out = {
        "threads": torch.get_num_threads(),
        "update_alone_gparams": update_alone / 1e9,
        "update_alone_gbs": update_alone * 28 / 1e9,
        "copies_alone_gbs": copies_alone / 1e9,
        "update_with_copies_gparams": update_both / 1e9,
        "copies_with_update_gbs": copies_both / 1e9,
        "update_ratio": update_both / update_alone,
        "copies_ratio": copies_both / copies_alone,
        "host_traffic_alone_gbs": max(update_alone * 28, copies_alone) / 1e9,
        "host_traffic_both_gbs": (update_both * 28 + copies_both) / 1e9,
    }
    print("CPU AdamW (%d threads): alone %.2f G params/s (%.1f GB/s); with copies %.2f (%.3f)"
          % (out["threads"], out["update_alone_gparams"], out["update_alone_gbs"],
             out["update_with_copies_gparams"], out["update_ratio"]))
    print("pinned copies both ways: alone %.1f GB/s; with the update %.1f (%.3f)"
          % (out["copies_alone_gbs"], out["copies_with_update_gbs"], out["copies_ratio"]))
    print("host memory traffic: %.1f GB/s together against %.1f for the larger alone"
          % (out["host_traffic_both_gbs"], out["host_traffic_alone_gbs"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
