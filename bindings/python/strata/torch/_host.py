"""Host probes: what this machine has now (available memory, free disk; a NUMA node's CPUs from
strata._sharding, shared with strata.jax), read where strata.torch sizes host memory, the NVMe
tier's files and the CPU optimizer's threads. Nothing here knows about models or sessions."""

import os

from .._sharding import fault_threads as _fault_threads
from .._sharding import node_cpus, parse_cpulist  # noqa: F401 (the shared host probes)


def mem_available():
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def disk_free(paths):
    """Bytes the NVMe tier's files can take: the striped files grow equally, so each file
    system holds its share (its files over all of them) of the budget; 5% and 1 GiB of each
    are left to it."""
    free, files = {}, {}
    for path in paths:
        folder = os.path.dirname(os.path.abspath(path))
        st = os.statvfs(folder)
        dev = os.stat(folder).st_dev
        free[dev] = max(0, int(st.f_bavail * st.f_frsize * 0.95) - (1 << 30))
        files[dev] = files.get(dev, 0) + 1
    return min(free[dev] * len(paths) // files[dev] for dev in free)


def file_systems(paths):
    """The file systems (st_dev) holding the folders of `paths`, sorted: the NVMe tier's files
    on one of them share its disks."""
    return sorted({os.stat(os.path.dirname(os.path.abspath(p))).st_dev for p in paths})


def fault_threads(mesh=None):
    """The threads this process's runtime faults its DRAM arena in with: 0 (the runtime's
    default: one per core of this process's affinity) for one process; under data parallelism
    (`mesh`) this rank's share of those cores (strata._sharding.fault_threads)."""
    if mesh is None:
        return 0
    return _fault_threads(mesh.ranks_on_host())
