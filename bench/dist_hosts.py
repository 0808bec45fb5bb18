#!/usr/bin/env python3
"""Hosts stood in for by processes (issue 39, item 4): HSDP against the optimizer state sharded
across the hosts (strata.torch.DataParallel(state_across_hosts=True)), Hugging Face Llama
streamed through Strata, one process a GPU, each process one "host" (shard_size=1).

    python bench/dist_hosts.py --model 3.6b --gpus 2 --batch 16 --seq 1024 --out DIR

Runs, each a torchrun job of its own (its peak memory its own):
    one      1 GPU, --gpus x --batch rows per step: the losses both layouts must equal
    hsdp     --gpus ranks as --gpus hosts of 1 GPU: every host the whole optimizer state, the
             grads all-reduced across the hosts
    pieces   the same ranks with state_across_hosts=True: each host 1/--gpus of the state, the
             grads reduce-scattered and the updated pieces all-gathered across the hosts
--transport socket makes NCCL carry the cross-host collectives over its socket transport
(NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1: what hosts without NVLink between them use), so the
network's cost shows; nvlink (default) leaves NCCL its fastest path between the GPUs.

Reported per run: tokens/s, step time (median after warm-up), each step's loss, per rank the
optimizer state bytes in DRAM (Strata's stats), the DRAM arena, the host replica of the weights
(pieces), the peak host memory (VmHWM), and the bytes each rank sends across the hosts per step:
counted from the cross-host collectives the layout issued, the residents' grads' all-reduce
included (all-reduce 2(H-1)/H of its tensor, reduce-scatter and all-gather (H-1)/H of the
whole), as a ring algorithm moves them. Writes
DIR/results.json, DIR/summary.md and DIR/<run>.log. --device cpu runs the same code under gloo
on Strata's host backend (--model tiny), for checking the script."""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "bindings" / "python"))
sys.path.insert(0, str(HERE))

import dist_job  # noqa: E402 (the job side: shapes, data, step)
import dist_bench  # noqa: E402  (its launching and reading of a job)
from host_memory import peak_host_bytes  # noqa: E402

RUNS = ("one", "hsdp", "pieces")


def count_network(mesh):
    """Wrap the mesh's cross-host collectives so each call adds the bytes this rank sends in a
    ring algorithm; returns the counter ({"bytes": n})."""
    counter = {"bytes": 0}
    hosts = mesh.replicas

    def counted(name, share, size_of):
        call = getattr(mesh, name)

        def wrapper(*args, **kwargs):
            counter["bytes"] += int(share * size_of(args))
            return call(*args, **kwargs)
        setattr(mesh, name, wrapper)

    def nbytes(t):
        return t.numel() * t.element_size()
    ring = (hosts - 1) / hosts
    counted("average_replicas", 2 * ring, lambda a: nbytes(a[0]))  # all-reduce
    counted("scatter_pieces", ring, lambda a: nbytes(a[1]))  # reduce-scatter of the chunk
    counted("gather_pieces", ring, lambda a: nbytes(a[0]))  # all-gather into the chunk
    # The resident parameters' grads, all-reduced over every rank: each rank a host here
    # (shard_size=1), so all of it crosses the hosts.
    counted("average_all", 2 * (mesh.world - 1) / mesh.world, lambda a: nbytes(a[0]))
    return counter


def job(run, model_name, rows, seq, steps, warmup, clip, device_kind, threads):
    """One rank of one run (under torchrun)."""
    import torch
    import torch.distributed as dist
    import strata.torch as st
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(threads)
    if device_kind == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    config = dist_job.hf_config(model_name)
    batches = dist_job.data(config, rows * world, seq)
    mine = [b[rank * rows:(rank + 1) * rows] for b in batches]
    t0 = time.perf_counter()
    options = False if run == "one" else st.DataParallel(
        shard_size=1, broadcast=False, state_across_hosts=run == "pieces")
    model = st.offload(dist_job.meta_model(config), device=device, dtype=torch.bfloat16,
                       data_parallel=options)
    opt = st.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    session = model.strata
    counter = count_network(session.mesh) if session.mesh is not None else {"bytes": 0}
    step = dist_job.plain_step(model, opt, clip)
    setup = time.perf_counter() - t0
    times, losses, sent = [], [], []
    for i in range(warmup + steps):
        ids = mine[i % 2].to(device, non_blocking=True)
        dist_job.sync(device)
        dist.barrier()
        before = counter["bytes"]
        start = time.perf_counter()
        loss = step(ids).detach().float().reshape(())
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        dist_job.sync(device)
        elapsed = time.perf_counter() - start
        sent.append(counter["bytes"] - before)
        if i >= warmup:
            times.append(elapsed)
        if rank == 0:
            dist_job.progress(i, warmup, elapsed, losses[-1], rows * world * seq)
    session.optimizer.synchronize()
    stats = session.optimizer.stats()
    replica = getattr(session.layout, "replica", None)
    mine_host = {"state_bytes": stats["state_bytes"], "params": stats["params"],
                 "elements": stats["elements"],
                 "arena_bytes": session.runtime.capabilities().tier_budget_bytes[1],
                 "replica_bytes": replica.host_bytes if replica is not None else 0,
                 "peak_host_bytes": peak_host_bytes(),
                 "network_bytes_per_step": sent[-1]}
    every = [None] * world
    dist.all_gather_object(every, mine_host)
    out = {"run": run, "model": model_name, "params": dist_job.parameters(config),
           "gpus": world, "rows_per_gpu": rows, "seq": seq, "setup_seconds": setup,
           "ranks": every, "layout": session.mesh.describe() if session.mesh else "one GPU"}
    dist_job.measured(out, times, losses, rows * world * seq, world)
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    session.close()
    dist.destroy_process_group()


def launch(args, run, out_dir):
    gpus = 1 if run == "one" else args.gpus
    rows = args.batch * (args.gpus if run == "one" else 1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(gpus), __file__, "--job", run, "--model", args.model, "--batch", str(rows),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--clip", str(args.clip), "--device", args.device, "--threads", str(args.threads)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=str(args.threads))
    if args.transport == "socket" and run != "one":
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bindings" / "python"),
                                                      str(HERE), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        dist_bench.kill_group(proc)
        stdout, stderr = proc.communicate()
        stderr += "\ntimed out after %d s" % args.run_timeout
    (out_dir / ("%s.log" % run)).write_text("$ %s\n--- stdout\n%s\n--- stderr\n%s" % (
        " ".join(cmd), stdout, stderr))
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        result = {"run": run, "error": dist_bench.first_error(stderr, proc.returncode or 1)}
    else:
        result = json.loads(lines[-1])
    result["wall_seconds"] = time.perf_counter() - t0
    return result


def size(n):
    return "%.2f GB" % (n / 1e9) if n >= 1e8 else "%.2f MB" % (n / 1e6)


def summarize(results, gpus):
    by = {r["run"]: r for r in results if "tokens_per_second" in r}
    lines = []
    one = by.get("one")
    for run in ("hsdp", "pieces"):
        r = by.get(run)
        if r and one:
            worst = dist_bench.max_relative(r["losses"], one["losses"])
            lines.append("%s losses vs 1 GPU with %dx the rows: largest relative difference "
                         "%.2e (%s bf16's 2^-8)" % (run, gpus, worst, "within" if worst <=
                                                   dist_bench.BF16_TOLERANCE else "NOT within"))
    h, p = by.get("hsdp"), by.get("pieces")
    if h and p:
        worst = dist_bench.max_relative(p["losses"], h["losses"])
        lines.append("pieces losses vs hsdp: largest relative difference %.2e (%s bf16's 2^-8)"
                     % (worst, "within" if worst <= dist_bench.BF16_TOLERANCE else "NOT within"))
        state = [a["state_bytes"] / max(1, b["state_bytes"])
                 for a, b in zip(p["ranks"], h["ranks"])]
        lines.append("pieces / hsdp: tokens/s %.3f; optimizer state per rank %s (1/%d = %.3f "
                     "expected); network bytes per rank per step %s vs %s" % (
                         p["tokens_per_second"] / h["tokens_per_second"],
                         " ".join("%.3f" % s for s in state), gpus, 1 / gpus,
                         size(p["ranks"][0]["network_bytes_per_step"]),
                         size(h["ranks"][0]["network_bytes_per_step"])))
    return lines


def markdown(results, summary, header):
    rows = ["| run | tokens/s | step s | setup s | state GB/rank | arena GB/rank | "
            "host replica GB/rank | peak host GB/rank | network GB/rank/step | losses |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "tokens_per_second" not in r:
            rows.append("| %s | failed: %s |||||||||" % (r["run"], r["error"].replace("|", "/")))
            continue
        rank = r["ranks"][0]
        rows.append("| %s | %.0f | %.2f | %.0f | %.2f | %.2f | %.2f | %.1f | %.2f | %s |" % (
            r["run"], r["tokens_per_second"], r["step_seconds"], r["setup_seconds"],
            rank["state_bytes"] / 1e9, rank["arena_bytes"] / 1e9, rank["replica_bytes"] / 1e9,
            max(x["peak_host_bytes"] for x in r["ranks"]) / 1e9,
            rank["network_bytes_per_step"] / 1e9, " ".join("%.4f" % x for x in r["losses"])))
    return "\n".join(header + [""] + rows + [""] + ["- " + line for line in summary]) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="3.6b", choices=sorted(dist_job.CONFIGS))
    p.add_argument("--gpus", type=int, default=2, help="processes standing in for hosts")
    dist_bench.add_step_options(p)
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads a rank (default: the host's cores over --gpus)")
    p.add_argument("--transport", choices=["nvlink", "socket"], default="nvlink")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--run-timeout", type=int, default=240)
    p.add_argument("--out", default="dist_hosts_out")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.threads:
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.gpus)
    if args.job:
        job(args.job, args.model, args.batch, args.seq, args.steps, args.warmup, args.clip,
            args.device, args.threads)
        return
    runs = args.runs.split(",")
    if any(r not in RUNS for r in runs):
        p.error("--runs: a list of %s" % ", ".join(RUNS))
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for run in runs:
        r = launch(args, run, out_dir)
        results.append(r)
        if "tokens_per_second" in r:
            rank = r["ranks"][0]
            print("%-6s %8.0f tokens/s  step %.2f s  setup %.0f s  state %s/rank  "
                  "host replica %s/rank  network %s/rank/step  losses %s" % (
                      run, r["tokens_per_second"], r["step_seconds"], r["setup_seconds"],
                      size(rank["state_bytes"]), size(rank["replica_bytes"]),
                      size(rank["network_bytes_per_step"]),
                      " ".join("%.4f" % x for x in r["losses"])), flush=True)
        else:
            print("%-6s failed: %s" % (run, r["error"]), flush=True)
    summary = summarize(results, args.gpus)
    for line in summary:
        print(line, flush=True)
    (out_dir / "results.json").write_text(json.dumps({"results": results, "summary": summary,
                                                      "transport": args.transport,
                                                      "threads": args.threads}, indent=1))
    (out_dir / "summary.md").write_text(markdown(results, summary, [
        "# bench/dist_hosts.py: %s, %d processes as hosts of 1 GPU, %d x %d tokens per GPU, "
        "clip %g, transport %s" % (args.model, args.gpus, args.batch, args.seq, args.clip,
                                   args.transport)]))


if __name__ == "__main__":
    main()
