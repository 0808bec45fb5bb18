"""The causal-LM loss over chunks of tokens as one function: linear_cross_entropy(hidden,
weight, bias, targets) gives the cross-entropy of hidden @ weight.T (+ bias) without the whole
logits ever existing, chunk_tokens rows at a time, each chunk's logits remade in its backward
(ChunkedLinearCrossEntropy), optionally through a per-token change of the logits the model
makes (strata.torch._logit_trace's). strata.torch._chunked_loss installs it into a model; the
chunk's default is the library's step plan's.

Imports torch only; the default chunk asks libstrata."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def default_chunk_tokens(vocab_size):
    """The library's loss chunk for a head of `vocab_size` (strata.step_plan: the most tokens
    whose fp32 logits fit in 1 GiB, a multiple of 8 when there are at least 8, at least 1;
    runtime/step/residency.cpp)."""
    from .. import step_plan  # (loads libstrata: not at import, the loss runs without it)
    return step_plan.plan_step([], vocab=int(vocab_size)).loss_chunk_tokens


def check_chunk_tokens(chunk_tokens):
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError("strata.torch: chunk_tokens is %r, not a positive number of tokens"
                         % (chunk_tokens,))
    return chunk_tokens


# ---------------------------------------------------------------------------------------------
# The function.

_FP32_ADDMM = {}  # device type -> whether addmm(out_dtype=float32) accumulates low-precision


def _fp32_addmm_works(device):
    """Whether torch.addmm(acc_fp32, a_bf16, b_bf16, out_dtype=float32, out=acc) runs here
    (CUDA builds of torch >= 2.8 have the overload): the chunk's product then lands in the
    fp32 sum without a rounding to bf16 and without an fp32 copy of its inputs. Probed once
    per device type on a tiny product, checked against the fp32 product."""
    known = _FP32_ADDMM.get(device.type)
    if known is None:
        known = False
        try:
            a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
            acc = torch.full((2, 2), 0.5, device=device)
            torch.addmm(acc, a.to(torch.bfloat16), a.to(torch.bfloat16),
                        out_dtype=torch.float32, out=acc)
            known = bool(torch.equal(acc.cpu(), (a @ a).cpu() + 0.5))
        except (RuntimeError, TypeError, NotImplementedError):
            known = False
        _FP32_ADDMM[device.type] = known
    return known


def _accumulate_product(acc, a, b):
    """acc (fp32) += a @ b, a and b in the compute dtype, the product summed in fp32."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _fp32_addmm_works(acc.device):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif acc.device.type == "cpu":  # the bf16/fp16 values exactly in fp32, multiplied there
        acc.addmm_(a.float(), b.float())
    else:  # an accelerator without the overload: the chunk's product rounded, then summed
        acc.add_(a @ b)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss = cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="sum") /
    denominator, a chunk of rows at a time; the grads computed in the forward pass (see the
    module's docstring). hidden: (N, H); targets: (N,) int64, ignore_index where ignored;
    denominator: a 0-d fp32 tensor; compute_dtype: the dtype of the logits (autocast's or
    the inputs'); needs: (hidden, weight, bias) grads wanted."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, denominator, chunk_tokens, ignore_index,
                compute_dtype, needs, transform=None, autocast=None):
        need_h, need_w, need_b = needs
        n = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            # What autocast would hand F.linear (the same casts, once for all chunks).
            w = weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            scale = 1.0 / denominator  # fp32, on the device: no synchronization
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
                if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
                if need_b else None
            for start in range(0, n, chunk_tokens):
                end = min(n, start + chunk_tokens)
                h = hidden[start:end].to(compute_dtype)
                y = targets[start:end]
                logits = F.linear(h, w, b)
                if transform is not None:
                    g = _transformed_chunk(logits, y, transform, autocast, ignore_index, scale,
                                           loss, need_h or need_w or need_b)
                    del logits
                    if g is None:
                        continue
                else:
                    x = logits.float()  # a copy unless the compute dtype is fp32
                    del logits
                    g = _chunk_grad(x, y, ignore_index, scale, loss, compute_dtype,
                                    need_h or need_w or need_b)
                    del x
                    if g is None:
                        continue
                if need_h and grad_h.dtype == compute_dtype:
                    torch.mm(g, w, out=grad_h[start:end])
                elif need_h:  # autocast's cast of the hidden states, backwards
                    grad_h[start:end] = g @ w
                if need_w:
                    _accumulate_product(grad_w, g.t(), h)
                if need_b:
                    grad_b += g.sum(0, dtype=torch.float32)
                del g
            ctx.grad_h = grad_h
            ctx.grad_w = None if grad_w is None else grad_w.to(weight.dtype)
            ctx.grad_b = None if grad_b is None else grad_b.to(bias.dtype)
            return loss / denominator  # the model's division (the grads use its inverse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        # Out of place: a retained graph's second backward scales the same kept grads.
        out = []
        for kept in (ctx.grad_h, ctx.grad_w, ctx.grad_b):
            out.append(None if kept is None else kept * grad.to(kept.device))
        return tuple(out) + (None,) * 8


def _chunk_grad(x, y, ignore_index, scale, loss, compute_dtype, need):
    """The cross-entropy of a chunk's fp32 logits x summed into loss; the grad of the chunk's
    logits in the compute dtype when `need` (None otherwise): (softmax - one-hot) * scale on
    the counted rows, 0 on the ignored ones, formed in place over x."""
    valid = y != ignore_index
    safe = torch.where(valid, y, 0)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, safe[:, None]).squeeze(1)
    loss += torch.where(valid, lse - picked, 0.0).sum()
    if not need:
        return None
    x.sub_(lse[:, None]).exp_()
    x.scatter_add_(1, safe[:, None], -valid.to(x.dtype)[:, None])
    g = torch.empty(x.shape, dtype=compute_dtype, device=x.device)
    torch.mul(x, (valid.to(x.dtype) * scale)[:, None], out=g)
    return g


def _transformed_chunk(logits, y, transform, autocast, ignore_index, scale, loss, need):
    """The same for logits the model changes before its loss (soft-capping, a scale; the
    recorded ops, strata.torch._logit_trace): transform and F.cross_entropy (reduction "sum")
    under the forward pass's autocast, and their grad by autograd, scaled as the model's
    "mean" scales it, in the logits' dtype."""
    leaf = logits.detach().requires_grad_(need)
    with torch.enable_grad(), torch.autocast(logits.device.type, dtype=autocast,
                                             enabled=autocast is not None):
        part = F.cross_entropy(transform(leaf), y, ignore_index=ignore_index, reduction="sum")
    loss += part.detach().float()
    if not need:
        return None
    return torch.autograd.grad(part, leaf, scale.to(part.dtype))[0]


def _check_integer(labels):
    if not torch.is_tensor(labels) or labels.dtype.is_floating_point or \
            labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError("strata.torch: labels are %s; a causal LM's loss takes integer token "
                        "ids (ignore_index where none)"
                        % (labels.dtype if torch.is_tensor(labels) else type(labels).__name__))


def _autocast_state(device_type):
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def linear_cross_entropy(hidden, weight, bias, targets, ignore_index=IGNORE_INDEX,
                         num_items_in_batch=None, chunk_tokens=None, transform=None):
    """cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index) over rows
    of hidden (..., H) and targets (the same rows, flattened), reduction "mean", or "sum"
    divided by num_items_in_batch when given (Hugging Face's fixed_cross_entropy), without
    the whole logits: chunk_tokens rows at a time (default: default_chunk_tokens). Grads flow
    to hidden, weight and bias where they require grad and grad mode is on. transform: a
    function of a chunk's logits (rows, V) whose result the cross-entropy takes instead of
    their fp32 upcast (row by row: soft-capping, a scale, then .float()), run under the
    current autocast state."""
    _check_integer(targets)
    targets = targets.reshape(-1).to(device=hidden.device, dtype=torch.long)
    size = hidden.shape[-1]
    flat = hidden.reshape(-1, size)
    if flat.shape[0] != targets.shape[0]:
        raise ValueError("strata.torch: %d hidden states for %d labels (after the shift): the "
                         "head's tokens and the labels must match (with logits_to_keep, pass "
                         "labels for the kept positions only)" % (flat.shape[0],
                                                                  targets.shape[0]))
    chunk_tokens = check_chunk_tokens(chunk_tokens if chunk_tokens is not None else
                                       default_chunk_tokens(weight.shape[0]))
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum().to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device)
        denominator = denominator.to(torch.float32)
    # The logits' dtype as F.linear gives it here (autocast's, or the inputs' where they
    # agree; its own error where they do not, as the model's path would raise it), asked of
    # empty slices so that no weight is cast for the question.
    dtype = F.linear(flat[:0], weight[:0], None if bias is None else bias[:0]).dtype
    grad = torch.is_grad_enabled()
    needs = (grad and flat.requires_grad, grad and weight.requires_grad,
             grad and bias is not None and bias.requires_grad)
    return ChunkedLinearCrossEntropy.apply(flat, weight, bias, targets, denominator,
                                           chunk_tokens, int(ignore_index), dtype, needs,
                                           transform, _autocast_state(hidden.device.type))
