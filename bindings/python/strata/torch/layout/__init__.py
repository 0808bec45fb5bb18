"""Where a session's streamed parameters live across processes, as a component the session
calls: LocalLayout (this process's runtime holds every parameter whole) or ShardedLayout (data
parallelism, strata.torch._distributed: each rank holds a chunk of every parameter). The
session's registration, its step's acquire / release / grads, and every read and write of
values, grads and optimizer state go through its layout; so do the questions other modules
ask (may the blocks be laid out again, does resident state page, how a checkpoint is split).

The parts, one job each: local (LocalLayout), sharded (ShardedLayout, the layout under data
parallelism, with its design), chunks (ShardedParam; a rank's chunk of a parameter's values,
read, written, gathered), streams (its side streams' helpers), replica (HostReplica: the
host replica of the weights with pieces), gather (BlockGathers: the blocks all-gathered for
their passes), reduce (GradReducer: the grads reduce-scattered and averaged, their global sums
of squares)."""
