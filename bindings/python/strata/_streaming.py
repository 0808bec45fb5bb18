"""The streaming loop's handles: Executor (a graph of layers, its plan and the executor that
runs it) and Optimizer (the runtime's CPU optimizer, attached to an executor). Re-exported by
strata.core."""
import ctypes

from . import _lib
from ._abi import (GRAD_SUMS, MASTER_LAYOUTS, OPTIMIZERS, STATE_PLACEMENTS, STATES,
                   UPDATE_MODES, dump_text)
from ._runtime import Tensor
from .dlpack import DLPackView
from .errors import check

L = _lib.lib


class Executor:
    """A graph of layers, planned and executed: the streaming loop's handle.

    layers: list of dicts {"name", "weights": [Tensor], "grads": [Tensor],
    "forward_flops", "backward_flops"}."""

    def __init__(self, runtime, layers, slot_budget=0, micro_batches=1, residents=()):
        self.runtime = runtime
        self._graph = ctypes.c_void_p()
        self._plan = ctypes.c_void_p()
        self._handle = ctypes.c_void_p()
        check(L.strata_graph_create(runtime.handle, ctypes.byref(self._graph)))
        try:
            for i, layer in enumerate(layers):
                w = (ctypes.c_void_p * len(layer["weights"]))(*[t.handle.value for t in layer["weights"]])
                grads = layer.get("grads", [])
                g = (ctypes.c_void_p * max(len(grads), 1))(*[t.handle.value for t in grads])
                desc = _lib.LayerDesc(name=layer.get("name", "layer.%d" % i).encode(), weights=w,
                                      weight_count=len(layer["weights"]), grads=g,
                                      grad_count=len(grads),
                                      forward_flops=layer.get("forward_flops", 0.0),
                                      backward_flops=layer.get("backward_flops", 0.0))
                check(L.strata_graph_add_layer(self._graph, ctypes.byref(desc), None))
            for t in residents:
                check(L.strata_graph_add_resident(self._graph, t.handle))
            config = _lib.PlanConfig()
            check(L.strata_plan_config_init(ctypes.byref(config)))
            config.hbm_slot_budget_bytes = int(slot_budget)
            config.micro_batches = micro_batches
            check(L.strata_plan_create(self._graph, ctypes.byref(config), ctypes.byref(self._plan)))
            check(L.strata_executor_create(self._plan, ctypes.byref(self._handle)))
        except BaseException:
            self.close()
            raise
        runtime._owned.append(self)

    @property
    def handle(self):
        return self._handle

    def plan_info(self):
        info = _lib.PlanInfo()
        check(L.strata_plan_get_info(self._plan, ctypes.byref(info)))
        return info

    def plan_text(self):
        return dump_text(L.strata_plan_dump, self._plan, 1)

    def stats(self):
        s = _lib.ExecutorStats()
        check(L.strata_executor_get_stats(self._handle, ctypes.byref(s)))
        return {k: getattr(s, k) for k in ("steps", "loads", "reused_loads", "bytes_in", "bytes_out")}

    def step_begin(self):
        check(L.strata_step_begin(self._handle))

    def step_end(self):
        check(L.strata_step_end(self._handle))

    def step_abort(self, stream=None):
        """Abandon the running step (no-op without one): the next step_begin starts afresh."""
        check(L.strata_step_abort(self._handle, stream))

    def acquire(self, layer, phase, stream=None, host_wait=False):
        """host_wait: block this thread until the layer's data is in HBM (for frameworks whose
        streams Strata cannot see, such as JAX); else `stream` is made to wait."""
        views = _lib.LayerViews()
        check(L.strata_layer_acquire(self._handle, layer, phase, stream, 2 if host_wait else 0,
                                     ctypes.byref(views)))
        return views

    def write_view(self, layer, phase, role, index, pointer, nbytes):
        """Copy nbytes from a device or host address into a view (synchronously)."""
        check(L.strata_layer_write_view(self._handle, layer, phase, role, index, pointer, nbytes))

    def release(self, layer, phase, stream=None):
        check(L.strata_layer_release(self._handle, layer, phase, stream))

    def view(self, layer, phase, role, index):
        """A DLPack producer for one view of the acquired layer (valid until release)."""
        out = ctypes.POINTER(_lib.DLManagedTensorVersioned)()
        check(L.strata_layer_export_dlpack(self._handle, layer, phase, role, index,
                                           ctypes.byref(out)))
        return DLPackView(out)

    def close(self):
        if self._handle:
            h, self._handle = self._handle, ctypes.c_void_p()
            check(L.strata_executor_destroy(h))
        if self._plan:
            check(L.strata_plan_destroy(self._plan))
            self._plan = ctypes.c_void_p()
        if self._graph:
            check(L.strata_graph_destroy(self._graph))
            self._graph = ctypes.c_void_p()


class Optimizer:
    """The runtime's optimizer (AdamW, SGD, Adam, Lion or Adagrad: `kind`, a key of OPTIMIZERS)
    over DRAM weights: fp32 masters and state."""

    def __init__(self, runtime, kind="adamw", update_mode="auto", state_placement="dram",
                 **hyper):
        config = _lib.OptimizerConfig()
        check(L.strata_optimizer_config_init(OPTIMIZERS[kind], ctypes.byref(config)))
        config.update_mode = UPDATE_MODES[update_mode]
        if state_placement not in STATE_PLACEMENTS:
            raise ValueError("state_placement %r is not one of %s"
                             % (state_placement, ", ".join(STATE_PLACEMENTS)))
        config.state_placement = STATE_PLACEMENTS[state_placement]
        for key, value in hyper.items():
            if not hasattr(config, key) or key == "struct_size":
                raise ValueError("unknown optimizer setting %r" % key)
            setattr(config, key, value)
        self.runtime = runtime
        self._handle = ctypes.c_void_p()
        check(L.strata_optimizer_create(runtime.handle, ctypes.byref(config), ctypes.byref(self._handle)))
        runtime._owned.append(self)

    @property
    def handle(self):
        return self._handle

    def add_param(self, weight, grad, group=0, master_layout="separate", grad_sum="accumulator"):
        """Make `weight` (with its grad tensor `grad`) a param of group `group`. master_layout:
        a key of MASTER_LAYOUTS; grad_sum: a key of GRAD_SUMS ("in_place": `grad` is an fp32
        tensor in HBM that the framework adds every backward pass's grad into, and the sum the
        update reads; strata_param_desc_t.grad_sum)."""
        for name, value, table in (("master_layout", master_layout, MASTER_LAYOUTS),
                                   ("grad_sum", grad_sum, GRAD_SUMS)):
            if value not in table:
                raise ValueError("%s must be one of %s, not %r" % (name, sorted(table), value))
        desc = _lib.ParamDesc(weight=weight.handle.value, grad=grad.handle.value, group=group,
                              master_layout=MASTER_LAYOUTS[master_layout],
                              grad_sum=GRAD_SUMS[grad_sum])
        check(L.strata_optimizer_add_param(self._handle, ctypes.byref(desc)))

    def master_read(self, weight, pointer, count):
        """The param's fp32 master (any layout or tier) into `count` floats at `pointer`."""
        check(L.strata_optimizer_master_read(self._handle, weight.handle, pointer, count))

    def master_write(self, weight, pointer, count):
        """Set the param's fp32 master from `count` floats at `pointer`, and its weight to it
        rounded (as an update writes them)."""
        check(L.strata_optimizer_master_write(self._handle, weight.handle, pointer, count))

    def set_group(self, group, lr, weight_decay, betas=None, eps=None):
        """A group's lr and weight decay and, when given, AdamW's betas and eps: read by the
        next update that has not started (torch reads its param groups at every step)."""
        if betas is None and eps is None:
            check(L.strata_optimizer_set_group(self._handle, group, lr, weight_decay))
            return
        # Every field given (what strata.torch passes at each step): nothing to read first.
        whole = betas is not None and eps is not None
        h = _lib.GroupHyperparams() if whole else self.group(group)
        h.lr, h.weight_decay = lr, weight_decay
        if betas is not None:
            h.beta1, h.beta2 = betas
        if eps is not None:
            h.eps = eps
        check(L.strata_optimizer_set_group_hyperparams(self._handle, group, ctypes.byref(h)))

    def group(self, group):
        """The group's current hyperparameters (a GroupHyperparams: lr, weight_decay, beta1,
        beta2, eps); a group not created yet reads as group 0."""
        h = _lib.GroupHyperparams()
        check(L.strata_optimizer_get_group(self._handle, group, ctypes.byref(h)))
        return h

    def attach(self, executor):
        check(L.strata_optimizer_attach(self._handle, executor.handle))

    def step(self):
        check(L.strata_optimizer_step(self._handle))

    def synchronize(self):
        check(L.strata_optimizer_synchronize(self._handle))

    def grad_info(self, weight):
        """Explicit mode: (has_grad, sum of squares, update count) of a param's held grad."""
        info = _lib.GradInfo()
        check(L.strata_optimizer_grad_info(self._handle, weight.handle, ctypes.byref(info)))
        return bool(info.has_grad), info.sum_squares, info.step

    def grad_read(self, weight, pointer, count):
        check(L.strata_optimizer_grad_read(self._handle, weight.handle, pointer, count))

    def grad_scale(self, weight, factor):
        check(L.strata_optimizer_grad_scale(self._handle, weight.handle, float(factor)))

    def grad_write(self, weight, pointer, count):
        """Set the param's held grad to `count` floats at `pointer` (stored in its grad tensor's
        dtype, or exactly in the fp32 accumulator after accumulation)."""
        check(L.strata_optimizer_grad_write(self._handle, weight.handle, pointer, count))

    def grad_zero(self, weight, keep_zeros=False):
        check(L.strata_optimizer_grad_zero(self._handle, weight.handle, 1 if keep_zeros else 0))

    def set_param_step(self, weight, step):
        check(L.strata_optimizer_set_param_step(self._handle, weight.handle, int(step)))

    def state(self, weight, kind):
        out = ctypes.c_void_p()
        check(L.strata_optimizer_get_state(self._handle, weight.handle, STATES[kind], ctypes.byref(out)))
        return Tensor(self.runtime, out)

    def stats(self):
        s = _lib.OptimizerStats()
        check(L.strata_optimizer_get_stats(self._handle, ctypes.byref(s)))
        out = {k: getattr(s, k) for k, _ in _lib.OptimizerStats._fields_ if k != "struct_size"}
        out["isa"] = s.isa.decode()
        out["binding"] = s.binding.decode()
        return out

    def close(self):
        if self._handle:
            h, self._handle = self._handle, ctypes.c_void_p()
            check(L.strata_optimizer_destroy(h))
