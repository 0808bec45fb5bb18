"""The Trainer's jitted programs: a block's forward and backward, the embedding and head, the
residents' update; on the FFI path the streamed blocks as one differentiable JAX function
(begin, acquire, release and end ops around the blocks) and the whole step as one program."""
import jax
import jax.numpy as jnp

from . import _ffi_blocks, _loss
from ._stepplan import signature
from ._tree import _normalize_embed


def apply_optax(opt, r, opt_state, grads):
    """The residents after the optax transformation's update from `grads` (each kept in its
    dtype), and its new state."""
    updates, opt_state = opt.update(grads, opt_state, r)
    r = jax.tree_util.tree_map(
        lambda p, u: jnp.asarray(p + u).astype(jnp.asarray(p).dtype), r, updates)
    return r, opt_state


class _Programs:
    """Trainer's compiled functions (a mixin of Trainer: _compile sets them on it)."""

    def _compile(self):
        block_fn, embed_fn, loss_fn = self.block_fn, self.embed_fn, self.loss_fn
        treedef = self.treedef

        def merge(diff, const, mask):
            it_d, it_c = iter(diff), iter(const)
            return [next(it_d) if m else next(it_c) for m in mask]

        def call_block(leaves, x, diff, const, mask, extras_def):
            extras = jax.tree_util.tree_unflatten(extras_def, merge(diff, const, mask))
            return block_fn(jax.tree_util.tree_unflatten(treedef, leaves), x, *extras)

        self._forward = jax.jit(call_block, static_argnums=(4, 5))

        def backward(leaves, x, diff, const, g, acc, mask, extras_def):
            _, vjp = jax.vjp(lambda l, x_, d: call_block(l, x_, d, const, mask, extras_def),
                             leaves, x, diff)
            g_l, g_x, g_d = vjp(g)
            return g_l, g_x, [a + b for a, b in zip(acc, g_d)]

        self._backward = jax.jit(backward, static_argnums=(6, 7))

        def embed(r, batch):
            hidden, extras = _normalize_embed(embed_fn(r, batch))
            return hidden, extras

        if embed_fn is not None:
            def chunked_loss(r, x, batch):
                # The host loop's loss: the chunk given, else the library's default for the
                # head (the plan's own choice: it depends on the head only).
                with _loss.planned(self.loss_chunk_tokens):
                    return loss_fn(r, x, batch)

            self._embed = jax.jit(embed)
            self._embed_traced = embed
            self._head = jax.jit(jax.value_and_grad(chunked_loss, argnums=(0, 1)))
            self._loss = jax.jit(chunked_loss)
        opt = self.resident_optimizer

        def resident_grads(r, batch, g_head, g_x, g_diff, mask):
            # The embedding's backward (recomputed) added to the head's: the residents' grads.
            def f(r_):
                hidden, extras = embed(r_, batch)
                leaves = jax.tree_util.tree_leaves(extras)
                return hidden, [e for e, m in zip(leaves, mask) if m]

            _, vjp = jax.vjp(f, r)
            (g_embed,) = vjp((g_x, list(g_diff)))
            return jax.tree_util.tree_map(jnp.add, g_head, g_embed)

        def finish(r, opt_state, batch, g_head, g_x, g_diff, mask):
            # The residents' grads and their optax update.
            grads = resident_grads(r, batch, g_head, g_x, g_diff, mask)
            if opt is None:
                return r, opt_state
            return apply_optax(opt, r, opt_state, grads)

        held = self.block_optimizer.holds_grads
        if held:
            # Updates wait for the host (clipping, accumulation): the step returns the
            # residents' grads, and _HeldUpdates updates every `accumulation` steps.
            self._resident_grads = jax.jit(resident_grads, static_argnums=(5,))
            self._compile_held()
        else:
            self._finish = jax.jit(finish, static_argnums=(6,))
        self._probe = jax.jit(lambda: jnp.zeros((), jnp.int32))
        if self._ffi is not None:
            apply = _ffi_blocks.ffi_apply(self, call_block)
            self._apply_scheduled = apply
            self._apply_blocks = lambda hidden, *extras: apply(None, hidden, *extras)
            self._programs = {}  # batch signature -> the jitted step for its plan
            self._program_parts = (embed, opt, held)

    def _program_for(self, batch, given=None):
        """The jitted step for this batch's shape: its plan made on its first step (measured
        on the program that recomputes every block where the device is known), then the
        program executing the plan's choices; self.plan is the batch's plan. given: the batch
        the program takes where it is not `batch` (under data parallel the rows of all, while
        the plan is made for this process's rows, what its device computes)."""
        given = batch if given is None else given
        key = signature(batch)
        if key not in self._programs:
            chunk = self.loss_chunk_tokens  # None: the library's default, the plan's too
            measured = {}

            def peak(schedule):
                measured[schedule] = jax.jit(self._ffi_program(schedule, chunk))
                stats = measured[schedule].lower(self.residents, self.opt_state,
                                                 given).compile().memory_analysis()
                return (stats.argument_size_in_bytes + stats.output_size_in_bytes +
                        stats.temp_size_in_bytes - stats.alias_size_in_bytes)

            plan = self._step_plan(batch, peak)
            schedule = self.schedule(plan)
            # The measured program where the plan chose what it does (its chunk is the plan's:
            # the one given, else the library's default for the head), so jax.jit's caches
            # serve its trace and compile again.
            self._programs[key] = (plan, measured.get(schedule) or jax.jit(
                self._ffi_program(schedule, plan.loss_chunk_tokens)))
        self.plan, program = self._programs[key]
        return program

    def _ffi_program(self, schedule, chunk):
        """Trainer.step as one function for jax.jit: embed, the streamed blocks
        (apply_blocks: the executor's whole step as ops, per block as `schedule` says), the
        head's loss (chunked_cross_entropy in it over `chunk` tokens); the grads of the
        head, the blocks' input and the extras, the embedding's vjp, the residents' optax
        update (held: (loss, the residents' grads) instead, for _HeldUpdates). The blocks are
        differentiated through their input, so they train even with frozen residents. Under
        data parallel one program over every rank's device (strata.jax._data_parallel): the
        loss and the residents' grads averaged over the ranks, the blocks' inside
        apply_blocks."""
        apply, loss_fn = self._apply_scheduled, self.loss_fn
        embed, opt, held = self._program_parts
        ranks = self.data_parallel

        def program(r, opt_state, batch):
            def split(r_):
                hidden, extras = embed(r_, batch)
                leaves, extras_def = jax.tree_util.tree_flatten(extras)
                mask = [bool(jnp.issubdtype(jnp.asarray(e).dtype, jnp.inexact))
                        for e in leaves]
                return (hidden, [e for e, m in zip(leaves, mask) if m]), (leaves, extras_def,
                                                                          mask)

            (hidden, diff), embed_vjp, (leaves, extras_def, mask) = jax.vjp(split, r,
                                                                            has_aux=True)

            def head(r_, x, d):
                it = iter(d)
                merged = [next(it) if m else e for e, m in zip(leaves, mask)]
                extras = jax.tree_util.tree_unflatten(extras_def, merged)
                with _loss.planned(chunk):
                    return loss_fn(r_, apply(schedule, x, *extras), batch)

            loss, (g_head, g_x, g_diff) = jax.value_and_grad(head, argnums=(0, 1, 2))(
                r, hidden, diff)
            (g_embed,) = embed_vjp((g_x, g_diff))
            grads = jax.tree_util.tree_map(jnp.add, g_head, g_embed)
            if ranks is not None:
                loss, grads = ranks.mean((loss, grads))
            if held:
                return loss, grads
            if opt is None:
                return loss, r, opt_state
            return (loss,) + apply_optax(opt, r, opt_state, grads)

        return program if ranks is None else ranks.wrap(program)
