"""StreamedTrainer: the training step of a JAX Llama-style model with its blocks streamed."""
import jax
import jax.numpy as jnp
import numpy as np

from .. import core
from ..core import BACKWARD, FORWARD, VIEW_GRAD, VIEW_WEIGHT
from . import models

_NAMES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16"}


class StreamedTrainer:
    """config: strata.llama.LlamaConfig; blocks, residents: as models.init_params returns (the
    blocks are copied into Strata and the host copies may be dropped). dtype: the compute dtype
    of the streamed weights (fp32 masters either way). backend: "cuda" or "host" (default:
    cuda when JAX's default device is a GPU)."""

    def __init__(self, config, blocks, residents, lr=1e-3, weight_decay=0.0, dtype=jnp.float32,
                 gpu_budget=None, host_budget=None, nvme=None, backend=None, threads=0):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.lr, self.wd = lr, weight_decay
        self.device = jax.devices()[0]
        if backend is None:
            backend = "cuda" if self.device.platform == "gpu" else "host"
        hbm, dram = core.streaming_budgets(
            [sum(int(np.prod(a.shape)) for a in b.values()) for b in blocks], self.dtype.itemsize)
        gpu_budget = hbm if gpu_budget is None else gpu_budget
        host_budget = dram if host_budget is None else host_budget
        self.runtime = core.Runtime(backend=backend, hbm_budget=gpu_budget,
                                    dram_budget=host_budget, nvme=nvme)
        self.optimizer = core.Optimizer(self.runtime, "adamw", lr=lr, weight_decay=weight_decay,
                                        threads=threads)
        self.keys = models.BLOCK_KEYS
        self.weights, self.grads = [], []
        for i, block in enumerate(blocks):
            ws, gs = [], []
            for key in self.keys:
                value = np.asarray(block[key])
                name = "layers.%d.%s" % (i, key)
                w = self.runtime.register(name, value.shape, _NAMES[self.dtype], "weight")
                g = self.runtime.register(name + ".grad", value.shape, _NAMES[self.dtype], "grad")
                working = np.ascontiguousarray(value.astype(self.dtype))
                w.write_pointer(working.ctypes.data, working.nbytes)
                self.optimizer.add_param(w, g)
                if value.dtype == np.float32 and self.dtype != jnp.float32:
                    master = np.ascontiguousarray(value)
                    self.optimizer.state(w, "master").write_pointer(master.ctypes.data, master.nbytes)
                ws.append(w)
                gs.append(g)
            self.weights.append(ws)
            self.grads.append(gs)
        self.executor = core.Executor(
            self.runtime, [{"name": "layers.%d" % i, "weights": ws, "grads": gs}
                           for i, (ws, gs) in enumerate(zip(self.weights, self.grads))])
        self.optimizer.attach(self.executor)
        # Residents on the device: fp32 masters and AdamW state in JAX.
        self.resident = {k: jnp.asarray(v, jnp.float32) for k, v in residents.items()}
        self.m = {k: jnp.zeros_like(v) for k, v in self.resident.items()}
        self.v = {k: jnp.zeros_like(v) for k, v in self.resident.items()}
        self.t = 0
        cfg = config
        self._forward = jax.jit(lambda p, x, c, s: models.block_forward(cfg, p, x, c, s))

        def backward(p, x, c, s, g):
            _, vjp = jax.vjp(lambda p_, x_: models.block_forward(cfg, p_, x_, c, s), p, x)
            return vjp(g)

        self._backward = jax.jit(backward)
        self._head = jax.jit(jax.value_and_grad(
            lambda r, x, ids: models.head_loss(cfg, r, x, ids), argnums=(0, 1)))
        self._embed_grad = jax.jit(lambda e, ids, g: jax.vjp(lambda e_: e_[ids], e)[1](g)[0])
        self._adamw = jax.jit(models.adamw)

    def _bind(self, layer, phase):
        return {key: jax.dlpack.from_dlpack(self.executor.view(layer, phase, VIEW_WEIGHT, k))
                for k, key in enumerate(self.keys)}

    def step(self, ids):
        """One training step on token ids (batch, seq); returns the loss (a float)."""
        cfg, ex = self.config, self.executor
        ids = jnp.asarray(ids)
        self.optimizer.set_group(0, self.lr, self.wd)
        res = {k: v.astype(self.dtype) for k, v in self.resident.items()}
        x = res["embed"][ids]
        cos, sin = models.rotary(cfg, ids.shape[1], self.dtype)
        ex.step_begin()
        inputs = []
        layers = len(self.weights)
        for layer in range(layers):
            # JAX's streams are not visible to Strata: wait here for the layer's data, and let
            # JAX finish with the slot before releasing it.
            ex.acquire(layer, FORWARD, host_wait=True)
            p = self._bind(layer, FORWARD)
            inputs.append(x)
            x = self._forward(p, x, cos, sin)
            x.block_until_ready()
            del p
            ex.release(layer, FORWARD)
        loss, (g_res, g_x) = self._head({"norm": res["norm"], "head": res["head"]}, x, ids)
        for layer in reversed(range(layers)):
            ex.acquire(layer, BACKWARD, host_wait=True)
            p = self._bind(layer, BACKWARD)
            g_p, g_x = self._backward(p, inputs[layer], cos, sin, g_x)
            g_x.block_until_ready()
            for k, key in enumerate(self.keys):
                g = g_p[key]
                g.block_until_ready()
                ex.write_view(layer, BACKWARD, VIEW_GRAD, k, g.unsafe_buffer_pointer(), g.nbytes)
            del p, g_p
            ex.release(layer, BACKWARD)
        ex.step_end()
        grads = {"norm": g_res["norm"], "head": g_res["head"],
                 "embed": self._embed_grad(res["embed"], ids, g_x)}
        self.t += 1
        for k in self.resident:
            self.resident[k], self.m[k], self.v[k] = self._adamw(
                self.resident[k], grads[k].astype(jnp.float32), self.m[k], self.v[k], self.t,
                self.lr, wd=self.wd)
        return float(loss)

    def synchronize(self):
        self.optimizer.synchronize()

    def close(self):
        self.runtime.close()
