#!/usr/bin/env python3
"""Data-parallel training throughput of Hugging Face Llama models streamed through Strata on
1 and N GPUs (issue 16), next to its peers on the same N GPUs in the same run (issue 39): PyTorch
FSDP2 with CPUOffloadPolicy, DeepSpeed ZeRO-3 offloading to the CPU and to NVMe
(ZeRO-Infinity), MegaTrain's data-parallel mode. Each configuration runs in its own job (so its
peak memory is its own; a job that outlives its time is killed with all its processes);
NCCL_NVLS_ENABLE=0 is set for every job.

    python bench/dist_bench.py --models 3.6b,8b --gpus 2 --batch 16 --seq 1024 --steps 3

Runs (--runs, comma-separated MODE:GPUS[:ROWS], ROWS in units of --batch per GPU, default 1):
    strata:1      one GPU, --batch rows per step       (the throughput baseline)
    strata:2      two GPUs, --batch rows each          (tokens/s >= 1.9x strata:1 is the goal)
    strata:1:2    one GPU, twice the rows              (the losses strata:2 must equal)
    fsdp2:2       FSDP2 + CPUOffloadPolicy, two GPUs, process group cuda:nccl,cpu:gloo (its
                  clip_grad_norm_ reduces over CPU-offloaded parameters)
    deepspeed:2   DeepSpeed ZeRO-3, params and optimizer offloaded to the CPU, two GPUs
    deepspeed-nvme:2  ZeRO-Infinity: params and optimizer state on NVMe (files under
                  --nvme-dir), two GPUs; reported as skipped where libaio is missing
    megatrain:2   MegaTrain's data-parallel mode (--megatrain-dir: its source tree, not part of
                  the repository; bench/megatrain_peer.py), --batch rows per GPU
Every job's ranks get --threads CPU threads each (default: the host's cores over its GPUs, the
per-process share that PyTorch's and DeepSpeed's docs recommend rather than torchrun's
OMP_NUM_THREADS=1), set as OMP_NUM_THREADS and torch.set_num_threads and reported; MegaTrain's
one optimizer process, which updates the whole model alone, gets that times its GPUs.
Every run trains on the same two batches in turn (random tokens, seeded), each rank on its
slice of the step's rows, from the same weights (a seeded init that every rank computes alike,
much faster than Hugging Face's for 8B; DeepSpeed's are its own, see setup_deepspeed), with
AdamW (lr 1e-4, weight decay 0.1), bf16, and clip_grad_norm_(model.parameters(), --clip) before
every step. Reported per run: tokens/s over
all GPUs, TFLOPS (6 P T / t) per GPU, median step time after warm-up, each step's loss (the mean
over all ranks' rows), peak host memory (VmHWM summed over ranks) and device memory (per GPU,
torch's peak plus Strata's HBM arena), setup time. Then per model: the scaling of strata over
GPUs, the largest relative loss difference between strata:N and strata:1:N, and strata:N
against each peer. --budget bounds the whole series: each run's time limit is what is left of
it, the slowest peers go last. --json and --markdown write the results and the summary.

Staged builds: set STRATA_LIBRARY to the libstrata.so to use (e.g. .gpubuild/new/libstrata.so.1);
bindings/python of this tree is put on the path. On a machine without GPUs, --device cpu runs
the same code on Strata's host backend under gloo, for checking the script (--models tiny).
"""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))

from dist_job import MODES, PROGRESS, hf_config, measured, parameters, run_job, run_megatrain_job  # noqa: E402
from host_memory import grow_host_memory, mem_available  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

PEERS = ("megatrain", "deepspeed", "fsdp2", "deepspeed-nvme")


# --- the driver ------------------------------------------------------------------------------

def parse_run(spec):
    parts = spec.split(":")
    if parts[0] not in MODES or not 2 <= len(parts) <= 3:
        raise ValueError("run %r: MODE:GPUS[:ROWS] with MODE in %s" % (spec, sorted(MODES)))
    gpus, mult = int(parts[1]), int(parts[2]) if len(parts) == 3 else 1
    if gpus < 1 or mult < 1:
        raise ValueError("run %r: GPUS and ROWS are at least 1" % spec)
    if parts[0] != "strata" and mult != 1:
        raise ValueError("run %r: ROWS is for strata's loss references only" % spec)
    return parts[0], gpus, mult


def default_runs(n):
    """Strata's baseline, its N-GPU run and the loss reference, then every peer on N GPUs,
    slowest last."""
    return "strata:1,strata:%d,strata:1:%d," % (n, n) + ",".join("%s:%d" % (m, n) for m in PEERS)


def host_cores():
    return len(os.sched_getaffinity(0))


def threads_per_rank(args, runs):
    """--threads, else the host's cores over its GPUs (with --device cpu: over the most ranks
    a run has): what one process a GPU gets when every process of the host gets its share."""
    if args.threads:
        return args.threads
    if args.device == "cuda":
        gpus = args.host_gpus or max(g for _, g, _ in runs)
    else:
        gpus = max(g for _, g, _ in runs)
    return max(1, host_cores() // max(1, gpus))


def unavailable(mode, args, ds):
    """Why a run of `mode` cannot run here (a string), or None. ds: deepspeed_peer.status()."""
    if mode in ("deepspeed", "deepspeed-nvme"):
        if args.device != "cuda":
            return "DeepSpeed's offload needs CUDA"
        import deepspeed_peer
        return deepspeed_peer.unavailable(mode, ds)
    if mode == "megatrain" and not args.megatrain_dir:
        return "no --megatrain-dir (MegaTrain's source tree is not part of the repository)"
    return None


def job_command(args, mode, gpus, mult, model_name, threads, nvme_dir=None):
    """The command line of one run: a torchrun job of `gpus` ranks, or for MegaTrain one process
    that spawns its own workers."""
    one = [__file__, "--one", mode, model_name, "--batch", str(args.batch * mult),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--clip", str(args.clip), "--device", args.device, "--threads", str(threads)]
    if args.resident_blocks is not None and mode == "strata":
        one += ["--resident-blocks", str(args.resident_blocks)]
    if args.accum > 1:
        one += ["--accum", str(args.accum)]
    if nvme_dir and mode == "strata":
        one += ["--strata-nvme", nvme_dir]
    if args.strata_grads != "host" and mode == "strata":
        one += ["--strata-grads", args.strata_grads]
    if mode == "megatrain":
        return [sys.executable] + one + ["--gpus", str(gpus), "--megatrain-dir",
                                         os.path.abspath(args.megatrain_dir)]
    if nvme_dir and mode == "deepspeed-nvme":
        one += ["--nvme-dir", nvme_dir]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(gpus)] + one


def job_env(threads):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bindings" / "python"),
                                                      str(ROOT / "bench"),
                                                      env.get("PYTHONPATH")]))
    return env


def kill_group(proc):
    """The job and every process it started (torchrun's ranks, MegaTrain's workers, compilers):
    SIGTERM, then SIGKILL what is left after 10 s. They run in their own session."""
    import signal
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


# A traceback's last line, "[rankN]: " prefix allowed: an exception's (dotted) class name, then
# its message. Strata's exceptions are named for their status (strata.errors.OutOfMemory), not
# ...Error, so the class is matched by its shape, not by its name's ending.
_RAISED = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Z]\w*: \S.*)$")


def first_error(stderr, returncode):
    """The first exception a rank raised, rather than torchrun's summary of it (or its own
    progress lines)."""
    err = stderr.strip().splitlines()
    raised = [m.group(1) for m in map(_RAISED.match, err)
              if m and "elastic" not in m.group(1) and "ChildFailedError" not in m.group(1)]
    return (raised or err or ["exit %d" % returncode])[0][:400]


def from_progress(stderr, warmup, tokens):
    """What the progress lines of a run that was stopped say: its measured steps so far."""
    times, losses = [], []
    for line in stderr.splitlines():
        if line.startswith(PROGRESS + "step "):
            words = line[len(PROGRESS):].split()
            i, seconds = int(words[1]), float(words[-6])
            losses.append(float(words[-3]))
            if i >= warmup:
                times.append(seconds)
    return times, losses


def launch(args, mode, gpus, mult, model_name, threads, timeout, log=None):
    nvme_dir = None
    if mode == "deepspeed-nvme" or (mode == "strata" and args.strata_nvme):
        # A directory of this run's own under the one given, removed after it however it ends
        # (strata's tier files are per rank, named by the library under data parallelism).
        root = args.nvme_dir if mode == "deepspeed-nvme" else args.strata_nvme
        nvme_dir = os.path.join(os.path.abspath(root), "dist_bench.%d.%s-%d" % (
            os.getpid(), mode, gpus))
        os.makedirs(nvme_dir, exist_ok=True)
    cmd = job_command(args, mode, gpus, mult, model_name, threads, nvme_dir)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job_env(threads), start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        stdout, stderr = proc.communicate()
    finally:
        if nvme_dir:
            # Its swap files (tens of GB) would otherwise crowd the next run off the disk.
            import shutil
            shutil.rmtree(nvme_dir, ignore_errors=True)
    if log:
        pathlib.Path(log).write_text("$ %s\n--- stdout\n%s\n--- stderr\n%s" % (
            " ".join(cmd), stdout, stderr))
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if timed_out:
        result = {"error": "timed out after %d s" % timeout}
        times, losses = from_progress(stderr, args.warmup,
                                      args.batch * args.accum * mult * gpus * args.seq)
        if times:  # what it measured before the limit: reported as such
            params = parameters(hf_config(model_name))
            result.update(params=params, partial="%d measured steps before the time limit"
                          % len(times))
            measured(result, times, losses, args.batch * args.accum * mult * gpus * args.seq,
                     gpus)
        elif losses:
            result["losses"] = losses
        result["last_output"] = stderr.strip().splitlines()[-1][:300] if stderr.strip() else ""
        return result
    if lines and proc.returncode != 0:  # measured, then failed on the way out: say so
        result = json.loads(lines[-1])
        result["exit"] = "exit code %d after the results" % proc.returncode
        return result
    if proc.returncode != 0 or not lines:
        return {"error": first_error(stderr, proc.returncode)}
    return json.loads(lines[-1])


def max_relative(a, b):
    pairs = list(zip(a or [], b or []))
    if not pairs:
        return None
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in pairs)


# The largest relative loss difference still "equal within bf16 tolerance": bf16's unit
# roundoff (2^-8), the rounding of one bf16 value.
BF16_TOLERANCE = 2.0 ** -8


def summarize(results, models, gpus):
    lines = []
    for m in models:
        by = {(r["mode"], r["gpus"], r.get("mult", 1)): r for r in results
              if r["model"] == m and "tokens_per_second" in r and "partial" not in r}
        one, many, double = by.get(("strata", 1, 1)), by.get(("strata", gpus, 1)), \
            by.get(("strata", 1, gpus))
        if one and many:
            lines.append("%-5s strata %d GPUs / 1 GPU = %.3f (tokens/s, same rows per GPU; "
                         "goal >= %.1f)" % (m, gpus, many["tokens_per_second"] /
                                            one["tokens_per_second"], 0.95 * gpus))
        if many and double:
            worst = max_relative(many["losses"], double["losses"])
            lines.append("%-5s strata losses, %d GPUs vs 1 GPU with %dx the rows: largest "
                         "relative difference %.2e (%s bf16's 2^-8)" % (
                             m, gpus, gpus, worst,
                             "within" if worst <= BF16_TOLERANCE else "NOT within"))
        for peer in PEERS:
            p = by.get((peer, gpus, 1))
            if many and p:
                lines.append("%-5s strata / %-14s on %d GPUs = %.3f (tokens/s; goal >= 3)" % (
                    m, peer, gpus, many["tokens_per_second"] / p["tokens_per_second"]))
        mt = by.get(("megatrain", gpus, 1))
        if mt and double:  # the same weights and rows: its losses should follow Strata's
            worst = max_relative(mt["losses"], double["losses"])
            lines.append("%-5s megatrain losses vs strata 1 GPU with %dx the rows: largest "
                         "relative difference %s" % (m, gpus, "%.2e" % worst
                                                     if worst == worst else "nan"))
    return lines


def run_name(mode, gpus, mult):
    return "%s:%d%s" % (mode, gpus, ":%d" % mult if mult != 1 else "")


def describe(model_name, r):
    name = run_name(r["mode"], r["gpus"], r.get("mult", 1))
    if "skipped" in r:
        return "%-5s %-17s skipped: %s" % (model_name, name, r["skipped"])
    if "dry_run" in r:
        return "%-5s %-17s dry run: %s" % (model_name, name, r["dry_run"])
    if "tokens_per_second" not in r:
        return "%-5s %-17s failed: %s" % (model_name, name, r["error"])
    return ("%-5s %-17s %8.0f tokens/s  %6.1f TFLOPS/GPU (6PT/t)  step %.2f s  host %.1f GB  "
            "device %.1f GB/GPU  setup %.0f s  threads %s  losses %s %s%s" % (
                model_name, name, r["tokens_per_second"], r["tflops_6pt_per_gpu"],
                r["step_seconds"], r.get("peak_host_gb", 0), r.get("peak_device_gb", 0),
                r.get("setup_seconds", 0), r.get("cpu_threads", "?"),
                " ".join("%.4f" % x for x in r["losses"]), r.get("layout", ""),
                "  [%s: %s]" % (r["error"], r["partial"]) if "partial" in r else ""))


def markdown(results, summary, header):
    rows = ["| run | tokens/s | TFLOPS/GPU (6PT/t) | step s | setup s | CPU threads | "
            "host GB | losses |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        name = "%s %s" % (r["model"], run_name(r["mode"], r["gpus"], r.get("mult", 1)))
        if "tokens_per_second" in r:
            rows.append("| %s%s | %.0f | %.1f | %.2f | %.0f | %s | %.1f | %s |" % (
                name, " (partial: %s)" % r["partial"] if "partial" in r else "",
                r["tokens_per_second"], r["tflops_6pt_per_gpu"], r["step_seconds"],
                r.get("setup_seconds", 0), r.get("cpu_threads", ""), r.get("peak_host_gb", 0),
                " ".join("%.4f" % x for x in r["losses"])))
        else:
            why = r.get("skipped") and "skipped: " + r["skipped"] or r.get("dry_run") \
                or "failed: " + r.get("error", "?")
            rows.append("| %s | %s | | | | | | |" % (name, why.replace("|", "/")))
    return "\n".join(header + [""] + rows + [""] + ["- " + line for line in summary]) + "\n"


def add_step_options(p):
    """The options of a measured step every data-parallel bench takes (this one, dist_hosts):
    rows per GPU, sequence, timed and warm-up steps, clipping, device."""
    p.add_argument("--batch", type=int, default=16, help="rows per GPU per step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")


# The modes whose step (plain_step) accumulates --accum micro-batches. DeepSpeed takes
# accumulation in its config and MegaTrain in its own; neither is wired here, and one batch of
# batch x accum rows would measure another step.
ACCUMULATES = ("strata", "fsdp2")


def check_accum(p, args, modes):
    """--accum's rules for the runs of `modes`, refused through the parser p."""
    if args.accum < 1:
        p.error("--accum %d: at least 1 micro-batch a step" % args.accum)
    if args.accum > 1 and any(m not in ACCUMULATES for m in modes):
        p.error("--accum %d: only strata and fsdp2 runs accumulate here (runs: %s)"
                % (args.accum, ",".join(modes)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="3.6b,8b")
    p.add_argument("--gpus", type=int, default=2, help="N in the default runs")
    p.add_argument("--runs", default=None,
                   help="MODE:GPUS[:ROWS] list (default strata:1,strata:N,strata:1:N, then "
                        "megatrain,deepspeed,fsdp2,deepspeed-nvme on N GPUs)")
    add_step_options(p)
    p.add_argument("--resident-blocks", type=int, default=None,
                   help="strata: blocks kept in HBM (default: strata.torch.offload's choice)")
    p.add_argument("--accum", type=int, default=1,
                   help="micro-batches of --batch rows per GPU in each optimizer step "
                        "(strata, fsdp2; gradient accumulation as users write it)")
    p.add_argument("--strata-nvme", default=None,
                   help="strata: a directory for an NVMe tier, one file a rank "
                        "(st.offload(nvme=...): the state DRAM cannot hold goes there)")
    p.add_argument("--strata-grads", choices=["host", "device"], default="host",
                   help="strata: where the streamed blocks' grads live (st.offload(grads=...)); "
                        "under data parallelism 'device' keeps each rank's fp32 gradient sums "
                        "in HBM, added to in place (no DRAM grads, no accumulators)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads of each rank (default: the host's cores over its GPUs)")
    p.add_argument("--host-gpus", type=int, default=0,
                   help="GPUs of the host, for --threads' default (default: the most a run has)")
    p.add_argument("--megatrain-dir", default=None,
                   help="MegaTrain's source tree (its infinity package), for megatrain runs")
    p.add_argument("--nvme-dir", default=str(ROOT / ".dist_bench_nvme"),
                   help="deepspeed-nvme: its swap files go to a directory under this one "
                        "(removed after the run)")
    p.add_argument("--run-timeout", type=int, default=900, help="seconds per run at most")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole series (0: none); each run's limit is what is "
                        "left of it, a run with less than --min-run seconds left is skipped")
    p.add_argument("--min-run", type=float, default=45)
    p.add_argument("--host-memory", type=float, default=0,
                   help="GB of MemAvailable to make sure of first, touching memory where the "
                        "VM grows its RAM on demand (nvidia-h200-x2 starts at ~31 GiB)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--markdown", default=None, help="also write a table and the summary here")
    p.add_argument("--logs", default=None, help="a directory for each run's output")
    p.add_argument("--plan", action="store_true",
                   help="print the runs, their threads and what is unavailable; run nothing")
    p.add_argument("--one", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        check_accum(p, args, [args.one[0]])
        if args.one[0] == "megatrain":
            run_megatrain_job(args.one[1], args.batch, args.gpus, args.seq, args.steps,
                              args.warmup, args.clip, args.device, args.threads,
                              args.megatrain_dir)
        else:
            run_job(args.one[0], args.one[1], args.batch, args.seq, args.steps, args.warmup,
                    args.clip, args.device, args.resident_blocks, max(1, args.threads),
                    args.nvme_dir if args.one[0] == "deepspeed-nvme" else None,
                    args.accum, args.strata_nvme, args.strata_grads)
        return
    t_start = time.perf_counter()
    n = args.gpus
    try:
        runs = [parse_run(s) for s in (args.runs or default_runs(n)).split(",")]
    except ValueError as e:
        p.error(str(e))
    check_accum(p, args, [m for m, _, _ in runs])
    if args.megatrain_dir:
        import megatrain_peer
        megatrain_peer.load(args.megatrain_dir)  # a wrong tree refused before anything runs
    models = args.models.split(",")
    threads = threads_per_rank(args, runs)
    print("CPU threads: %d a rank (%d cores on this host; OMP_NUM_THREADS and "
          "torch.set_num_threads in every job)" % (threads, host_cores()), flush=True)
    ds = {}
    if any(m.startswith("deepspeed") or m == "megatrain" for m, _, _ in runs) \
            and not args.plan and args.device == "cuda":
        # DeepSpeed's ops built once, before any run (MegaTrain steps DeepSpeedCPUAdam too).
        import deepspeed_peer
        ds = deepspeed_peer.status(build=True, timeout=int(min(300, args.budget / 2))
                                   if args.budget else 300,
                                   aio=any(m == "deepspeed-nvme" for m, _, _ in runs))
        print("deepspeed: %s" % json.dumps(ds), flush=True)
    if any(m == "deepspeed-nvme" for m, _, _ in runs) and not args.plan \
            and unavailable("deepspeed-nvme", args, ds):
        print("ZeRO-Infinity: skipped, %s" % unavailable("deepspeed-nvme", args, ds), flush=True)
    if args.plan:
        for mode, gpus, mult in runs:
            why = "DeepSpeed and libaio checked when it runs" if mode.startswith(
                "deepspeed") and args.device == "cuda" else unavailable(mode, args, ds)
            print("%-17s threads %d%s" % (run_name(mode, gpus, mult),
                                          threads * gpus if mode == "megatrain" else threads,
                                          "  unavailable: " + why if why and "checked" not in why
                                          else "  (%s)" % why if why else ""), flush=True)
        return
    if args.host_memory:
        seconds = grow_host_memory(int(args.host_memory * 1e9))
        print("host memory: %.0f GB available (%.0f s to grow it; %.0f GB asked for)"
              % (mem_available() / 1e9, seconds, args.host_memory), flush=True)
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    results = []
    for model_name in models:
        for mode, gpus, mult in runs:
            left = args.budget - (time.perf_counter() - t_start) if args.budget else None
            why = unavailable(mode, args, ds)
            if why is None and left is not None and left < args.min_run:
                why = "no time left (%.0f s of --budget %.0f)" % (max(left, 0), args.budget)
            t0 = time.perf_counter()
            if why:
                r = {"skipped": why}
            else:
                timeout = int(min(args.run_timeout, left) if left is not None
                              else args.run_timeout)
                log = os.path.join(args.logs, "%s_%s.log" % (
                    model_name, run_name(mode, gpus, mult).replace(":", "-"))) \
                    if args.logs else None
                r = launch(args, mode, gpus, mult, model_name, threads, timeout, log)
            r.update(mode=mode, model=model_name, gpus=gpus, mult=mult,
                     wall_seconds=time.perf_counter() - t0)
            results.append(r)
            print(describe(model_name, r), flush=True)
    summary = summarize(results, models, n)
    for line in summary:
        print(line, flush=True)
    print("series: %.0f s" % (time.perf_counter() - t_start), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"threads_per_rank": threads, "host_cores": host_cores(), "deepspeed": ds,
             "results": results, "summary": summary}, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(markdown(results, summary, [
            "# bench/dist_bench.py: %s, %d x %d tokens per GPU%s, clip %g, %d CPU threads a rank"
            % (",".join(models), args.batch * args.accum, args.seq,
               " (%d micro-batches of %d rows)" % (args.accum, args.batch) if args.accum > 1
               else "", args.clip, threads)]))


if __name__ == "__main__":
    main()
