"""Host probes: what this machine has now (available memory, free disk, a NUMA node's CPUs),
read where strata.torch sizes host memory, the NVMe tier's files and the CPU optimizer's
threads. Nothing here knows about models or sessions. The framework-neutral ones are
strata._host's (available memory, free disk, file systems) and strata._sharding's (a NUMA
node's CPUs, the fault-in threads' share), shared with strata.jax and named here so that
strata.torch reads them (and its tests replace them) in one place."""

from .._host import disk_free, file_systems, mem_available  # noqa: F401
from .._sharding import fault_threads as _fault_threads
from .._sharding import node_cpus, parse_cpulist  # noqa: F401 (the shared host probes)


def fault_threads(mesh=None):
    """The threads this process's runtime faults its DRAM arena in with: 0 (the runtime's
    default: one per core of this process's affinity) for one process; under data parallelism
    (`mesh`) this rank's share of those cores (strata._sharding.fault_threads)."""
    if mesh is None:
        return 0
    return _fault_threads(mesh.ranks_on_host())
