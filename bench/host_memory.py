"""Host memory as the benchmarks report it, from /proc, and grown where a VM gives it as it is
touched: shared by train_bench.py, dist_bench.py and setup_bench.py."""
import pathlib
import subprocess
import sys
import time


def _proc_field(path, key):
    """The value of `key` (in KiB in /proc) in bytes; 0 where the file or the key is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def mem_available():
    """MemAvailable of /proc/meminfo, bytes."""
    return _proc_field("/proc/meminfo", "MemAvailable")


def peak_host_bytes():
    """This process's peak resident memory (VmHWM), bytes."""
    return _proc_field("/proc/self/status", "VmHWM")


def huge_page_bytes():
    """This process's anonymous memory on transparent huge pages (AnonHugePages of
    /proc/self/smaps_rollup), bytes: how much of the pinned arena the kernel gave huge pages."""
    return _proc_field("/proc/self/smaps_rollup", "AnonHugePages")


def grow_host_memory(target):
    """Some VMs (the device machines here) give a guest its RAM as it is first touched: their
    MemAvailable starts far below the machine's memory, and Strata refuses a DRAM budget above
    MemAvailable. Touch what is missing in a child process (which then frees it), stopping
    early where memory does not grow (2 GiB left): never an OOM kill."""
    need = target - mem_available()
    if need <= 0:
        return 0.0
    t0 = time.perf_counter()
    code = ("import torch, sys\n"
            "sys.path.insert(0, %r)\n"
            "from host_memory import mem_available\n"
            "held, need = [], %d\n"
            "while sum(t.numel() for t in held) < need and mem_available() > (2 << 30):\n"
            "    held.append(torch.empty(min(1 << 30, need), dtype=torch.uint8).fill_(1))\n"
            % (str(pathlib.Path(__file__).parent), need))
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0
