"""The ranks of a distributed test's worker as processes of this machine (gloo on the CPU): a
forkserver that imported the heavy modules once, a free port, and the launch with a deadline
(test_torch_context_parallel, test_torch_trainer_distributed, test_jax_data_parallel); a
rank's output redirected to its log."""
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


def launch(ctx, entry, argv, world, out, limit):
    """`world` processes of entry(["--rank", r] + argv, log), each rank's log beside `out`
    ("OUT.rankR"), waited for `limit` s in all, any still running then killed: (exit codes,
    log texts, whether the deadline passed)."""
    procs, logs = [], []
    for rank in range(world):
        logs.append("%s.rank%d" % (out, rank))
        procs.append(ctx.Process(target=entry, args=(["--rank", str(rank)] + argv, logs[-1])))
        procs[-1].start()
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
    texts = [open(log).read() for log in logs]
    return [p.exitcode for p in procs], texts, time.monotonic() >= deadline
