"""Updates that wait for the host: global-norm clipping and accumulation with optax's semantics
(optax.MultiSteps(optax.chain(optax.clip_by_global_norm(c), ...), every_k_schedule=k)).

The runtime's own max_grad_norm and accumulation_steps see only the streamed blocks' grads, but
optax's global norm is over every trained leaf, the residents' too. So with either option the
optimizer runs in the runtime's explicit update mode: each executor step adds its grads to what
each param holds (summed in fp32 over micro-batches), the step returns the residents' grads,
which the Trainer sums on the device; every `accumulation` steps the Trainer measures the global
norm (the params' sums of squares from the runtime, the residents' on the device), scales every
grad by (1/k) * min(1, c / norm of the mean), queues the blocks' updates and zeroes their grads,
and applies the residents' optax update to their scaled sum."""
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ._programs import apply_optax


class _HeldUpdates:
    """Trainer's clipped and accumulated updates (a mixin of Trainer; used when its
    block_optimizer.holds_grads)."""

    def _compile_held(self):
        opt = self.resident_optimizer
        self._grad_sum = None  # the residents' grads summed over this update's micro-batches
        self._add_grads = jax.jit(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b))
        self._sum_squares = jax.jit(lambda g: sum(
            (jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(g)),
            jnp.zeros((), jnp.float32)))

        def update(r, opt_state, grads, factor):
            scaled = jax.tree_util.tree_map(lambda g: (g * factor).astype(g.dtype), grads)
            return apply_optax(opt, r, opt_state, scaled)

        self._apply_held = jax.jit(update) if opt is not None else None

    def _params(self):
        return [w for ws in self.weights for w in ws]

    def _held_step(self, grads):
        """After a micro-batch's step (counted): add the residents' grads; on the last
        micro-batch of an update, update."""
        if self._apply_held is not None:
            self._grad_sum = grads if self._grad_sum is None else \
                self._add_grads(self._grad_sum, grads)
        if self.step_count % self.block_optimizer.accumulation == 0:
            self._update_held()

    def _update_held(self):
        adamw, k = self.block_optimizer, self.block_optimizer.accumulation
        params = self._params()
        squares = sum(self.optimizer.grad_info(w)[1] for w in params)
        ranks = self.data_parallel
        if ranks is not None:  # this rank's chunks: the blocks' sum is over its shard group's
            squares = ranks.shard_group_sum(squares)
        if self._grad_sum is not None:  # (under data parallel averaged already: replicas)
            squares += float(np.asarray(self._sum_squares(self._grad_sum).addressable_data(0)))
        norm = math.sqrt(squares) / k  # of the mean grads, as MultiSteps hands them on
        clip = 1.0
        if adamw.max_grad_norm is not None and not norm < adamw.max_grad_norm:
            clip = adamw.max_grad_norm / norm  # optax.clip_by_global_norm's rule
        factor = clip / k
        if factor != 1.0:
            for w in params:
                self.optimizer.grad_scale(w, factor)
        # Schedules see the updates done before this one, as optax's inner count.
        self._set_hyperparameters(self.step_count // k - 1)
        self.optimizer.step()
        for w in params:
            self.optimizer.grad_zero(w)
        if self._grad_sum is not None:
            self.residents, self.opt_state = self._apply_held(
                self.residents, self.opt_state, self._grad_sum, jnp.float32(factor))
            self._grad_sum = None
        self.last_grad_norm = norm

    @property
    def micro_step(self):
        """Micro-batches added towards the next update (0 between updates)."""
        return self.step_count % self.block_optimizer.accumulation

    def _drop_held(self, why):
        """Drop an accumulation in progress (after a failed step, or before a load): zero the
        blocks' held grads and the residents' sum; the step count goes back to the last
        update."""
        self._grad_sum = None
        done = self.micro_step
        for w in self._params():
            self.optimizer.grad_zero(w)
        if done:
            self.step_count = self.step_count - done
            if why:
                warnings.warn("strata.jax: %s: the %d micro-batch(es) accumulated towards the "
                              "next update were dropped (the step count is back at the last "
                              "update)" % (why, done), RuntimeWarning, stacklevel=4)
