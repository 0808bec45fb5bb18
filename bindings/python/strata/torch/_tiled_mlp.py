"""The blocks' MLP over sequence tiles (issue 53; ALST's TiledMLP idea, written here for
strata.torch): at a long sequence a block's backward working set is dominated by its MLP's
intermediates, one row per token of the whole batch (an 8B Llama at 128k tokens: 3.5 GiB for
each of gate, up, the activation and their product, and their grads). The MLP is per token (no
token reads another), so it can run over tiles of the tokens and give the same rows.

The library's step plan decides how many tiles (strata_step_block_t.mlp_tiles,
runtime/step/tiles.cpp), from what strata.torch measures here (token_bytes: what the MLP saves
for its backward per token, on fake tensors, as the block's saved bytes are measured). This
module executes it:

- the MLP is the block's child module `mlp` (Hugging Face's decoder layers name it so, of any
  class; nothing is allow-listed). Its forward is replaced on the instance by one that runs
  over the tiles the last plan gave the block's position (1: the original forward, untouched);
- with grad, through TiledMLPFunction: the forward runs each tile without grad and saves only
  the MLP's input; the backward recomputes each tile with grad (the RNG and autocast state of
  its forward) and backpropagates it, so one tile's intermediates exist at a time. The weight
  grads are summed over the tiles (in fp32 for lower-precision weights, cast once) and given
  back as the function's grads for the parameters, so whatever receives them (the streamed
  block's recompute, autograd's AccumulateGrad) sees one grad per parameter;
- without grad (a streamed block's forward pass, evaluation): the tiles run one after the
  other into one output.

Rows are computed independently, so the output and the input's grad are each tile's rows as
the untiled MLP computes them (bit for bit wherever the matrix product's kernel computes a row
the same at either number of rows: on the CPU in these tests; a GPU's kernel choice may change
with the rows). The weight grads are sums over the tiles of [tile, out]^T x [tile, in]
products, a different order of the same sum: equal within the dtype's rounding of that sum.

The MLP must take the hidden states alone and return one tensor of the same tokens (a
mixture-of-experts block returning router logits is never tiled by the plan: token_bytes
measures 0 for it; forced tiles raise). Nor is one whose inner modules Hugging Face records
from (output_router_logits=True: the routers' logits, collected by transformers' forward hooks
for the auxiliary loss): run in tiles inside the function, without grad, they would be
recorded once per tile and carry no gradient. token_bytes measures 0 for an MLP with such
hooks, and one recording for the running forward runs whole (forced tiles raise)."""

import contextlib

import torch

from . import _captured
from ._measure import measure

# The attribute naming a decoder layer's MLP (Hugging Face's models, every family).
MLP_ATTRIBUTE = "mlp"
# The original forward kept on the instance while the tiled one is installed.
_ORIGINAL = "_strata_untiled_forward"


def find_mlp(block):
    """The block's MLP: its child module named `mlp`, any class; None without one."""
    mlp = getattr(block, MLP_ATTRIBUTE, None)
    return mlp if isinstance(mlp, torch.nn.Module) else None


def untiled(mlp):
    """The MLP's own forward (the tiled one installed or not)."""
    return mlp.__dict__.get(_ORIGINAL, mlp.forward)


def _recording_hooks(mlp):
    """Whether transformers' output-capturing hooks sit on the MLP or its inner modules (a
    mixture-of-experts router's, for output_router_logits)."""
    return any(_captured.is_recording_hook(hook) for module in mlp.modules()
               for hook in module._forward_hooks.values())


def records_now(mlp):
    """Whether the running forward records from the MLP's inner modules: transformers'
    collector is active and the MLP holds its hooks."""
    variable = _captured._collector_variable()
    return variable is not None and bool(variable.get()) and _recording_hooks(mlp)


def token_bytes(block, hidden, device):
    """What the block's MLP saves for its backward per token of `hidden` (the block's input,
    whose shape and dtype the MLP's input has), beside its input (a tiled MLP keeps that
    whole): measured on fake tensors. 0 where it cannot be tiled or measured (no `mlp`, an
    output that is not one tensor of the same tokens, an op without a fake kernel)."""
    mlp = find_mlp(block)
    if mlp is None or hidden is None or hidden.dim() < 2 or _recording_hooks(mlp):
        return 0
    run = untiled(mlp)
    shaped = []

    def probe(x):
        out = run(x)
        shaped.append(torch.is_tensor(out) and out.shape[:-1] == x.shape[:-1])
        return out

    measured = measure(probe, (hidden,), {}, device, list(mlp.parameters()))
    if measured is None or not all(shaped):
        return 0
    tokens = hidden.numel() // hidden.shape[-1]
    beside_input = measured[0] - hidden.numel() * hidden.element_size()
    return max(0, beside_input) // max(1, tokens)


def _tiles_of(x, tiles):
    """x [..., features] as views of at most `tiles` tiles of its tokens (the library's
    ceil(tokens / tiles) each, the last shorter), each of x's rank: [1, n, features] for a
    batch of sequences (a mixture-of-experts block reads batch, sequence and features from
    its input's shape), [n, features] for rows."""
    flat = x.reshape(-1, x.shape[-1])
    parts = flat.split(-(-flat.shape[0] // tiles))
    return [p.unsqueeze(0) for p in parts] if x.dim() >= 3 else list(parts)


def _rows(t):
    """A tile's (or its output's) tokens as rows: [n, features]."""
    return t.reshape(-1, t.shape[-1])


def _rng_state(device):
    return (torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _replaying(device, state, autocast):
    """A tile's recompute: its forward's RNG state (restored after) and autocast state."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        amp = contextlib.nullcontext() if autocast is None else \
            torch.autocast(device.type, dtype=autocast)
        with torch.enable_grad(), amp:
            yield


def _checked(mlp_name, out, tile):
    if not torch.is_tensor(out) or out.shape[:-1] != tile.shape[:-1]:
        raise TypeError(
            "strata.torch: the MLP %s returned %s, not one tensor of its input's %d tokens: it "
            "cannot run over sequence tiles (offload(mlp_tiles=) forced it)"
            % (mlp_name, type(out).__name__, tile.numel() // tile.shape[-1]))
    return out


class TiledMLPFunction(torch.autograd.Function):
    """Inputs: (run, tiles, name, x, *params): the MLP's forward, the tile count, its name for
    errors, its input [..., in] and its parameters. Saves x only."""

    @staticmethod
    def forward(ctx, run, tiles, name, x, *params):
        ctx.run, ctx.tiles, ctx.params = run, tiles, params
        ctx.autocast = torch.get_autocast_dtype(x.device.type) \
            if torch.is_autocast_enabled(x.device.type) else None
        ctx.states = []
        outs = []
        for tile in _tiles_of(x, tiles):
            ctx.states.append(_rng_state(x.device))
            outs.append(_rows(_checked(name, run(tile), tile)))
        ctx.save_for_backward(x)
        return torch.cat(outs).view(*x.shape[:-1], outs[0].shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[3]
        wanted = [i for i, n in enumerate(ctx.needs_input_grad[4:]) if n]
        params = [ctx.params[i] for i in wanted]
        grad_x = torch.zeros_like(x).view(-1, x.shape[-1]) if needs_x else None
        sums = [None] * len(params)
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        start = 0
        for tile, state in zip(_tiles_of(x.detach(), ctx.tiles), ctx.states):
            n = tile.numel() // tile.shape[-1]
            rows = slice(start, start + n)
            start += n
            t = tile.detach().requires_grad_(needs_x)
            with _replaying(x.device, state, ctx.autocast):
                out = ctx.run(t)
            inputs = ([t] if needs_x else []) + params
            if not out.requires_grad or not inputs:
                continue
            grads = torch.autograd.grad(out, inputs, grad_rows[rows].view_as(out),
                                        allow_unused=True)
            if needs_x and grads[0] is not None:
                grad_x[rows] = _rows(grads[0])
            for j, g in enumerate(grads[int(needs_x):]):
                if g is not None:
                    # Lower-precision weights' grads summed in fp32 and rounded once.
                    g = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                    sums[j] = g if sums[j] is None else sums[j].add_(g)
        param_grads = [None] * len(ctx.params)
        for i, p, s in zip(wanted, params, sums):
            param_grads[i] = None if s is None else s.to(p.dtype)
        ctx.run = ctx.params = ctx.states = None
        return (None, None, None, None if grad_x is None else grad_x.view_as(x),
                *param_grads)


def run_tiled(mlp, run, x, tiles, name="mlp"):
    """`run` (the MLP's forward) on `x` over `tiles` tiles: through TiledMLPFunction with grad,
    one tile after another without."""
    if torch.is_grad_enabled():
        params = [p for p in mlp.parameters()]
        return TiledMLPFunction.apply(run, tiles, name, x, *params)
    outs = [_rows(_checked(name, run(tile), tile)) for tile in _tiles_of(x, tiles)]
    return torch.cat(outs).view(*x.shape[:-1], outs[0].shape[-1])


def install(block, tiles_at, name, forced=lambda: False):
    """The block's MLP forward replaced by one that runs over `tiles_at()` tiles (an int, 1:
    the original forward); returns an undo, or None where the block has no MLP. An MLP that
    the running forward records from (records_now) runs whole; where `forced()` (the
    user's offload(mlp_tiles=)) it raises instead."""
    mlp = find_mlp(block)
    if mlp is None or _ORIGINAL in mlp.__dict__:
        return None
    had = "forward" in mlp.__dict__
    run = mlp.forward

    def forward(*args, **kwargs):
        tiles = tiles_at()
        if tiles <= 1 or kwargs or len(args) != 1 or not torch.is_tensor(args[0]) or \
                args[0].dim() < 2:
            return run(*args, **kwargs)
        if records_now(mlp):
            if forced():
                raise TypeError(
                    "strata.torch: offload(mlp_tiles=%d) cannot tile the MLP %s: Hugging Face "
                    "records from its inner modules in this forward (output_router_logits: the "
                    "routers' logits for the auxiliary loss), which run in tiles would be "
                    "recorded once per tile without their gradient; pass mlp_tiles=None (the "
                    "plan never tiles such an MLP)" % (tiles, name))
            return run(*args, **kwargs)
        return run_tiled(mlp, run, args[0], tiles, name)

    mlp.__dict__[_ORIGINAL] = run
    mlp.forward = forward

    def undo():
        del mlp.__dict__[_ORIGINAL]
        if had:
            mlp.forward = run
        else:
            del mlp.forward

    return undo


def planned(plan):
    """Per block position the tiles `plan` (a strata.step_plan.StepPlan, or None) gives."""
    if plan is None:
        return None
    return [b["mlp_tiles"] for b in plan.blocks]
