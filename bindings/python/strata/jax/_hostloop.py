"""The host-synchronised step (where the FFI ops cannot be had): a loop of per-layer jitted
programs over DLPack views of the executor's slots; and what both step paths share: the batch
checked against tracing, a failed step's abort."""
import warnings

import jax
import jax.numpy as jnp

from ..core import BACKWARD, FORWARD, VIEW_GRAD, VIEW_WEIGHT


class _HostLoop:
    """Trainer's host-synchronised step (a mixin of Trainer)."""

    def _bind(self, layer, phase):
        return [jax.dlpack.from_dlpack(self.executor.view(layer, phase, VIEW_WEIGHT, k))
                for k in range(len(self.names))]

    def _prepare(self, batch, what, residents=None):
        residents = self.residents if residents is None else residents
        for leaf in jax.tree_util.tree_leaves(batch):
            if isinstance(leaf, jax.core.Tracer):
                raise TypeError(self._in_trace_message(what))
        hidden, extras = self._embed(residents, batch)
        if any(isinstance(a, jax.core.Tracer) for a in jax.tree_util.tree_leaves(hidden)):
            raise TypeError(self._in_trace_message(what))
        leaves, extras_def = jax.tree_util.tree_flatten(extras)
        mask = tuple(bool(jnp.issubdtype(jnp.asarray(e).dtype, jnp.inexact)) for e in leaves)
        diff = [e for e, m in zip(leaves, mask) if m]
        const = [e for e, m in zip(leaves, mask) if not m]
        return hidden, diff, const, mask, extras_def

    @staticmethod
    def _in_trace_message(what):
        return ("strata.jax.Trainer.%s cannot run inside jax.jit, grad or vmap: it drives "
                "Strata's executor from the host between XLA programs (each block's program "
                "is jitted already). Call it outside any transformation." % what)

    def _check_not_traced(self, batch, what):
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(batch)) \
                or isinstance(self._probe(), jax.core.Tracer):
            raise TypeError(self._in_trace_message(what))

    def _step_host(self, batch):
        """The step as a loop of per-layer programs, each layer acquired and released by the
        host around its program."""
        hidden, diff, const, mask, extras_def = self._prepare(batch, "step")
        # Planned like the FFI path's step (self.plan says what the library chose), but the
        # loop executes only its loss chunk: each block recomputes from its input, kept on
        # the device.
        self.plan = self._step_plan(batch, lambda schedule: None)
        held = self.block_optimizer.holds_grads
        if not held:  # held updates set them when they update (_HeldUpdates)
            self._set_hyperparameters(self.step_count)
        ex = self.executor
        released = 0
        live = None
        ex.step_begin()
        try:
            inputs, x = [], hidden
            for layer in range(self.layers):
                # JAX's streams are not visible to Strata: wait here for the layer's data, and
                # let JAX finish with the slot before releasing it.
                ex.acquire(layer, FORWARD, host_wait=True)
                p = self._bind(layer, FORWARD)
                inputs.append(x)
                x = live = self._forward(p, x, diff, const, mask, extras_def)
                jax.block_until_ready(x)
                del p
                ex.release(layer, FORWARD)
            loss, (g_head, g_x) = self._head(self.residents, x, batch)
            acc = [jnp.zeros_like(d) for d in diff]
            for layer in reversed(range(self.layers)):
                ex.acquire(layer, BACKWARD, host_wait=True)
                p = self._bind(layer, BACKWARD)
                g_p, g_x, acc = live = self._backward(p, inputs[layer], diff, const, g_x, acc,
                                                      mask, extras_def)
                jax.block_until_ready(live)
                for k, g in enumerate(g_p):
                    ex.write_view(layer, BACKWARD, VIEW_GRAD, k, g.unsafe_buffer_pointer(),
                                  g.nbytes)
                del p, g_p
                live = None
                ex.release(layer, BACKWARD)
                released += 1
                inputs[layer] = None
            ex.step_end()
        except BaseException:
            self._abort(live, released)
            raise
        if held:
            grads = self._resident_grads(self.residents, batch, g_head, g_x, acc, mask)
            self._steps += 1
            self._held_step(grads)
            return float(loss)
        self.residents, self.opt_state = self._finish(self.residents, self.opt_state, batch,
                                                      g_head, g_x, acc, mask)
        self._steps += 1
        return float(loss)

    def _abort(self, live, released, exact=True):
        """A step raised: let JAX finish with the slots, then replace the executor (whose step
        cannot be completed without feeding the optimizer zero grads)."""
        try:
            if live is not None:
                jax.block_until_ready(live)
        except Exception:
            pass
        self._new_executor()
        if self.block_optimizer.holds_grads:
            # The released blocks' grads are held, not applied: the accumulation goes.
            self._drop_held("the step failed")
            return
        if released:
            warnings.warn("strata.jax: the step failed after %s block(s) released their grads: "
                          "those blocks were updated with this step's grads; the step is not "
                          "counted" % (released if exact else "some"), RuntimeWarning,
                          stacklevel=3)
