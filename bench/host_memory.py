"""Host memory as the benchmarks report it, from /proc: shared by train_bench.py and
dist_bench.py."""


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
