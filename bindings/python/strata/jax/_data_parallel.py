"""strata.jax data parallel: one process per device under jax.distributed, the ranks of a host
sharing one copy of the blocks' training state, as strata.torch's ShardedLayout does
(docs/architecture.md, "Data parallel"; the chunk sizes and the default shard size are
strata._sharding's, one rule for both bindings).

The ranks form replicas x shards: `shard_size` consecutive processes (by default those of one
host, found by host name) share one copy of the training state. Every streamed leaf is
flattened and cut into shard_size chunks (padded to a multiple of 64 elements); rank k of a
shard group registers chunk k of every leaf with its own runtime: its weight, grad, fp32 master
and AdamW moments, updated by its own CPU optimizer. In the step's one XLA program (a
jax.shard_map over a mesh of every process's device, axes ("replica", "shard")), per block:

- the FFI acquire op gives this rank's chunks; an all-gather over "shard" assembles the block;
- the backward pass's grads of the whole block are reduce-scattered over "shard" (summed) and
  summed over "replica", then divided by the ranks: this rank's chunk of the mean of every
  rank's grads goes to the release op, so Strata's optimizer updates it with the grads of all
  the rows;
- the residents (embedding, head) are replicas, their grads averaged over every rank before
  the optax update, and the loss is the ranks' mean.

On GPUs the collectives are XLA's (NCCL); on the CPU, gloo's (jax_cpu_collectives_implementation).
Each process passes its own rows (step(batch): every leaf of the batch has its rows first);
the step trains on the rows of all. The loss is the mean of the ranks' losses, which is the
loss of one process with every row when loss_fn is a mean over rows and the ranks have equal
rows."""
import socket

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._sharding import chunk_elements, fault_threads, optimizer_threads, ranks_per_host

AXES = ("replica", "shard")
# What a program that failed while running raises (a collective whose peer is gone among them).
RUNTIME_ERRORS = tuple(e for e in (getattr(jax.errors, "JaxRuntimeError", None),)
                       if e is not None) or (RuntimeError,)
_HOST_BYTES = 256  # a host name as fixed bytes, for the ranks' all-gather


class DataParallelError(RuntimeError):
    """A data-parallel step failed in its collectives: another process failed, was killed or
    stopped. The job must end (JAX's collectives cannot be trusted after a failure)."""


class DataParallel:
    """Options of Trainer(data_parallel=DataParallel(...)).

    shard_size: how many consecutive processes share one copy of the blocks' training state,
    each holding 1/shard_size of it (None: the processes of one host, found by host name; 1:
    every process a full replica; the number of processes: sharded over all of them)."""

    def __init__(self, shard_size=None):
        if shard_size is not None and (isinstance(shard_size, bool) or
                                       not isinstance(shard_size, int) or shard_size < 1):
            raise ValueError("strata.jax.DataParallel: shard_size must be a positive integer or "
                             "None (the processes of one host); got %r" % (shard_size,))
        self.shard_size = shard_size


def resolve(option):
    """Trainer's data_parallel argument as the Ranks this process trains with, or None (one
    process trains alone). None: data parallel when jax.distributed runs several processes."""
    if option is False:
        return None
    if option is None:
        return Ranks(DataParallel()) if jax.process_count() > 1 else None
    if option is True:
        option = DataParallel()
    if not isinstance(option, DataParallel):
        raise TypeError("strata.jax: data_parallel must be None, True, False or a "
                        "strata.jax.DataParallel; got %r" % (option,))
    if jax.process_count() < 2:
        raise ValueError("strata.jax: data_parallel needs several processes: call "
                         "jax.distributed.initialize(coordinator_address, num_processes, "
                         "process_id) in each before building the Trainer (this is the only "
                         "process)")
    return Ranks(option)


class Whole:
    """One process alone: every leaf whole in its runtime, nothing reduced (the layout a
    Trainer without data parallelism runs through the same calls)."""

    rank, world = 0, 1

    def kept(self, numel):
        return numel

    def registered_name(self, name):
        return name

    def registered_shape(self, shape):
        return shape

    def own_chunk(self, value):
        return value

    def runtime_options(self, device, backend):
        return {}

    def optimizer_threads(self, runtime, threads):
        return threads

    def assemble(self, chunks, shapes):
        return chunks

    def reduce(self, grads):
        return grads


class Ranks(Whole):
    """This process's place among the data-parallel ranks and the collectives of its step (see
    the module's docstring)."""

    def __init__(self, options):
        self.world, self.rank = jax.process_count(), jax.process_index()
        if jax.local_device_count() != 1:
            raise ValueError("strata.jax: data parallel runs one process per device; this "
                             "process has %d (%s): give each process one device (CUDA_VISIBLE_"
                             "DEVICES, or jax.distributed.initialize(local_device_ids=...))"
                             % (jax.local_device_count(), jax.local_devices()))
        name = socket.gethostname().encode()[:_HOST_BYTES].ljust(_HOST_BYTES, b"\0")
        mine = np.concatenate([np.frombuffer(name, np.uint8).astype(np.int32),
                               [options.shard_size or 0]])
        every = np.asarray(multihost_utils.process_allgather(mine))
        asked = {int(row[-1]) for row in every}
        if len(asked) != 1:
            raise ValueError("strata.jax: the processes disagree about DataParallel's shard_size "
                             "(%s); every process passes the same" % ", ".join(
                                 "rank %d: %s" % (r, int(row[-1]) or None)
                                 for r, row in enumerate(every)))
        self.hosts = [bytes(row[:-1].astype(np.uint8)).rstrip(b"\0").decode(errors="replace")
                      for row in every]
        size = options.shard_size or ranks_per_host(self.hosts)
        if self.world % size:
            raise ValueError("strata.jax: shard_size %d does not divide the %d processes"
                             % (size, self.world))
        self.shard_size, self.replicas = size, self.world // size
        self.shard_rank, self.replica = self.rank % size, self.rank // size
        devices = sorted(jax.devices(), key=lambda d: d.process_index)
        self.mesh = Mesh(np.array(devices).reshape(self.replicas, size), AXES)
        self.replicated = NamedSharding(self.mesh, P())
        self.rows = NamedSharding(self.mesh, P(AXES))
        self.failed = None  # the first failed step's error: later steps refuse at once

    def ranks_on_host(self):
        return self.hosts.count(self.hosts[self.rank])

    def describe(self):
        return ("%d replica(s) x %d shard(s); rank %d is shard %d of replica %d"
                % (self.replicas, self.shard_size, self.rank, self.shard_rank, self.replica))

    # --- this rank's share of its host ---------------------------------------------------------

    def runtime_options(self, device, backend):
        """This rank's runtime on its own GPU (jax.distributed may give a process any of the
        host's: its local_hardware_id), faulting its arena in with its share of the cores."""
        ordinal = device.local_hardware_id if backend == "cuda" else 0
        return {"device": ordinal or 0, "dram_fault_threads": fault_threads(self.ranks_on_host())}

    def optimizer_threads(self, runtime, threads):
        """`threads` where given, else this rank's share of its GPU's NUMA node's CPUs among
        the ranks of its host on that node (collective: every rank calls)."""
        node = int(runtime.capabilities().device_numa_node)
        every = np.asarray(multihost_utils.process_allgather(np.asarray(node, np.int32)))
        here = (self.hosts[self.rank], node)
        sharing = sum(1 for r in range(self.world) if (self.hosts[r], int(every[r])) == here)
        return threads or optimizer_threads(node, sharing)

    # --- registration: this rank's chunk of every leaf ----------------------------------------

    def kept(self, numel):
        """Elements of a leaf of `numel` elements that this rank's runtime holds."""
        return chunk_elements(numel, self.shard_size)

    def registered_name(self, name):
        return "%s.shard%dof%d" % (name, self.shard_rank, self.shard_size)

    def registered_shape(self, shape):
        return (self.kept(int(np.prod(shape))),)

    def own_chunk(self, value):
        """This rank's chunk of a leaf's values, flat, zero past the leaf's end (on the value's
        device for a JAX array)."""
        xp = jnp if isinstance(value, jax.Array) else np
        flat = xp.reshape(xp.asarray(value), (-1,))
        chunk = self.kept(flat.shape[0])
        lo = min(self.shard_rank * chunk, flat.shape[0])
        hi = min(lo + chunk, flat.shape[0])
        return xp.concatenate([flat[lo:hi], xp.zeros((chunk - (hi - lo),), flat.dtype)])

    # --- inside the step's program (jax.shard_map over the mesh) ------------------------------

    def assemble(self, chunks, shapes):
        """The block's leaves (of `shapes`) from this rank's chunks: all-gathered over the shard
        group."""
        out = []
        for c, shape in zip(chunks, shapes):
            flat = jax.lax.all_gather(c, "shard", tiled=True) if self.shard_size > 1 else c
            out.append(flat[:int(np.prod(shape))].reshape(shape))
        return out

    def reduce(self, grads):
        """This rank's chunk of the mean over every rank of the block's `grads` (in their
        dtype): reduce-scattered over the shard group, summed over the replicas."""
        out = []
        for g in grads:
            flat = g.reshape(-1)
            chunk = self.kept(flat.shape[0])
            flat = jnp.pad(flat, (0, chunk * self.shard_size - flat.shape[0]))
            if self.shard_size > 1:
                flat = jax.lax.psum_scatter(flat, "shard", scatter_dimension=0, tiled=True)
            if self.replicas > 1:
                flat = jax.lax.psum(flat, "replica")
            out.append(flat / jnp.asarray(self.world, flat.dtype))
        return out

    def mean(self, tree):
        """The mean over every rank (the residents' grads, the loss)."""
        return jax.lax.pmean(tree, AXES)

    def wrap(self, program):
        """program(residents, opt_state, batch) as one program over every rank: the residents
        and the optax state replicated, every leaf of the batch split along its rows."""
        return jax.shard_map(program, mesh=self.mesh, in_specs=(P(), P(), P(AXES)),
                             out_specs=P(), check_vma=False)

    # --- values across the ranks (collective: every rank calls) -------------------------------

    def global_batch(self, batch):
        """This process's rows as its part of the global batch (the rows of all)."""
        def put(a):
            a = np.asarray(a)
            if a.ndim == 0:
                raise ValueError("strata.jax: under data parallel every leaf of the batch has "
                                 "its rows first (each process passes its own rows); a scalar "
                                 "leaf cannot be split: close over it in the functions")
            return jax.make_array_from_process_local_data(self.rows, a)

        return jax.tree_util.tree_map(put, batch)

    def replicate(self, tree):
        """`tree` as arrays replicated on every rank, rank 0's values (as DDP starts)."""
        tree = multihost_utils.broadcast_one_to_all(
            jax.tree_util.tree_map(np.asarray, tree), is_source=self.rank == 0)
        return jax.tree_util.tree_map(
            lambda a: jax.make_array_from_callback(np.shape(a), self.replicated,
                                                   lambda index: np.asarray(a)[index]), tree)

    @staticmethod
    def local(tree):
        """A replicated tree's values on this process's device."""
        return jax.tree_util.tree_map(lambda a: a.addressable_data(0), tree)

    def gather(self, chunk, shape):
        """A leaf of `shape` from every shard's `chunk` of it (numpy)."""
        every = np.asarray(multihost_utils.process_allgather(chunk))
        group = every[self.replica * self.shard_size:(self.replica + 1) * self.shard_size]
        return group.reshape(-1)[:int(np.prod(shape))].reshape(shape)

    def shard_group_sum(self, value):
        """The sum of a float over this rank's shard group (a chunked leaf's sums of squares:
        the replicas hold the same chunks)."""
        every = np.asarray(multihost_utils.process_allgather(np.asarray(value, np.float64)))
        return float(np.sum(every[self.replica * self.shard_size:
                                  (self.replica + 1) * self.shard_size]))

    def mean_of(self, value):
        """The mean over every rank of a float."""
        return float(np.mean(np.asarray(multihost_utils.process_allgather(
            np.asarray(value, np.float64)))))

    def failure(self, what, error):
        """A failed step's error as a DataParallelError (kept: later steps refuse at once)."""
        if isinstance(error, DataParallelError):
            return error
        text = str(error).strip().splitlines()
        self.failed = self.failed or DataParallelError(
            "strata.jax data parallel (rank %d of %d): %s failed: %s. Another process failed, "
            "was killed or stopped (its own error says why); this process's step is abandoned: "
            "end the job and restart it, from a checkpoint if there is one."
            % (self.rank, self.world, what, text[0][:300] if text else type(error).__name__))
        return self.failed

    def check(self):
        if self.failed is not None:
            raise DataParallelError("strata.jax data parallel: an earlier step failed (%s); "
                                    "this job cannot continue" % self.failed)
