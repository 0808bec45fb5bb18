"""The streamed blocks as one differentiable JAX function on the FFI path, executing the step
plan's choices per block: what it keeps for its backward pass (a jax.checkpoint policy: nothing
but its input, the outputs the block names with jax.ad_checkpoint.checkpoint_name, or
everything) and where its checkpoint (its input) waits for the backward pass: the device, or
host memory through XLA's host offload (the memory kinds device_put and
save_and_offload_only_these_names use: "pinned_host" and back to "device").

A block's weights are never among what it keeps: they come back with the backward pass's
acquire op (Strata streams them again), so its vjp's residuals that are its weights (or the
extras, passed to the backward anyway) are left out of the saved values and put back before its
vjp runs. Runs of blocks with one choice are one jax.lax.scan where the blocks allow (scan)."""
import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from . import _ffi
from ..core import BACKWARD, FORWARD

# The plan's keep modes (strata.step_plan.KEEP) as jax.checkpoint policies (names: the
# block's checkpoint_name tags kept by "selective").
POLICIES = {"recompute": lambda names: jax.checkpoint_policies.nothing_saveable,
            "selective": lambda names: jax.checkpoint_policies.save_only_these_names(*names),
            "whole": lambda names: jax.checkpoint_policies.everything_saveable}
HOST, DEVICE = "pinned_host", "device"


def segments(schedule, scan):
    """(start, stop, (keep, home)) runs of the schedule: consecutive blocks with one choice
    (scan), or one block each."""
    runs = []
    for layer, choice in enumerate(schedule):
        if scan and runs and runs[-1][2] == choice:
            runs[-1][1] = layer + 1
        else:
            runs.append([layer, layer + 1, choice])
    return [tuple(r) for r in runs]


def _index_of(leaf, known):
    return next((i for i, k in enumerate(known) if k is leaf), None)


def ffi_apply(trainer, call_block):
    """trainer's streamed blocks as apply(schedule, hidden, *extras) -> hidden (schedule: per
    block its (keep, checkpoint home) from the plan): a jax.custom_vjp whose forward begins the
    executor's step (begin op) and runs the blocks (acquire op, block, its residuals saved as
    the plan says), and whose backward runs them in reverse (acquire op, the block's vjp from
    its residuals and the weights acquired again, release op with the grads) and ends the step
    (end op). Called without differentiation: a forward-only step, abandoned at its end."""
    session, scan, names = trainer._ffi, trainer.scan, trainer.saved_names
    layout = trainer._layout  # under data parallel: chunks gathered, grads reduce-scattered
    on = {kind: SingleDeviceSharding(trainer.device, memory_kind=kind) for kind in (HOST, DEVICE)}
    if trainer.data_parallel is not None:
        # Inside the shard_map over every rank's device a value has no one device: the
        # transfer names the memory space only (each rank's own pinned host memory).
        on = {HOST: jax.memory.Space.Host, DEVICE: jax.memory.Space.Device}

    def shapes(layer):
        """What the acquire op gives: the registered tensors (this rank's chunks)."""
        return [jax.ShapeDtypeStruct(layout.registered_shape(s), d)
                for s, d in zip(trainer.shapes[layer], trainer.leaf_dtypes)]

    def acquire(token, dep, phase, layer, index=-1):
        """(token, the layer's weights): acquired, and under data parallel all-gathered."""
        token, w = session.acquire(token, dep, phase, shapes(layer), index)
        return token, layout.assemble(w, trainer.shapes[layer])

    def release(token, grads):
        """The grads (under data parallel this rank's chunk of their mean over the ranks) to
        the release op."""
        return session.release(token, layout.reduce(grads))

    def build(mask, extras_def, schedule):
        layouts = {}  # per run: how its vjp's residuals are rebuilt (set while tracing)

        def block_vjp(w, x, diff, const, run):
            """One block's output and what it saves (its weights and extras left out)."""
            keep, home = run[2]
            f = jax.checkpoint(lambda w_, x_, d_: call_block(w_, x_, d_, const, mask,
                                                             extras_def),
                               policy=POLICIES[keep](names))
            y, vjp = jax.vjp(f, list(w), x, list(diff))
            leaves, tree = jax.tree_util.tree_flatten(vjp)
            known = list(w) + list(diff) + list(const)
            slots = [_index_of(leaf, known) for leaf in leaves]
            saved = [leaf for leaf, s in zip(leaves, slots) if s is None]
            # The checkpoint (the block's input) to host memory where the plan says so.
            host = [home == "dram" and leaf is x for leaf in saved]
            saved = [jax.device_put(s, on[HOST]) if h else s for s, h in zip(saved, host)]
            layouts[run[0]] = (tree, slots, host)
            return y, saved

        def block_grads(w, saved, diff, const, g, acc, run):
            tree, slots, host = layouts[run[0]]
            if any(host):
                # Back on the device for the block's backward pass. The barrier orders its use
                # after the incoming grad (it is not on the host value: XLA's host offloader
                # accepts only copies and slices of one). Inside a scan the copy is of one
                # iteration's slice, so it cannot be hoisted out of the loop either.
                saved = [jax.device_put(s, on[DEVICE]) if h else s
                         for s, h in zip(saved, host)]
                saved, g = jax.lax.optimization_barrier((saved, g))
            it, known = iter(saved), list(w) + list(diff) + list(const)
            vjp = jax.tree_util.tree_unflatten(
                tree, [known[s] if s is not None else next(it) for s in slots])
            g_w, g, g_d = vjp(g)
            return g_w, g, [a + b for a, b in zip(acc, g_d)]

        def forward(x, diff, const, mode):
            token = session.begin(jnp.zeros((), jnp.uint32), mode)
            train = mode == _ffi.TRAIN
            saved = []
            for run in segments(schedule, scan):
                start, stop = run[0], run[1]
                # Each acquire takes the hidden state (its grad in the backward pass) as an
                # operand: XLA cannot issue it before the previous block, so at most one
                # block's weights (and the slots Strata prefetches into) are in HBM at a time.
                if scan:
                    def body(carry, _, run=run):
                        x_, tok = carry
                        tok, w = acquire(tok, x_, FORWARD, run[0])
                        if not train:
                            return (call_block(w, x_, diff, const, mask, extras_def), tok), []
                        y, res = block_vjp(w, x_, diff, const, run)
                        return (y, tok), res

                    (x, token), res = jax.lax.scan(body, (x, token), None, length=stop - start)
                else:
                    token, w = acquire(token, x, FORWARD, start, start)
                    if train:
                        x, res = block_vjp(w, x, diff, const, run)
                    else:
                        x, res = call_block(w, x, diff, const, mask, extras_def), []
                saved.append(res)
            return x, saved, token

        def backward(saved, diff, const, token, g_x):
            acc = [jnp.zeros_like(d) for d in diff]
            for run, res in reversed(list(zip(segments(schedule, scan), saved))):
                start = run[0]
                if scan:
                    def body(carry, res_, run=run):
                        g, acc_, tok = carry
                        tok, w = acquire(tok, g, BACKWARD, run[0])
                        g_w, g, acc_ = block_grads(w, res_, diff, const, g, acc_, run)
                        return (g, acc_, release(tok, g_w)), None

                    (g_x, acc, token), _ = jax.lax.scan(body, (g_x, acc, token), res,
                                                        reverse=True)
                else:
                    token, w = acquire(token, g_x, BACKWARD, start, start)
                    g_w, g_x, acc = block_grads(w, res, diff, const, g_x, acc, run)
                    token = release(token, g_w)
            session.end(token, _ffi.TRAIN)
            return g_x, list(acc)

        @jax.custom_vjp
        def apply(x, diff, const):
            x, _, token = forward(x, diff, const, _ffi.EVAL)
            session.end(token, _ffi.EVAL)
            return x

        def apply_fwd(x, diff, const):
            x, saved, token = forward(x, diff, const, _ffi.TRAIN)
            return x, (saved, diff, const, token)

        def apply_bwd(res, g_x):
            saved, diff, const, token = res
            g_x, acc = backward(saved, diff, const, token, g_x)
            return g_x, acc, [None] * len(const)

        apply.defvjp(apply_fwd, apply_bwd)
        return apply

    cache = {}

    def apply_blocks(schedule, hidden, *extras):
        leaves, extras_def = jax.tree_util.tree_flatten(tuple(extras))
        mask = tuple(bool(jnp.issubdtype(jnp.asarray(e).dtype, jnp.inexact))
                     for e in leaves)
        diff = [e for e, m in zip(leaves, mask) if m]
        const = [e for e, m in zip(leaves, mask) if not m]
        if schedule is None:  # inside the user's jit: planned from the hidden state's shape
            schedule = trainer._blocks_schedule(hidden, extras)
        key = (mask, extras_def, tuple(schedule))
        if key not in cache:
            cache[key] = build(mask, extras_def, tuple(schedule))
        return cache[key](hidden, diff, const)

    return apply_blocks
