"""Host probes: what this machine has now (available memory, free disk, a NUMA node's CPUs),
read where strata.torch sizes host memory, the NVMe tier's files and the CPU optimizer's
threads. Nothing here knows about models or sessions. The framework-neutral ones (available
memory, free disk, file systems) are strata._host's, named here so that strata.torch reads
them (and its tests replace them) in one place."""

import os

from .._host import disk_free, file_systems, mem_available  # noqa: F401


def node_cpus(node):
    """The CPUs this process may run on in NUMA node `node` (all it may run on where the node
    is unknown or shares none with them)."""
    allowed = os.sched_getaffinity(0)
    if node is not None and node >= 0:
        try:
            with open("/sys/devices/system/node/node%d/cpulist" % node) as f:
                listed = parse_cpulist(f.read())
            if listed & allowed:
                return len(listed & allowed)
        except OSError:
            pass
    return len(allowed)


def parse_cpulist(text):
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def fault_threads(mesh=None):
    """The threads this process's runtime faults its DRAM arena in with: 0 (the runtime's
    default: one per core of this process's affinity) for one process; under data parallelism
    (`mesh`) this rank's share of those cores, since the ranks of a host create their arenas
    at the same time (torchrun leaves every rank the whole host's affinity)."""
    if mesh is None:
        return 0
    return max(1, len(os.sched_getaffinity(0)) // mesh.ranks_on_host())
