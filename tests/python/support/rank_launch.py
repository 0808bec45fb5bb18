"""The ranks of a distributed test's worker as processes of this machine (gloo on the CPU): a
forkserver that imported the heavy modules once, a free port, and the launch with a deadline
(every suite of tests/python/torch/distributed that starts its ranks itself, and
test_jax_data_parallel); a rank's output redirected to its log."""
import multiprocessing
import os
import socket
import time

_SERVERS = {}


def forkserver(*preload):
    """A forkserver that imported `preload` (torch, transformers, strata.torch, the worker)
    once: each rank is a fork of it (a rank importing transformers itself takes seconds)."""
    if preload not in _SERVERS:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        _SERVERS[preload] = ctx
    return _SERVERS[preload]


def redirect_output(log):
    """This process's stdout and stderr to the file `log` (truncated)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(ctx, entry, argv, world, out):
    """`world` processes of entry(["--rank", r] + argv, log), each rank's log beside `out`
    ("OUT.rankR"): (the processes, their logs' paths)."""
    procs, logs = [], []
    for rank in range(world):
        logs.append("%s.rank%d" % (out, rank))
        procs.append(ctx.Process(target=entry, args=(["--rank", str(rank)] + argv, logs[-1])))
        procs[-1].start()
    return procs, logs


def _end(procs, logs, deadline):
    """Each process waited for until `deadline` (time.monotonic()), any still running then
    killed: (exit codes, log texts)."""
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
    texts = []
    for log in logs:
        if not os.path.exists(log):
            texts.append("(the rank wrote no log: it died before it opened one)")
            continue
        with open(log) as f:
            texts.append(f.read())
    return [p.exitcode for p in procs], texts


def launch(ctx, entry, argv, world, out, limit):
    """`world` processes of entry(["--rank", r] + argv, log), each rank's log beside `out`
    ("OUT.rankR"), waited for `limit` s in all, any still running then killed: (exit codes,
    log texts, whether the deadline passed)."""
    procs, logs = _start(ctx, entry, argv, world, out)
    deadline = time.monotonic() + limit
    codes, texts = _end(procs, logs, deadline)
    return codes, texts, time.monotonic() >= deadline


def launch_led_by_rank0(ctx, entry, argv, world, out, limit, grace):
    """As launch, but waited for as torchrun ends a job whose rank failed: rank 0 for at most
    `limit` s, then the rest for up to `grace` s more, any still running then killed: (exit
    codes, log texts, seconds until rank 0 exited)."""
    procs, logs = _start(ctx, entry, argv, world, out)
    start = time.monotonic()
    procs[0].join(limit)
    elapsed = time.monotonic() - start
    codes, texts = _end(procs, logs, start + elapsed + grace)
    return codes, texts, elapsed
