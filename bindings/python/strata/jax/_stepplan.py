"""The Trainer's step plan: what strata.jax measures for libstrata's step-memory plan
(strata.step_plan.plan_step; the rules are runtime/step/'s) and the plan kept per batch shape.

Measured here, in JAX, on abstract values (nothing runs): the batch's tokens and one block's
checkpoint (its input's bytes, from the embedding's output shape); what a block saves for its
backward pass when it keeps everything and when it keeps only the outputs it names
(saved_names, jax.ad_checkpoint.checkpoint_name): the bytes of its vjp's residuals under each
jax.checkpoint policy, less its weights and extras; the loss head's vocabulary and hidden size
(the chunked_cross_entropy calls seen while the loss is traced); the device's memory (XLA's
pool, from memory_stats) or the step_memory the user gave; and, for the kept-activations
decision, the step's peak as XLA's compiled memory analysis predicts it with every block
recomputing. Every block streams (strata.jax has no resident blocks), so a block keeps
selectively or recomputes. The plan is made again for each new batch shape."""
import warnings

import jax
import numpy as np

from .. import step_plan
from . import _loss

_WARNED_SHORT = []


def _nbytes(tree):
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree_util.tree_leaves(tree))


def signature(batch):
    """What a program and its plan are kept by: the batch's structure, shapes and dtypes."""
    leaves, tree = jax.tree_util.tree_flatten(batch)
    return tree, tuple((tuple(np.shape(a)), str(getattr(a, "dtype", type(a)))) for a in leaves)


class _StepPlanning:
    """Trainer's step plan (a mixin of Trainer)."""

    def _init_plan(self, step_memory, saved_names, loss_chunk_tokens):
        if step_memory is not None and (isinstance(step_memory, bool) or
                                        not isinstance(step_memory, int) or step_memory <= 0):
            raise ValueError("strata.jax: step_memory must be a positive number of bytes (the "
                             "device memory the step plan plans within), got %r" % (step_memory,))
        names = () if saved_names is None else saved_names
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError("strata.jax: saved_names must be a sequence of the names the block "
                            "tags with jax.ad_checkpoint.checkpoint_name, got %r" % (saved_names,))
        if loss_chunk_tokens is not None and (isinstance(loss_chunk_tokens, bool) or
                                              not isinstance(loss_chunk_tokens, int) or
                                              loss_chunk_tokens < 1):
            raise ValueError("strata.jax: loss_chunk_tokens must be a positive int, got %r"
                             % (loss_chunk_tokens,))
        self.step_memory, self.saved_names = step_memory, tuple(names)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.plans = {}  # batch signature (or the hidden state's, apply_blocks) -> StepPlan
        self.plan = None  # the plan of the last batch shape stepped

    def _device_figures(self):
        """The device as the plan counts it (XLA's pool is all "held"); none on a device
        without memory statistics (the CPU) unless step_memory is given."""
        if self.step_memory is not None:
            total = self.step_memory
        else:
            try:
                stats = self.device.memory_stats() or {}
            except Exception:  # noqa: BLE001: a backend without statistics
                stats = {}
            total = int(stats.get("bytes_limit", 0))
        if not total:
            return {}
        return {"device_total_bytes": total, "device_free_bytes": 0,
                "framework_held_bytes": total}

    def _residual_bytes(self, hidden, extras, policy):
        """Bytes a block saves for its backward under the jax.checkpoint `policy` (None: no
        checkpoint, everything), at this hidden state's shape: its vjp's residuals less its
        weights, its input and its extras (passed to the backward pass anyway)."""
        weights = [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes[0], self.leaf_dtypes)]

        def residuals(w, x, ex):
            f = lambda w_, x_: self.block_fn(jax.tree_util.tree_unflatten(self.treedef, w_),  # noqa: E731
                                             x_, *ex)
            if policy is not None:
                f = jax.checkpoint(f, policy=policy)
            _, vjp = jax.vjp(f, w, x)
            known = list(w) + [x] + jax.tree_util.tree_leaves(ex)
            return [leaf for leaf in jax.tree_util.tree_leaves(vjp)
                    if not any(leaf is k for k in known)]

        return _nbytes(jax.eval_shape(residuals, weights, hidden, tuple(extras)))

    def _profile_blocks(self, hidden, extras):
        whole = self._residual_bytes(hidden, extras, None)
        selective = (self._residual_bytes(hidden, extras,
                                          jax.checkpoint_policies.save_only_these_names(
                                              *self.saved_names))
                     if self.saved_names else 0)
        blocks = [step_plan.Block(sum(int(np.prod(s)) for s in shapes), keep_whole_bytes=whole,
                                  keep_selective_bytes=selective, residency="streamed")
                  for shapes in self.shapes]
        return blocks, whole

    def _make_plan(self, hidden, extras, heads=(), in_use=0, grads=0, peak=None):
        """The library's plan for a step whose blocks see `hidden` (abstract): checkpoint homes
        and kept activations where the device is known (the latter given the measured `peak`
        of a step that recomputes every block), the loss chunk where the head is."""
        blocks, saved = self._profile_blocks(hidden, extras)
        device = self._device_figures()
        vocab, width = heads[0] if heads else (0, 0)
        fields = dict(vocab=vocab, hidden=width, loss_chunked=bool(heads),
                      loss_chunk_tokens=self.loss_chunk_tokens or 0)
        if device:
            fields.update(device, plan_checkpoints=True,
                          tokens=int(np.prod(hidden.shape[:-1])),
                          checkpoint_bytes=_nbytes(hidden), block_saved_bytes=saved,
                          block_saved_measured=True, in_use_bytes=min(in_use,
                                                                      device["device_total_bytes"]),
                          backward_grad_bytes=grads)
            if peak is not None:
                peak = min(peak, device["device_total_bytes"])
                fields.update(plan_kept=True, step_allocated_peak_bytes=peak,
                              step_reserved_peak_bytes=peak)
        plan = step_plan.plan_step(blocks, **fields)
        if device and not plan.fits and not _WARNED_SHORT:
            _WARNED_SHORT.append(True)
            warnings.warn("strata.jax: the step plan predicts this batch short of device memory "
                          "even with every checkpoint in host memory:\n" + plan.text,
                          RuntimeWarning, stacklevel=4)
        return plan

    @staticmethod
    def schedule(plan):
        """Per block, its (keep, checkpoint home) from the plan."""
        return tuple((b["keep"], b["checkpoint"]) for b in plan.blocks)

    def _blocks_schedule(self, hidden, extras):
        """apply_blocks in the user's own jit: the plan for this hidden state's shape (no loss
        head, no measured step: checkpoint homes only), made once per shape."""
        key = ("apply_blocks", tuple(hidden.shape), str(hidden.dtype))
        if key not in self.plans:
            abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                              (hidden, tuple(extras)))
            self.plans[key] = self._make_plan(abstract[0], abstract[1])
        self.plan = self.plans[key]
        return self.schedule(self.plan)

    def _step_plan(self, batch, measure):
        """The plan for this batch shape (made on its first step): the embedding's and the
        loss's shapes traced abstractly; measure(schedule) -> the compiled step's predicted
        peak, asked for only where the device is known."""
        key = signature(batch)
        if key in self.plans:
            return self.plans[key]
        embed, loss_fn = self._embed_traced, self.loss_fn
        hidden, extras = jax.eval_shape(embed, self.residents, batch)
        heads = []
        with _loss.planned(None, heads):
            # A new function each time: eval_shape caches its traces by function, and a trace
            # served from that cache would record no head.
            jax.eval_shape(lambda r, x, b: loss_fn(r, x, b), self.residents, hidden, batch)
        in_use = _nbytes((self.residents, self.opt_state, batch))
        grads = _nbytes(self.residents) if self.resident_optimizer is not None else 0
        peak = None
        if self._device_figures():
            recompute = (("recompute", "hbm"),) * self.layers
            peak = measure(recompute)
        plan = self._make_plan(hidden, extras, heads, in_use, grads, peak)
        self.plans[key] = plan
        return plan
