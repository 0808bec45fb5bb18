"""Data-parallel training of an offloaded model over the ranks of a torch.distributed process
group (NCCL on GPUs, gloo on the CPU). docs/architecture.md, "Data parallel", has the design;
this module holds its options (DataParallel), its collectives (Mesh: the process groups Strata
creates for itself, each with Strata's timeout, and every collective wrapped so that a failed
or silent peer becomes one clear error on every rank instead of a hang) and the size of each
rank's chunk of a streamed parameter.

The ranks are arranged as replicas x shards: `shard_size` consecutive ranks (by default the
ranks of one host) share one copy of the streamed blocks' training state, each rank holding
1/shard_size of every streamed parameter (its weight, grad, fp32 master and AdamW moments) in
its own pinned DRAM; the shard groups are replicas of each other (one per host).
With state_across_hosts the replicas (hosts) split that state once more: rank k of host h keeps
the optimizer state of piece h of chunk k only (strata.torch.layout, "pieces"), while every host
still holds all of the weights.

With nvme= each rank's runtime has an NVMe tier of its own files (rank_files: `<path>.rank<r>`),
its share of the host's memory and disk (Mesh.ranks_on_host, disk_sharing), and every rank
adopts one placement of the state (strata.torch.layout.sharded.ShardedLayout.before_build)."""

import datetime
import os
import socket

import torch

from .._sharding import ALIGN, chunk_elements, ranks_per_host  # noqa: F401
from .._sharding import optimizer_threads as _optimizer_threads
from . import _host
from ._agreement import DataParallelError  # (public: strata.torch.DataParallelError)

try:
    import torch.distributed as dist
except ImportError:  # a torch built without distributed support
    dist = None


class DataParallel:
    """Options of st.offload(model, data_parallel=DataParallel(...)).

    group: the process group whose ranks train together (None: the default group).
    shard_size: how many consecutive ranks share one copy of the training state, each holding
        1/shard_size of it (None: the ranks of one host, found by host name; 1: every rank a
        full replica; the group's size: sharded over all ranks, hosts included).
    timeout: how long any one of Strata's collectives may wait for the other ranks before it
        raises (seconds or a datetime.timedelta; default 10 minutes, torch's own default).
    reduce_dtype: the dtype grads are averaged in (None: the compute dtype, as DDP does;
        torch.float32 costs twice the bytes on the wire and rounds once).
    broadcast: start every rank from rank 0's values of every parameter (as DDP does), so
        differently seeded ranks still train one model.
    state_across_hosts: shard the optimizer state across the replicas (hosts) too, while each
        host keeps a replica of the weights: rank k of replica h keeps the fp32 master, moments
        and grad of only piece h of its chunk k, so each host's optimizer state and CPU update
        shrink by the number of replicas; grads are reduce-scattered across the hosts instead
        of all-reduced, and the updated pieces all-gathered back at each block's next load
        (docs/architecture.md, "Optimizer state across hosts"). Needs at least 2 replicas;
        not with nvme=."""

    def __init__(self, group=None, shard_size=None, timeout=600.0, reduce_dtype=None,
                 broadcast=True, state_across_hosts=False):
        if shard_size is not None and (not isinstance(shard_size, int) or shard_size < 1):
            raise ValueError("strata.torch.DataParallel: shard_size must be a positive integer "
                             "(got %r)" % (shard_size,))
        if not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        if timeout.total_seconds() <= 0:
            raise ValueError("strata.torch.DataParallel: timeout must be positive")
        if reduce_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError("strata.torch.DataParallel: reduce_dtype is None, float32, "
                             "bfloat16 or float16 (got %r)" % (reduce_dtype,))
        self.group, self.shard_size, self.timeout = group, shard_size, timeout
        self.reduce_dtype, self.broadcast = reduce_dtype, bool(broadcast)
        if not isinstance(state_across_hosts, bool):
            raise TypeError("strata.torch.DataParallel: state_across_hosts is True or False "
                            "(got %r)" % (state_across_hosts,))
        self.state_across_hosts = state_across_hosts


def resolve(data_parallel):
    """The DataParallel options st.offload trains with (then over Mesh(options, device)), or
    None. data_parallel: None (data parallel over the default group when torch.distributed is
    initialized with several ranks), False (never), or a DataParallel. Local: it decides
    whether the ranks make a Mesh, so an error here is every rank's alike (the same call)."""
    if data_parallel is False:
        return None
    initialized = dist is not None and dist.is_available() and dist.is_initialized()
    if data_parallel is None:
        if not initialized or dist.get_world_size() < 2:
            return None
        data_parallel = DataParallel()
    if not isinstance(data_parallel, DataParallel):
        raise TypeError("strata.torch.offload: data_parallel is None, False or a "
                        "strata.torch.DataParallel (got %r)" % (data_parallel,))
    if not initialized:
        raise RuntimeError("strata.torch.offload: data_parallel was given but torch.distributed "
                           "is not initialized (torch.distributed.init_process_group first)")
    return data_parallel


class Mesh:
    """The ranks of one data-parallel job as replicas x shards, and the collectives over them.
    Every group here is Strata's own (dist.new_group with the options' timeout), so the user's
    groups and their timeouts are untouched; the shard level has two (gathers of weights, and
    reductions of grads) so that the next layer's gather need not queue behind this layer's
    reduction on one NCCL stream."""

    def __init__(self, options, device):
        self.options = options
        self.device = device
        self.timeout = options.timeout
        self.reduce_dtype = options.reduce_dtype
        self.broadcast_values = options.broadcast
        parent = options.group if options.group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(parent)
        self.global_ranks = ranks
        self.world = len(ranks)
        self.rank = dist.get_rank(parent)
        self.global_rank = dist.get_rank()
        if self.rank < 0:
            raise ValueError("strata.torch.offload: this process is not a member of the "
                             "data_parallel group")
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        # Subgroups of the default group are created by every rank, all in one order: NCCL
        # splits them from the default group's communicator when a device is bound to it
        # (init_process_group(device_id=...)), which every rank of it must join. Under another
        # group only its members take part, so only they create them.
        self.local_sync = options.group is not None and \
            dist.get_world_size(options.group) != dist.get_world_size()
        if device.type == "cuda":
            # NCCL's object collectives and communicators use the current device: this rank's.
            torch.cuda.set_device(device)
        self.failed = None  # the first DataParallelError: later collectives refuse at once
        self.all = self._group(ranks)
        # Every rank must make the same groups below and train alike: the options are agreed
        # first, so that ranks given different ones all raise here (one raising alone would
        # leave the others waiting in their next group's creation until the timeout).
        every = self._gather_objects((socket.gethostname(), _agreed(options)))
        self.hosts = [host for host, _ in every]
        _refuse_disagreement([agreed for _, agreed in every])
        size = options.shard_size or self._ranks_per_host()
        if self.world % size:
            raise ValueError("strata.torch.offload: shard_size %d does not divide the %d ranks "
                             "of the data-parallel group" % (size, self.world))
        self.shard_size, self.replicas = size, self.world // size
        self.shard_rank, self.replica = self.rank % size, self.rank // size
        if options.state_across_hosts and self.replicas < 2:
            raise ValueError(
                "strata.torch.offload: DataParallel(state_across_hosts=True) shards the "
                "optimizer state across replicas (hosts), but the %d ranks form one replica of "
                "shard_size %d: it needs at least 2 (several hosts, or a shard_size below the "
                "ranks' count); nothing was changed" % (self.world, size))
        # Pieces each rank's chunk is cut into across the replicas (1: every replica holds the
        # whole chunk's state, HSDP); this rank's piece is its replica's index.
        self.pieces = self.replicas if options.state_across_hosts else 1
        self.gather_group = self.reduce_group = self.replica_group = None
        self.piece_group = None  # gathers of updated pieces across the replicas
        if size > 1:
            for k in range(self.replicas):
                shard = ranks[k * size:(k + 1) * size]
                gather, reduce = self._group(shard), self._group(shard)
                if k == self.replica:
                    self.gather_group, self.reduce_group = gather, reduce
        if self.replicas > 1:
            for j in range(size):
                replica = self._group(ranks[j::size])
                if j == self.shard_rank:
                    self.replica_group = replica
        if self.pieces > 1:  # a second communicator: gathers never queue behind reductions
            for j in range(size):
                pieces = self._group(ranks[j::size])
                if j == self.shard_rank:
                    self.piece_group = pieces

    # --- set-up ----------------------------------------------------------------------------

    def _group(self, ranks):
        """A new group of `ranks` (global ranks), or None where this rank is not in it."""
        if self.local_sync and self.global_rank not in ranks:
            return None
        try:
            group = dist.new_group(ranks, timeout=self.timeout, backend=self.backend,
                                   use_local_synchronization=self.local_sync)
        except Exception as e:
            raise self._failure("creating a process group of ranks %s" % list(ranks), e) from e
        return group if self.global_rank in ranks else None

    def _ranks_per_host(self):
        """Ranks per host (strata._sharding.ranks_per_host over the ranks' host names)."""
        return ranks_per_host(self.hosts)

    def ranks_on_host(self):
        """How many ranks of the data-parallel group run on this rank's host: they share its
        memory and disks (whatever the shard size)."""
        return self.hosts.count(self.hosts[self.rank])

    def describe(self):
        text = "%d replica(s) x %d shard(s); rank %d is shard %d of replica %d" % (
            self.replicas, self.shard_size, self.rank, self.shard_rank, self.replica)
        if self.pieces > 1:
            text += "; optimizer state across the replicas: this rank updates piece %d of %d " \
                    "of its chunks" % (self.replica, self.pieces)
        return text

    # --- errors ----------------------------------------------------------------------------

    def _failure(self, what, error):
        if isinstance(error, DataParallelError):
            return error
        e = DataParallelError(
            "strata.torch data parallel (rank %d of %d): %s failed: %s. Another rank failed, "
            "was killed, or did not reach this collective within the %.0f s timeout "
            "(DataParallel(timeout=...)); its own error says why. This rank's step is "
            "abandoned: end the job and restart it, from a checkpoint if there is one."
            % (self.rank, self.world, what, str(error).strip().splitlines()[0][:300]
               if str(error).strip() else type(error).__name__,
               self.timeout.total_seconds()))
        self.failed = self.failed or e
        return e

    def _check(self):
        if self.failed is not None:
            raise DataParallelError("strata.torch data parallel: an earlier collective failed "
                                    "(%s); this job cannot continue" % self.failed)

    def run(self, what, fn):
        """fn() (a collective, or a wait for one), its failure made a DataParallelError."""
        self._check()
        try:
            return fn()
        except Exception as e:
            raise self._failure(what, e) from e

    def wait(self, work, what):
        """Wait for an asynchronous collective: on the GPU the current stream waits (the host
        does not); on the CPU the calling thread waits, for at most the timeout."""
        if work is None:
            return
        self.run(what, lambda: work.wait(self.timeout) if self.backend == "gloo" else work.wait())

    # --- collectives ---------------------------------------------------------------------

    def all_gather(self, out, chunk, what, group=None):
        """out (shard_size x chunk elements) <- every shard's chunk, in shard order; started
        asynchronously (wait for the returned work). Without shard peers: a copy."""
        group = group or self.gather_group
        if group is None:
            out.copy_(chunk)
            return None
        return self.run(what, lambda: dist.all_gather_into_tensor(out, chunk, group=group,
                                                                   async_op=True))

    def reduce_scatter(self, out, full, what):
        """out <- this shard's chunk of the average of `full` over the shard group."""
        if self.reduce_group is None:
            out.copy_(full[:out.numel()])
            return None
        return self.run(what, lambda: dist.reduce_scatter_tensor(
            out, full, op=dist.ReduceOp.AVG, group=self.reduce_group, async_op=True))

    def average_replicas(self, tensor, what):
        """tensor <- its average over the replicas (the ranks holding the same shard)."""
        if self.replica_group is None:
            return None
        return self.run(what, lambda: dist.all_reduce(tensor, op=dist.ReduceOp.AVG,
                                                      group=self.replica_group, async_op=True))

    def average_all(self, tensor, what):
        """tensor <- its average over every rank (resident parameters' grads, as DDP)."""
        return self.run(what, lambda: dist.all_reduce(tensor, op=dist.ReduceOp.AVG,
                                                      group=self.all, async_op=True))

    def gather_pieces(self, out, piece, what):
        """out (pieces x piece elements) <- every replica's piece of this rank's chunk, in
        replica order (state_across_hosts); asynchronous, as all_gather."""
        return self.all_gather(out, piece, what, group=self.piece_group)

    def scatter_pieces(self, out, chunk, what):
        """out <- this replica's piece of the average of `chunk` over the replicas
        (state_across_hosts: the ranks holding the same chunk); asynchronous."""
        return self.run(what, lambda: dist.reduce_scatter_tensor(
            out, chunk, op=dist.ReduceOp.AVG, group=self.replica_group, async_op=True))

    def sum_all(self, values, what):
        """The elementwise sums over every rank of a list of floats (synchronous)."""
        if not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device())
        self.wait(self.run(what, lambda: dist.all_reduce(t, group=self.all, async_op=True)),
                  what)
        return t.cpu().tolist()

    def sum_shards(self, values, what):
        """The elementwise sums over the shard group of a list of floats (synchronous)."""
        if self.shard_size == 1 or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device())
        self.wait(self.run(what, lambda: dist.all_reduce(t, group=self.reduce_group,
                                                         async_op=True)), what)
        return t.cpu().tolist()

    def broadcast(self, tensor, what):
        """tensor <- rank 0's (of the data-parallel group), synchronously."""
        if not self.broadcast_values:
            return
        t = tensor.to(self.comm_device())
        src = self.global_ranks[0]
        self.wait(self.run(what, lambda: dist.broadcast(t, src, group=self.all,
                                                        async_op=True)), what)
        if t is not tensor:
            tensor.copy_(t)

    def gather_objects(self, value):
        return self._gather_objects(value)

    def _gather_objects(self, value):
        out = [None] * self.world
        self.run("exchanging %r" % (value,),
                 lambda: dist.all_gather_object(out, value, group=self.all))
        return out

    def barrier(self, what):
        self.run(what, lambda: dist.barrier(group=self.all))

    def comm_device(self):
        """Where tensors for a collective live: the GPU for NCCL, the CPU for gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")


def _agreed(options):
    """What of a DataParallel every rank must pass alike (its group is the same on every rank
    that gets here; its timeout only bounds this rank's waits)."""
    return {"shard_size": options.shard_size, "state_across_hosts": options.state_across_hosts,
            "reduce_dtype": None if options.reduce_dtype is None else str(options.reduce_dtype),
            "broadcast": options.broadcast}


def _refuse_disagreement(every):
    """The same ValueError on every rank when the ranks' DataParallel options (`every`, in rank
    order) differ, naming each rank's values of those that differ."""
    differ = [k for k in every[0] if any(o[k] != every[0][k] for o in every)]
    if differ:
        raise ValueError(
            "strata.torch.offload: the data-parallel ranks disagree about DataParallel's options "
            "(%s); every rank passes the same; nothing was changed" % "; ".join(
                "rank %d: %s" % (r, ", ".join("%s=%r" % (k, o[k]) for k in differ))
                for r, o in enumerate(every)))


def optimizer_threads(mesh, numa_node):
    """Threads for this rank's CPU AdamW (strata._sharding.optimizer_threads): its NUMA node's
    CPUs shared by the ranks of this host whose GPUs sit on the same node (collective)."""
    here = (socket.gethostname(), numa_node)
    return _optimizer_threads(numa_node, mesh.gather_objects(here).count(here))


def rank_files(mesh, nvme, options):
    """This rank's NVMe tier files under data parallelism: `<path>.rank<r>` for each path of
    nvme= (r its rank in the data-parallel group, unique across hosts, so ranks on one host or
    on a shared file system never open one file: the runtime locks its files), or [] when no
    rank passed nvme=. Collective, and every rank reaches the same decision: the ranks must
    agree about `options` (nvme= given or not, how many files, and the NVMe options beside it:
    they fix the placement every rank adopts), and every rank must be able to create and open
    its files as the tier does (O_DIRECT); else the same ValueError on every rank, naming the
    ranks and what is wrong with each, before anything is created."""
    mine = dict(options, nvme=len(nvme))
    every = mesh.gather_objects(mine)
    if not any(o["nvme"] for o in every):
        return []
    if mesh.pieces > 1:
        raise NotImplementedError(
            "strata.torch.offload: nvme= with DataParallel(state_across_hosts=True) is not "
            "supported: state sharded across hosts already divides each host's optimizer state "
            "by the number of hosts; drop nvme=, or state_across_hosts; nothing was changed")
    if any(o != every[0] for o in every):
        raise ValueError(
            "strata.torch.offload: the data-parallel ranks disagree about nvme= and its options "
            "(%s); every rank passes the same (each rank gets files of its own, <path>.rank<r>); "
            "nothing was changed" % "; ".join(
                "rank %d: %s" % (r, _describe_nvme(o)) for r, o in enumerate(every)))
    paths = ["%s.rank%d" % (os.fsdecode(p), mesh.rank) for p in nvme]
    problems = mesh.gather_objects([e for e in map(_probe_file, paths) if e is not None])
    wrong = ["rank %d: %s" % (r, "; ".join(e)) for r, e in enumerate(problems) if e]
    if wrong:
        raise ValueError("strata.torch.offload: nvme= cannot hold the NVMe tier on every rank "
                         "(%s); every rank needs a writable file system that supports O_DIRECT "
                         "(not tmpfs) at its paths; nothing was changed" % "; ".join(wrong))
    return paths


def _describe_nvme(options):
    if not options["nvme"]:
        return "no nvme="
    return ", ".join("%s=%r" % (k, options[k]) for k in sorted(options) if k != "nvme") + \
        ", %d file(s)" % options["nvme"]


def _probe_file(path):
    """None when this process can create (or open) `path` as the NVMe tier opens its files
    (read-write, O_DIRECT), else what failed; a file the probe created is removed again."""
    existed = os.path.exists(path)
    flags = os.O_RDWR | getattr(os, "O_DIRECT", 0) | (0 if existed else os.O_CREAT | os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        return "%s: %s" % (path, e.strerror)
    os.close(fd)
    if not existed:
        os.unlink(path)
    return None


def disk_sharing(mesh, paths):
    """How many ranks of this host have NVMe files on the file system of this rank's busiest
    one (at least 1): they share its free space (collective)."""
    devices = _host.file_systems(paths)
    every = mesh.gather_objects(devices)
    host = mesh.hosts[mesh.rank]
    return max([sum(1 for r, devs in enumerate(every) if mesh.hosts[r] == host and d in devs)
                for d in devices] or [1])
