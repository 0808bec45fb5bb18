"""The data-parallel layout's sizes, for every framework's bindings (strata.torch's
ShardedLayout, strata.jax's data parallelism): how the ranks of a host are found to share one
copy of the training state, and each rank's chunk of a streamed parameter
(docs/architecture.md, "Data parallel"). Plain arithmetic over host names and element counts:
the collectives that move the chunks are each framework's own."""

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
