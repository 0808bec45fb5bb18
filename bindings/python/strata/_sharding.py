"""The data-parallel layout's sizes, for every framework's bindings (strata.torch's
ShardedLayout, strata.jax's data parallelism): how the ranks of a host are found to share one
copy of the training state, each rank's chunk of a streamed parameter, and each rank's share of
its host's CPUs (docs/architecture.md, "Data parallel"). Plain arithmetic over host names,
element counts and this process's CPU affinity: the collectives that move the chunks are each
framework's own."""
import os

# Elements: every rank's chunk of a streamed parameter, so every parameter in a gathered block,
# starts aligned (the layouts lay the chunks out; the bindings' sizing counts them).
ALIGN = 64


def chunk_elements(numel, shards, pieces=1):
    """Elements of each rank's chunk of a parameter of `numel` elements; with `pieces` (hosts
    splitting the chunk's state, strata.torch's DataParallel(state_across_hosts=True)) a
    multiple of that many aligned pieces, so every piece starts aligned too."""
    per = -(-numel // shards)
    align = ALIGN * pieces
    return max(align, -(-per // align) * align)


def ranks_per_host(hosts):
    """The default shard size for ranks on `hosts` (each rank's host name, in rank order): the
    ranks per host when every host has the same number and holds consecutive ranks (what
    torchrun and one process per GPU assign); else 1 (every rank a replica), which is always
    correct."""
    counts = {}
    for h in hosts:
        counts[h] = counts.get(h, 0) + 1
    size = hosts.count(hosts[0])
    consecutive = all(hosts[i] == hosts[i - i % size] for i in range(len(hosts)))
    return size if len(set(counts.values())) == 1 and consecutive else 1


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


def fault_threads(ranks_on_host):
    """The threads a rank's runtime faults its DRAM arena in with: its share of the cores of
    this process's affinity, since the ranks of a host create their arenas at the same time
    (torchrun and jax.distributed leave every rank the whole host's affinity)."""
    return max(1, len(os.sched_getaffinity(0)) // ranks_on_host)


def optimizer_threads(numa_node, sharing):
    """Threads for a rank's CPU optimizer: the CPUs of its GPU's NUMA node, shared by the
    `sharing` ranks of its host whose GPUs sit on the same node, less one each for the thread
    feeding the GPU (one rank alone gets Strata's own default: the node's CPUs less one)."""
    return max(1, node_cpus(numa_node) // sharing - 1)
