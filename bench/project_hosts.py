#!/usr/bin/env python3
"""Projected step time of Strata's data parallelism over 2-16 hosts of 8 GPUs, from measured
rates passed in: HSDP (every host the whole optimizer state, grads all-reduced across the hosts)
against the optimizer state sharded across the hosts (DataParallel(state_across_hosts=True)).
docs/architecture.md ("Optimizer state across hosts") derives the bytes; docs/benchmarks/data-parallel.md has
the table ("Across hosts").

    python bench/project_hosts.py                       # 8B, the rates measured on H200s
    python bench/project_hosts.py --model 70b --tokens-per-gpu 8192 --markdown

Per step, with P streamed parameters (bf16, 2 bytes), R resident ones (embedding, head: kept on
every GPU, their grads all-reduced), S GPUs a host, H hosts, T tokens a GPU:
    compute   T x compute-per-token (the measured whole-step rate of one GPU, scaled by P+R)
    PCIe      HSDP: H2D 4P/S (each GPU loads its chunk twice), D2H 2P/S (its grad chunk);
              pieces: H2D 4P/(SH) + 2P/S (its piece twice, the host replica of the chunk for
              the backward pass), D2H 2P/(SH) + 2P/S (its grad piece, the chunk to the replica);
              H2D and D2H run at once (full duplex)
    NVLink    6P(S-1)/S (two all-gathers of weights and one reduce-scatter of grads, in the
              host) + 4R(S-1)/S (the residents' all-reduce, its share in the host); both layouts
    network   a GPU's bytes across the hosts: HSDP 4P(H-1)/(SH) (ring all-reduce of its grad
              chunk), pieces 2P(H-1)/(SH) + 2P(H-1)/(SH) (reduce-scatter of the grad chunk,
              all-gather of the updated pieces): the same; plus the residents' all-reduce,
              4R(H-1)/(SH) (NCCL's rings over every GPU use every GPU's NIC)
    update    per host, HSDP P parameters, pieces P/H, at the host's CPU update rate (cores /
              16 x the rate measured on 16 cores, capped by --dram-bandwidth / 28 bytes a
              parameter when given)
Strata overlaps all of them (the loads and gathers with the forward pass, the reductions and
copies with the backward pass, the update with the next forward pass; one GPU measured 96%
overlap), so the step is the largest, its bottleneck named. Host DRAM per host: HSDP 16P (bf16
weight and grad, fp32 master, two fp32 moments), pieces 16P/H + 2P (the replica of the weights)."""
import argparse

# Hugging Face Llama shapes: (streamed block parameters, resident parameters: embedding + head).
MODELS = {
    "8b": (6.98e9, 1.05e9),
    "70b": (68.45e9, 2.10e9),
    "405b": (401.6e9, 4.20e9),
}
MEASURED_PARAMS = 8.03e9  # the model compute_per_token was measured on (8B)


def step(layout, p, r, hosts, gpus, tokens, args, network_gbps):
    """(seconds of each resource, host DRAM bytes) of one step."""
    s, h = gpus, hosts
    compute = tokens * args.compute_per_token * (p + r) / MEASURED_PARAMS
    if layout == "hsdp":
        h2d, d2h = 4 * p / s, 2 * p / s
        update_params = p
        dram = 16 * p
    else:
        h2d, d2h = 4 * p / (s * h) + 2 * p / s, 2 * p / (s * h) + 2 * p / s
        update_params = p / h
        dram = 16 * p / h + 2 * p
    pcie = max(h2d / args.h2d, d2h / args.d2h)
    nvlink = (6 * p + 4 * r) * (s - 1) / s / args.nvlink
    network = (4 * p + 4 * r) * (h - 1) / (s * h) / (network_gbps * 1e9 / 8)
    rate = args.cores / 16 * args.update_rate
    if args.dram_bandwidth:
        rate = min(rate, args.dram_bandwidth / 28)
    update = update_params / rate
    times = {"compute": compute, "PCIe": pcie, "NVLink": nvlink, "network": network,
             "CPU update": update}
    return times, dram


def table(args):
    p, r = MODELS[args.model] if args.params is None else (args.params, args.resident)
    rows = []
    for network in args.networks:
        for hosts in args.hosts:
            row = {"network_gbps": network, "hosts": hosts}
            for layout in ("hsdp", "pieces"):
                times, dram = step(layout, p, r, hosts, args.gpus, args.tokens_per_gpu, args,
                                   network)
                seconds = max(times.values())
                row[layout] = {"step": seconds, "bottleneck": max(times, key=times.get),
                               "times": times, "dram": dram,
                               "fits": not args.host_dram or dram <= args.host_dram,
                               "tokens_per_second": hosts * args.gpus * args.tokens_per_gpu
                               / seconds}
            rows.append(row)
    return p, r, rows


def render(args, p, r, rows, markdown):
    head = ("%s: %.1fB streamed + %.2fB resident parameters, %d GPUs a host, %d tokens a GPU "
            "a step; compute %.3g s/token (8B), H2D %.0f / D2H %.0f GB/s, NVLink %.0f GB/s, "
            "CPU update %.2g params/s per 16 cores x %d cores%s" % (
                args.model if args.params is None else "model", p / 1e9, r / 1e9, args.gpus,
                args.tokens_per_gpu, args.compute_per_token, args.h2d / 1e9, args.d2h / 1e9,
                args.nvlink / 1e9, args.update_rate, args.cores,
                ", DRAM %.0f GB/s" % (args.dram_bandwidth / 1e9) if args.dram_bandwidth else ""))
    out = []
    if markdown:
        out += [head, "", "| network / GPU | hosts | HSDP step (bottleneck) | tokens/s | "
                "pieces step (bottleneck) | tokens/s | CPU update / host: HSDP, pieces | "
                "DRAM / host: HSDP, pieces |", "|---|---|---|---|---|---|---|---|"]
    else:
        out.append(head)
    for row in rows:
        a, b = row["hsdp"], row["pieces"]

        def fmt(x):
            return "%.2f s (%s)%s" % (x["step"], x["bottleneck"], "" if x["fits"] else
                                       ", DRAM short")
        cells = ["%d Gb/s" % row["network_gbps"], "%d" % row["hosts"], fmt(a),
                 "{:,.0f}".format(a["tokens_per_second"]), fmt(b),
                 "{:,.0f}".format(b["tokens_per_second"]),
                 "%.2f s, %.2f s" % (a["times"]["CPU update"], b["times"]["CPU update"]),
                 "%.0f GB, %.0f GB" % (a["dram"] / 1e9, b["dram"] / 1e9)]
        out.append("| " + " | ".join(cells) + " |" if markdown else "  ".join(cells))
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="8b")
    p.add_argument("--params", type=float, default=None,
                   help="streamed parameters (instead of --model), with --resident")
    p.add_argument("--resident", type=float, default=0.0)
    p.add_argument("--gpus", type=int, default=8, help="GPUs a host")
    p.add_argument("--hosts", default="2,4,8,16")
    p.add_argument("--networks", default="100,200,400", help="Gb/s a GPU across the hosts")
    p.add_argument("--tokens-per-gpu", type=int, default=16384)
    # Measured (docs/benchmarks/data-parallel.md): 4 H200s trained 8B at 31,599 tokens/s (7,900 a GPU);
    # pinned H2D / D2H 53.6 GB/s each, 98.8 GB/s both at once; AdamW 3.6e9 params/s on 16
    # cores. NVLink: NCCL's bus bandwidth on H100/H200 NVLink 4 (not measured here).
    p.add_argument("--compute-per-token", type=float, default=4 / 31599,
                   help="GPU seconds a token for the 8B (scaled by the parameters for others)")
    p.add_argument("--h2d", type=float, default=49.4e9, help="bytes/s a GPU, with D2H running")
    p.add_argument("--d2h", type=float, default=49.4e9)
    p.add_argument("--nvlink", type=float, default=360e9, help="bus bytes/s a GPU in a host")
    p.add_argument("--update-rate", type=float, default=3.6e9, help="params/s on 16 cores")
    p.add_argument("--cores", type=int, default=128, help="CPU cores a host")
    p.add_argument("--dram-bandwidth", type=float, default=0,
                   help="bytes/s of a host's DRAM: caps the update at 28 bytes a parameter")
    p.add_argument("--host-dram", type=float, default=2e12,
                   help="bytes of DRAM a host (0: no check); 'DRAM short' where the layout "
                        "needs more")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    args.hosts = [int(x) for x in args.hosts.split(",")]
    args.networks = [int(x) for x in args.networks.split(",")]
    params, resident, rows = table(args)
    print(render(args, params, resident, rows, args.markdown))


if __name__ == "__main__":
    main()
