"""A streamed block's forward: with grad enabled, a checkpointed autograd function (the forward
pass saves only the block's inputs; the backward pass streams the block in again, recomputes its
forward with the RNG and autocast state of the first run, as torch.utils.checkpoint with
preserve_rng_state=True does, and backpropagates, sending the weight grads to Strata); without
grad (evaluation, generate()), the block runs on weights copied in from DRAM, with any KV cache
used as usual.

A streamed block that keeps selectively (strata.torch.activations: measured spare memory)
runs its forward with grad, as its recompute will, under selective checkpointing's forward
context, which caches its matrix products' and attention's outputs; what autograd saves there
is dropped as it is saved (only the cached outputs stay), the inputs detached as the recompute
detaches them. The recompute runs under the paired context, served those outputs instead of
computing them again, its RNG and autocast state the first run's as always (a random op is
never cached: it draws again what it drew). The weights are never kept: the recompute uses
the ones streamed in for the backward pass."""

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core import BACKWARD, FORWARD
from ._captured import Captures, is_recording_hook
from ._replay import ForwardState, without_caches
from ._regenerate import rerun_for
from ._spill import _inside_checkpoint, hidden_of


def note_memory(session, error):
    """An out-of-memory error on the device names what Strata kept there, and the knob."""
    notes = getattr(error, "__notes__", [])
    if isinstance(error, torch.OutOfMemoryError) and session.resident_blocks \
            and not any(n.startswith("strata.torch:") for n in notes):
        error.add_note(
            "strata.torch: %d block(s) are kept resident in device memory "
            "(st.offload(resident_blocks=...), by default what 40%% of the free memory held at "
            "offload); pass a smaller resident_blocks, or 0, to leave more to activations"
            % len(session.resident_blocks))
        keeper = session.activations
        if keeper.count + keeper.streamed > 0 and keeper.forced is None and \
                keeper.forced_streamed is None:
            # The measured plan was wrong for this step: recompute again from the next one.
            error.add_note(
                "strata.torch: %d resident and %d streamed block(s) were keeping their "
                "activations (measured spare memory); from the next step they are recomputed "
                "again" % (keeper.count, keeper.streamed))
            keeper.stop()


def note_spill(session, error):
    """An out-of-memory error on the device says when spilling checkpoints to host memory
    (strata.torch._spill) could not make the step fit: buffers refused, or short even so."""
    if isinstance(error, torch.OutOfMemoryError):
        said = session.spill.note()
        if said is not None and said not in getattr(error, "__notes__", []):
            error.add_note(said)


def _autocast_state(device_type):
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast(device_type, dtype):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


class StreamedBlockFunction(torch.autograd.Function):
    """Inputs: (session, index, run, leaves, spec, positions, box, anchor, *tensors), where
    tensors are the tensor leaves of the block's (args, kwargs) at `positions`; the anchor, a
    session-wide empty tensor requiring grad, keeps every block in the graph so the backward
    pass reaches each one in order even where no input or parameter needs a grad. Returns the
    tensor leaves of the block's output; `box` holds the caller's own (args, kwargs) where
    they can be used as they are (None where a KV cache was dropped from them) and the
    (forward, recompute) contexts of a block keeping selectively (None: it recomputes all),
    and receives the output's structure."""

    @staticmethod
    def forward(ctx, session, index, run, leaves, spec, positions, box, anchor, *tensors):
        device_type = session.device.type
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device_rng = torch.cuda.get_rng_state(session.device) if session.cuda else None
        ctx.autocast = _autocast_state(device_type)
        contexts = box.pop()
        call = box.pop()
        ctx.cached = None if contexts is None else contexts[1]
        session.begin(index, FORWARD)
        try:
            # The caller's own lists and dicts where nothing was dropped from them: what the
            # block writes into them (a statistic appended to a list) reaches the caller, as
            # in plain PyTorch. (What it puts there carries no grad: checked in the recompute.)
            if call is not None:
                args, kwargs = call
            else:
                args, kwargs = tree_unflatten(
                    leaves if contexts is None else [_detached(x) for x in leaves], spec)
            state = ForwardState(session.blocks[index])
            captures = Captures()  # what Hugging Face records inside the block (_captured)
            captures.begin()
            if contexts is None:
                out = run(*args, **kwargs)
            else:
                out = _kept_forward(run, args, kwargs, contexts[0])
            # Detached: a kept forward ran with grad, and its graph is not the one used.
            recorded = [t.detach() for t in captures.taken()]
        except BaseException as e:
            session.abort()
            note_memory(session, e)
            note_spill(session, e)
            raise
        session.end(index, FORWARD)
        out_leaves, out_spec = tree_flatten(out)
        out_positions = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        box.append((out_leaves, out_spec, out_positions, captures))
        ctx.session, ctx.index, ctx.run, ctx.state = session, index, run, state
        ctx.captures = captures
        ctx.mark_non_differentiable(*[t for t in recorded if not t.is_floating_point()])
        # The tensors are saved (or spilled, or regenerated) through save_for_backward alone:
        # the leaves kept for the recompute hold None in their place, or they would keep every
        # block's input on the device whatever the checkpoint plan sent elsewhere.
        taken = set(positions)
        ctx.leaves = [None if i in taken else x for i, x in enumerate(leaves)]
        ctx.spec, ctx.positions = spec, positions
        ctx.step_id = session.step_id
        ctx.save_for_backward(*tensors)
        at = len(session.resident_blocks) + index
        if session.spill.regen.feeds_group(at):  # the next block's input may be dropped
            rerun = rerun_for(session, index, ctx, leaves, spec, positions,
                              hidden_of(*tree_unflatten(leaves, spec)), out_leaves, state)
            session.spill.forward_done(at, rerun, None if rerun is None else
                                       out_leaves[rerun.out_at])
        return tuple(out_leaves[i] for i in out_positions) + tuple(recorded)

    @staticmethod
    def backward(ctx, *grad_outs):
        session, index = ctx.session, ctx.index
        if torch.is_grad_enabled():  # autograd runs backward with grad only for create_graph
            session.abort()
            raise NotImplementedError(
                "strata.torch: create_graph=True (a double backward: a gradient penalty, "
                "higher-order grads) through streamed block %d is not supported: a streamed "
                "block's backward recomputes it on weights streamed for that pass, and its "
                "grads carry no graph of their own" % index)
        if not torch._C._will_engine_execute_node(session.anchor_node):
            return StreamedBlockFunction._input_grads_only(ctx, grad_outs)
        if ctx.step_id == session.step_id and session.in_step and \
                session.backward_next != index and \
                session.forward_next < len(session.layers):
            raise RuntimeError(
                "strata.torch: the forward pass ran streamed blocks 0..%d of %d: with grad, "
                "every streamed block runs once per forward pass (skipping the last ones, as "
                "LayerDrop or an early exit does, is not supported)"
                % (session.forward_next - 1, len(session.layers)))
        if ctx.step_id != session.step_id or not session.in_step or \
                session.backward_next != index:
            raise RuntimeError(
                "strata.torch: backward through block %d of a forward pass that is no longer "
                "the current one. Each forward pass with grad needs its backward before the next "
                "forward pass (several forwards into one loss, and backward twice through one "
                "graph with retain_graph=True, are not supported: call backward per forward "
                "pass, which accumulates the same grads)" % index)
        session.begin(index, BACKWARD)
        try:
            trainable = [sp for sp in session.layers[index] if sp.trainable]
            result, param_grads = _recompute_grads(ctx, grad_outs, [sp.param for sp in trainable],
                                                   accumulate=True)
            session.store_grads(index, trainable, param_grads)
            del param_grads
        except BaseException as e:
            session.abort()
            note_memory(session, e)
            note_spill(session, e)
            raise
        session.end(index, BACKWARD)
        return (None,) * 8 + tuple(result)

    @staticmethod
    def _input_grads_only(ctx, grad_outs):
        """A backward pass that accumulates into no parameter (torch.autograd.grad(loss,
        inputs), loss.backward(inputs=...)): as in plain PyTorch, no .grad changes. The
        executor's step, whose backward would deliver parameter grads, is abandoned; each block
        is recomputed on weights copied from DRAM, and only the grads asked for flow back."""
        session, index = ctx.session, ctx.index
        if ctx.step_id != session.step_id:
            raise RuntimeError(
                "strata.torch: backward through block %d of a forward pass that is no longer "
                "the current one" % index)
        session.abort()
        session.load_block(index)
        try:
            result, _ = _recompute_grads(ctx, grad_outs, [], accumulate=False)
        finally:
            session.unbind(index)
        return (None,) * 8 + tuple(result)


def _recompute_grads(ctx, grad_outs, params, accumulate):
    """The block's forward again, with grad, under the first run's RNG and autocast state, and
    its backward: (grads of the function's tensor inputs, None where not needed; grads of
    `params`). `accumulate`: a backward pass that accumulates into .grad (not
    autograd.grad(loss, inputs)), where a tensor that requires grad and that the block uses
    without owning it (a LoRA factor held by the model, a gate reached through a closure) gets
    its grad added to its .grad here, as torch's backward would."""
    session = ctx.session
    block = session.blocks[ctx.index]
    needs = ctx.needs_input_grad[8:]
    inputs = [t.detach().requires_grad_(bool(n) and t.is_floating_point())
              for t, n in zip(ctx.saved_tensors, needs)]
    leaves = list(ctx.leaves)
    for pos, t in zip(ctx.positions, inputs):
        leaves[pos] = t
    args, kwargs = tree_unflatten(leaves, ctx.spec)
    attributes = _tensor_attributes(block)
    devices = [session.device] if session.cuda else []
    # A block that kept selectively: its cached outputs served (once: a second recompute, as
    # _input_grads_only's after an abandoned step could need, recomputes them).
    cached, ctx.cached = ctx.cached, None
    with torch.random.fork_rng(devices=devices, device_type=session.device.type), \
            ctx.state.replay():
        torch.set_rng_state(ctx.cpu_rng)
        if session.cuda:
            torch.cuda.set_rng_state(ctx.device_rng, session.device)
        recorded = []  # what Hugging Face records inside the block, again (_captured)
        with torch.enable_grad(), _autocast(session.device.type, ctx.autocast), \
                cached if cached is not None else contextlib.nullcontext(), \
                ctx.captures.again(recorded):
            out = ctx.run(*args, **kwargs)
    out_tensors = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    _refuse_grads_left_behind(session, ctx.index, attributes, (args, kwargs),
                              inputs + out_tensors + recorded)
    out_tensors += recorded  # the function's outputs after the block's own
    pairs = [(o, g) for o, g in zip(out_tensors, grad_outs) if g is not None and o.requires_grad]
    foreign = _foreign_leaves(session, ctx.index, [o for o, _ in pairs], inputs, params) \
        if accumulate else []
    wanted = [t for t in inputs if t.requires_grad] + list(params) + foreign
    grads = [None] * len(wanted)
    if pairs and wanted:
        # A foreign tensor may be reached through a graph outside the block (a scale computed
        # from a parameter in the model's forward, before the blocks): kept for the backward
        # pass, which runs that part of the graph after this block's.
        grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                    allow_unused=True, retain_graph=bool(foreign))
    n_inputs = len(wanted) - len(params) - len(foreign)
    for t, g in zip(foreign, grads[len(wanted) - len(foreign):]):
        if g is not None:  # a grad of its own, as torch's AccumulateGrad makes it
            t.grad = g.clone() if t.grad is None else t.grad + g
    input_grads = iter(grads[:n_inputs])
    return ([next(input_grads) if t.requires_grad else None for t in inputs],
            grads[n_inputs:n_inputs + len(params)])


def _detached(x):
    """A block input as its recompute gets it: detached, requiring grad where it did (the
    function's needs_input_grad is the input's requires_grad; a float only)."""
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().requires_grad_(x.requires_grad and x.is_floating_point())


def _drop(_):
    return None


def _never(_):
    raise RuntimeError("strata.torch: a streamed block's kept forward pass is not "
                       "differentiated (its recompute is)")


def _kept_forward(run, args, kwargs, caching):
    """The forward of a streamed block keeping selectively: with grad, on its inputs detached
    as the recompute detaches them (the caller's graph untouched, an in-place write into an
    input included), so that it runs the ops, with the arguments, that the recompute will and
    the caching context's outputs are the recompute's (under no_grad an attention may skip its
    logsumexp, a matmul fold its input otherwise); what autograd saves is dropped as it is
    saved (no memory beyond a forward under no_grad, the cached outputs apart). The caller's
    own lists and dicts (StreamedBlockFunction.forward) are passed as they are, the tensors
    inside them too (not replaced there: they are the caller's); a block writing in place into
    one of those would write into the caller's graph. Returns the output, detached."""
    args = tuple(_detached(a) for a in args)
    kwargs = {k: _detached(v) for k, v in kwargs.items()}
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _never), \
            caching:
        out = run(*args, **kwargs)
    leaves, spec = tree_flatten(out)
    return tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in leaves],
                          spec)


def _tensor_attributes(block):
    """{(module name, attribute): its tensor} for the plain tensor attributes of `block` and
    its submodules (not parameters or buffers, which torch keeps apart). The tensors, not
    their ids: a tensor freed during the recompute can leave its id to a new one."""
    return {(name, key): value for name, m in block.named_modules()
            for key, value in vars(m).items() if isinstance(value, torch.Tensor)}


def _refuse_grads_left_behind(session, index, before, call, known):
    """A streamed block's forward pass runs without grad (and again, with grad, in the
    backward pass): a tensor it leaves behind instead of returning (stored on a module,
    `self.aux = ...`, or put into a list or dict it was given) carried no grad when the
    caller read it, so a loss built from it (a router's auxiliary loss) silently did not
    train. Seen here, where the recompute leaves one that requires grad."""
    if session.allow_inner_hooks:
        return
    block, prefix = session.blocks[index], session.prefixes[index]
    # The block's inputs and outputs are exempt: kept by the caller too, they carry grad in
    # the forward pass (the function's outputs; the caller's own inputs).
    known = {id(t) for t in known}
    stored = ["%s%s%s" % (prefix, name + "." if name else "", key)
              for name, m in block.named_modules() for key, value in vars(m).items()
              if isinstance(value, torch.Tensor) and value.requires_grad
              and before.get((name, key)) is not value and id(value) not in known]
    put = [x for x in tree_flatten(call)[0]
           if isinstance(x, torch.Tensor) and x.requires_grad and id(x) not in known]
    if stored or put:
        where = "stored it in %s" % ", ".join(stored) if stored else \
            "put it into a list or dict it was given"
        raise NotImplementedError(
            "strata.torch: streamed block %s's forward computed a tensor that needs grad and "
            "%s instead of returning it: a streamed block's forward runs without grad (it is "
            "recomputed with grad in the backward pass), so what the caller read there carried "
            "no gradient and a loss built from it (an auxiliary loss) did not train. Return it "
            "from the block's forward, or set model.strata.allow_inner_hooks = True if it is "
            "only observed" % (prefix.rstrip("."), where))


def _foreign_leaves(session, index, outputs, inputs, params):
    """The tensors requiring grad that the recomputed graph of block `index` accumulates into
    besides its inputs and its own parameters: a tensor the block uses without owning it. A
    streamed parameter of another block among them is refused (its grad lives in Strata)."""
    own = {id(t) for t in inputs} | {id(p) for p in params}
    found, seen = {}, set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            if variable is session.anchor:
                node = None  # reached the rest of the model's streamed graph: refused below
            elif id(variable) not in own:
                found[id(variable)] = variable
                continue
            else:
                continue
        if node is None or type(node).__name__ == "StreamedBlockFunctionBackward":
            raise NotImplementedError(
                "strata.torch: streamed block %s computes with a tensor that an earlier "
                "streamed block made, reached other than through its inputs (a closure, an "
                "attribute): its grad cannot flow back through the earlier block. Pass it to "
                "the block as an argument" % session.prefixes[index].rstrip("."))
        stack.extend(n for n, _ in node.next_functions)
    for t in found.values():
        sp = session.by_id.get(id(t))
        if sp is not None:
            raise NotImplementedError(
                "strata.torch: streamed block %s uses parameter %r of another streamed block: "
                "a streamed parameter belongs to one block (its weights stream with it); share "
                "it through a resident module, or keep both blocks resident"
                % (session.prefixes[index].rstrip("."), sp.name))
    return list(found.values())

def _captures(hook):
    """Whether a forward hook may capture something that needs the block's gradient: any but
    Hugging Face's output-capturing hook, whose records carry it (strata.torch._captured)."""
    return not is_recording_hook(hook)


def inner_forward_hooks(block, prefix):
    """The modules inside `block` (not the block itself) with forward-pre hooks or forward
    hooks that may capture in this forward pass, by name, and torch's global forward hooks,
    which run on every module."""
    from torch.nn.modules import module as module_globals
    found = ["%s%s" % (prefix, name) for name, m in block.named_modules()
             if m is not block and (m._forward_pre_hooks or
                                    any(_captures(h) for h in m._forward_hooks.values()))]
    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        found.append("every module (torch.nn.modules.module.register_module_forward_hook)")
    return found


def refuse_inner_hooks(session, index):
    """A streamed block's forward runs without grad and again in the backward pass: a hook
    inside it fires twice a step and captures tensors with no gradient, so a loss built from
    them (a mixture-of-experts router's auxiliary loss, collected through hooks) would silently
    not train. Refused, unless the session allows hooks that only observe."""
    if session.allow_inner_hooks:
        return
    found = inner_forward_hooks(session.blocks[index], session.prefixes[index])
    if found:
        raise NotImplementedError(
            "strata.torch: a forward hook is registered on %s, inside streamed block %s: a "
            "streamed block's forward runs without grad and is recomputed in the backward "
            "pass, so the hook would run twice a step and what it captures carries no "
            "gradient (a loss built from it, such as a router's auxiliary loss collected "
            "through hooks, would silently not train). Register the hook on the block itself "
            "(its outputs carry gradients), or set model.strata.allow_inner_hooks = True for "
            "hooks that only observe" % (", ".join(found), session.prefixes[index].rstrip(".")))


def refuse_swapped_parameters(session, index):
    """With grad, a streamed block computes with and delivers grads for its own parameters (the
    ones bound to Strata's weights): a parameter swapped for another tensor for this call
    (torch.func.functional_call, stateless reparametrization) would get no grad and the model's
    own would get its grad. Refused; under no_grad the swapped tensors compute as in torch."""
    if index >= len(session.layers):  # not moved into Strata yet (its first step does that)
        return
    block = session.blocks[index]
    for sp in session.layers[index]:
        owner, _, leaf = sp.local.rpartition(".")
        try:
            current = getattr(block.get_submodule(owner) if owner else block, leaf)
        except AttributeError:
            current = None
        if current is None:
            raise NotImplementedError(
                "strata.torch: parameter %r of streamed block %s is gone from where offload "
                "found it: the block's modules changed after strata.torch.offload (an adapter "
                "such as PEFT's get_peft_model wraps its layers): apply adapters before "
                "offload" % (sp.name, session.prefixes[index].rstrip(".")))
        if current is not sp.param:
            raise NotImplementedError(
                "strata.torch: parameter %r of streamed block %s is not the model's own in "
                "this forward pass (torch.func.functional_call, or another swap of a block's "
                "parameters): with grad, a streamed block computes and delivers the grads of "
                "its own parameters, so the swapped-in tensors would get none; under "
                "torch.no_grad() it works" % (sp.name, session.prefixes[index].rstrip(".")))


def _caller_arguments(args, kwargs, leaves, kept):
    """The caller's own (args, kwargs) for the block's first forward, with the KV caches that
    without_caches dropped (`kept` against `leaves`) set to None where they are arguments
    themselves (transformers passes an empty cache as past_key_values in training), the lists
    and dicts among them the caller's own; None where a dropped cache sits deeper."""
    dropped = [a for a, b in zip(leaves, kept) if a is not b]
    if not dropped:
        return args, kwargs
    ids = {id(a) for a in dropped}
    top = [a for a in list(args) + list(kwargs.values()) if id(a) in ids]
    if len(top) != len(dropped):
        return None
    return (tuple(None if id(a) in ids else a for a in args),
            {k: None if id(v) in ids else v for k, v in kwargs.items()})


def _keep(t):
    return t


def _beside_checkpoint():
    """Inside torch.utils.checkpoint's non-reentrant region (Hugging Face
    gradient_checkpointing_enable with use_reentrant=False, where it wraps the block's
    __call__, as transformers up to 5.17 does), the block's inputs are saved for its backward
    as they are, not through the checkpoint's hooks: unpacked through them, they would make
    torch recompute the whole checkpointed call, and so run this block's forward again, in the
    middle of the backward pass (the block order error). Nothing is lost: the block recomputes
    itself in its backward pass, and the checkpoint keeps the same inputs for its own
    recompute anyway."""
    if not _inside_checkpoint():
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_keep, _keep)


def streamed_forward(session, index, run):
    """The forward installed on block `index`: `run` is its original forward."""

    def forward(*args, **kwargs):
        session.check_open()
        if not torch.is_grad_enabled():
            session.load_block(index)
            try:
                return run(*args, **kwargs)
            finally:
                session.unbind(index)
        refuse_inner_hooks(session, index)
        refuse_swapped_parameters(session, index)
        leaves, spec = tree_flatten((args, kwargs))
        kept = without_caches(leaves)
        call = _caller_arguments(args, kwargs, leaves, kept)
        leaves = kept
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        at = len(session.resident_blocks) + index  # the block's place in the model's order
        inputs = tree_unflatten(leaves, spec)
        keeper = session.activations
        if at == 0 and keeper.enabled:
            keeper.forward_begins()
        keeper.observe_streamed(index, run, *inputs)
        keep = keeper.streamed_mode(index, inputs[0]) == "selective"
        box = [call, keeper.streamed_contexts() if keep else None]
        if at == 0:
            session.spill.forward_begins(run, session.blocks[index], *inputs)
        with session.spill.saving(at, *inputs), _beside_checkpoint():
            outs = StreamedBlockFunction.apply(session, index, run, leaves, spec, positions,
                                               box, session.anchor,
                                               *[leaves[i] for i in positions])
        out_leaves, out_spec, out_positions, captures = box[0]
        captures.put_back(outs[len(out_positions):])
        out_leaves = list(out_leaves)
        for pos, t in zip(out_positions, outs):
            out_leaves[pos] = t
        return tree_unflatten(out_leaves, out_spec)

    # torch.compile: the block runs as it is, a graph break around it (traced, its parameters'
    # zero-stride placeholders became graph inputs that the slot's memory then did not match,
    # and the streaming calls into Strata would have run at trace time only).
    return torch.compiler.disable(forward)
