"""DeepSpeed as a peer of bench/dist_bench.py: ZeRO-3 with parameters and optimizer state
offloaded to pinned DRAM ("deepspeed") or to NVMe (ZeRO-Infinity, "deepspeed-nvme"), and the
check of what this machine can run before any job starts.

DeepSpeed is not part of the repository and the GPU machines do not have it: it travels as
wheels (bench/dist_peers.sh --wheels). Its CPU Adam (DeepSpeedCPUAdam, the optimizer both
offload modes step on the CPU) and its async I/O op (libaio, which ZeRO-Infinity's swapping
needs) are compiled on first use (ninja and nvcc on the machine); `status()` builds them once,
timed, so that no run's setup pays for the compile and a machine without libaio is reported
("ZeRO-Infinity: skipped, libaio missing") rather than crashing a run."""
import json
import os
import signal
import subprocess
import sys
import time


def config(rows, clip, nvme_path=None, largest_param=0, param_buffers=16):
    """The ZeRO-3 configuration of a run: bf16, AdamW (lr 1e-4, weight decay 0.1, as every
    dist_bench run), gradient clipping `clip`, `rows` per GPU, one micro-batch a step.
    Offloaded to pinned DRAM, or, with nvme_path, ZeRO-Infinity: parameters and optimizer state
    in files under nvme_path through the async I/O op. Its parameter swap buffers must each hold
    the largest parameter (largest_param elements: the embedding or the head) and there must be
    enough for two blocks' parameters at once (the one computing and the one prefetched): with
    the documented 5, the second step's forward pass fails "Not enough buffers 0 for swapping 1"
    (DeepSpeed issue 3062)."""
    if nvme_path:
        offload_param = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                         "buffer_count": param_buffers,
                         "buffer_size": int(largest_param * 1.05)}
        offload_optimizer = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                             "buffer_count": 4}
    else:
        offload_param = {"device": "cpu", "pin_memory": True}
        offload_optimizer = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
        "gradient_clipping": clip, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": offload_param,
                              "offload_optimizer": offload_optimizer},
        # ZeRO-Infinity's documented settings for its async I/O (libaio).
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 1 << 30,  # its own step log would interleave with the bench's
    }


# Run in a child process (a compile failure, or DeepSpeed's import of CUDA, must not take the
# driver with it): one JSON line.
_PROBE = r"""
import json, sys, time
out = {}
def first_line(e):
    return "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
try:
    import deepspeed
    out["version"] = deepspeed.__version__
except Exception as e:
    out["error"] = "DeepSpeed not importable: %s: %s" % (type(e).__name__, str(e)[:200])
    print(json.dumps(out)); sys.exit(0)
build = sys.argv[1] == "1"
build_aio = build and sys.argv[2] == "1"
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
t = time.perf_counter()
try:
    if build:
        CPUAdamBuilder().load()
        out["cpu_adam_build_seconds"] = time.perf_counter() - t
    else:
        out["cpu_adam"] = "not built (no CUDA run)"
except Exception as e:
    out["cpu_adam_error"] = first_line(e)
try:
    ok = AsyncIOBuilder().is_compatible(verbose=True)
except Exception as e:
    ok, out["aio_error"] = False, first_line(e)
out["aio"] = bool(ok)
if ok and build_aio:
    t = time.perf_counter()
    try:
        AsyncIOBuilder().load()
        out["aio_build_seconds"] = time.perf_counter() - t
    except Exception as e:
        out["aio"] = False
        out["aio_error"] = first_line(e)
print(json.dumps(out))
"""


def status(build, timeout=420, aio=True):
    """What DeepSpeed can do on this machine, as a dict: "version" (or "error": not
    importable), "aio" (whether its async I/O op compiles and links against libaio here) and,
    with build, the seconds its CPU Adam and (with aio) async I/O ops took to compile (cached
    in torch's extension directory for the runs that follow), or why they failed. aio=False
    where no ZeRO-Infinity run follows: its op took about 65 s of every device call on the
    4-GPU host to compile (2026-11-28), for runs that never load it."""
    t = time.perf_counter()
    # In a session of its own: on timeout the compilers it started go with it.
    proc = subprocess.Popen([sys.executable, "-c", _PROBE, "1" if build else "0",
                             "1" if aio else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": "DeepSpeed's ops did not build in %d s" % timeout, "aio": False}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]
        return {"error": "DeepSpeed check failed: %s" % tail[:300], "aio": False}
    out = json.loads(lines[-1])
    out["check_seconds"] = time.perf_counter() - t
    return out


def unavailable(mode, ds):
    """Why `mode` ("deepspeed" or "deepspeed-nvme") cannot run given status() ds, or None."""
    if "error" in ds:
        return ds["error"]
    if "cpu_adam_error" in ds:
        return "DeepSpeedCPUAdam does not build: " + ds["cpu_adam_error"]
    if mode == "deepspeed-nvme" and not ds.get("aio"):
        return "libaio missing" + (" (%s)" % ds["aio_error"] if "aio_error" in ds else "")
    return None
