"""The Trainer's jitted programs: a block's forward and backward, the embedding and head, the
residents' update; on the FFI path the streamed blocks as one differentiable JAX function
(begin, acquire, release and end ops around the blocks) and the whole step as one program."""
import jax
import jax.numpy as jnp

from . import _ffi
from ..core import BACKWARD, FORWARD
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
            self._embed = jax.jit(embed)
            self._head = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
            self._loss = jax.jit(loss_fn)
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
            self._apply_blocks = self._ffi_apply(call_block, backward)
            if embed_fn is not None:
                self._program = jax.jit(self._ffi_program(embed, opt, held))

    def _ffi_apply(self, call_block, backward):
        """The streamed blocks as a differentiable JAX function f(x, diff, const) -> x for one
        (mask, extras_def): a jax.custom_vjp whose forward begins the executor's step (begin op)
        and runs the blocks (acquire op, block), and whose backward runs them in reverse
        (acquire op, recomputed vjp, release op with the grads) and ends the step (end op).
        Called without differentiation: a forward-only step, abandoned at its end."""
        session, layers, scan = self._ffi, self.layers, self.scan

        def shapes(layer):
            return [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes[layer],
                                                               self.leaf_dtypes)]

        def build(mask, extras_def):
            def forward(x, diff, const, mode):
                token = session.begin(jnp.zeros((), jnp.uint32), mode)
                # Each acquire takes the hidden state (its grad in the backward pass) as an
                # operand: XLA cannot issue it before the previous block, so at most one
                # block's weights (and the slots Strata prefetches into) are in HBM at a time.
                if scan:
                    def body(carry, _):
                        x_, tok = carry
                        tok, w = session.acquire(tok, x_, FORWARD, shapes(0))
                        return (call_block(w, x_, diff, const, mask, extras_def), tok), x_

                    (x, token), inputs = jax.lax.scan(body, (x, token), None, length=layers)
                else:
                    inputs = []
                    for layer in range(layers):
                        token, w = session.acquire(token, x, FORWARD, shapes(layer), layer)
                        inputs.append(x)
                        x = call_block(w, x, diff, const, mask, extras_def)
                return x, inputs, token

            @jax.custom_vjp
            def apply(x, diff, const):
                x, _, token = forward(x, diff, const, _ffi.EVAL)
                session.end(token, _ffi.EVAL)
                return x

            def apply_fwd(x, diff, const):
                x, inputs, token = forward(x, diff, const, _ffi.TRAIN)
                return x, (inputs, diff, const, token)

            def apply_bwd(res, g_x):
                inputs, diff, const, token = res
                acc = [jnp.zeros_like(d) for d in diff]
                if scan:
                    def body(carry, x_in):
                        g, acc_, tok = carry
                        tok, w = session.acquire(tok, g, BACKWARD, shapes(0))
                        g_w, g, acc_ = backward(w, x_in, diff, const, g, acc_, mask, extras_def)
                        return (g, acc_, session.release(tok, g_w)), None

                    (g_x, acc, token), _ = jax.lax.scan(body, (g_x, acc, token), inputs,
                                                        reverse=True)
                else:
                    for layer in reversed(range(layers)):
                        token, w = session.acquire(token, g_x, BACKWARD, shapes(layer), layer)
                        g_w, g_x, acc = backward(w, inputs[layer], diff, const, g_x, acc, mask,
                                                 extras_def)
                        token = session.release(token, g_w)
                session.end(token, _ffi.TRAIN)
                return g_x, list(acc), [None] * len(const)

            apply.defvjp(apply_fwd, apply_bwd)
            return apply

        cache = {}

        def apply_blocks(hidden, *extras):
            leaves, extras_def = jax.tree_util.tree_flatten(tuple(extras))
            mask = tuple(bool(jnp.issubdtype(jnp.asarray(e).dtype, jnp.inexact))
                         for e in leaves)
            diff = [e for e, m in zip(leaves, mask) if m]
            const = [e for e, m in zip(leaves, mask) if not m]
            key = (mask, extras_def)
            if key not in cache:
                cache[key] = build(mask, extras_def)
            return cache[key](hidden, diff, const)

        return apply_blocks

    def _ffi_program(self, embed, opt, held):
        """Trainer.step as one function for jax.jit: embed, the streamed blocks
        (apply_blocks: the executor's whole step as ops), the head's loss; the grads of the
        head, the blocks' input and the extras, the embedding's vjp, the residents' optax
        update (held: (loss, the residents' grads) instead, for _HeldUpdates). The blocks are
        differentiated through their input, so they train even with frozen residents."""
        apply_blocks, loss_fn = self._apply_blocks, self.loss_fn

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
                return loss_fn(r_, apply_blocks(x, *extras), batch)

            loss, (g_head, g_x, g_diff) = jax.value_and_grad(head, argnums=(0, 1, 2))(
                r, hidden, diff)
            (g_embed,) = embed_vjp((g_x, g_diff))
            grads = jax.tree_util.tree_map(jnp.add, g_head, g_embed)
            if held:
                return loss, grads
            if opt is None:
                return loss, r, opt_state
            return (loss,) + apply_optax(opt, r, opt_state, grads)

        return program
