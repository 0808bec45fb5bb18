"""strata.torch.gathered: the streamed parameters' real values in a with-block (an EMA of the
weights, weight-norm logs, parameters_to_vector, writes with writable=True), what DeepSpeed's
GatheredParameters and FSDP's summon_full_params give their sharded parameters."""

import torch

from . import _params


class gathered:  # noqa: N801 (used as a function: `with st.gathered(model): ...`)
    """Inside `with strata.torch.gathered(model_or_params, writable=False):` every streamed
    parameter among the targets holds its current value: its .data is what model.state_dict()
    returns for it (the weight in the compute dtype offload chose; in fp32 that is the master),
    on the parameter's device, updates in flight waited for. On exit the parameters point at
    their placeholders again (they read NaN outside their block's forward pass).

    targets: an offloaded model, any module or parameter, or an iterable of them; only the
    streamed parameters among them are gathered (the others, resident ones included, hold
    their values already and are left as they are).

    writable=False: the values are for reading. A write into one of them (in place through the
    parameter or its .data, or another tensor assigned to .data) is found on exit by comparing
    with Strata's values, nothing is stored, and RuntimeError names the parameters and
    writable=True. writable=True: on exit the parameters whose values changed are stored into
    Strata as model.load_state_dict of that tensor would store them (the weight, and the fp32
    master of a trained parameter: in bf16 a written parameter's master becomes its written
    bf16 value widened, as after load_state_dict; unwritten parameters keep their masters).
    An exception inside the block stores nothing and still restores the placeholders.

    Refused, with the reason: inside a training step (between a forward pass with grad and its
    backward: the step's weights are in flight), nested use, and a target of a model built on
    the meta device before the optimizer gave it values (create strata.torch.AdamW, or load
    its weights, first). Inside the block a forward pass of a streamed block, opt.step() and
    model.load_state_dict() are refused (they read or write Strata behind the gathered copies);
    model.state_dict() returns Strata's values, without the block's unstored writes. Before the
    blocks move into Strata (no optimizer yet) their parameters hold their own values and the
    context changes nothing. Values gathered carry no grad into Strata: compute with them under
    torch.no_grad() (a backward through them reaches the parameter's .grad as a tensor assigned
    to it, refused at the next step, or as an add into its held StreamedGrad, refused at once;
    streamed grads come from the blocks' backward passes only).

    Memory: the gathered parameters' bytes on their device (the compute dtype: 2 bytes a
    parameter in bf16, 4 in fp32), for the whole block: gather a subset (a block, a list of
    parameters) to bound it, e.g. `for block in blocks: with st.gathered(block): ...`. The
    reads and the exit's comparison move one parameter at a time through host memory (one
    parameter's bytes there at a time). Reading costs a copy of the gathered weights from DRAM
    (or NVMe) to the device on entry and one more read of them on exit.

    Data parallelism (offload(data_parallel=...), or under torchrun): collective. Every rank must
    enter and leave it together with the same targets, as with GatheredParameters and
    summon_full_params: each parameter is gathered from its shards on entry and compared on
    exit over the shard group, in the same order on every rank. A write found on any rank
    counts on all; each rank then stores its own shard of the parameter from its own copy
    (FSDP's writeback): write the same values on every rank."""

    def __init__(self, targets, writable=False):
        self.writable = bool(writable)
        self.params = _collect(targets)
        self.sessions = []  # [(session, [StreamedParam])], the sessions the params stream in
        self.entered = False

    def __enter__(self):
        if self.entered:
            raise RuntimeError("strata.torch.gathered: this context is entered already (nested "
                               "use is not supported); gather every parameter needed in one "
                               "context")
        groups = {}
        for p in self.params:
            session = _params.owner(p)
            if session is not None:
                groups.setdefault(id(session), (session, []))[1].append(p)
        for session, params in groups.values():
            _check_enter(session, params)
        self.entered = True
        done = []
        try:
            for session, params in groups.values():
                session.gathered = self
                done.append((session, []))
                if session.executor is None:
                    continue  # the parameters hold their own values until the build
                # In the order of the blocks (the same on every rank: reads are collective).
                for sp in sorted((session.by_id[id(p)] for p in params),
                                 key=lambda sp: (sp.layer, sp.index)):
                    value = session.read_weight(sp).to(sp.param.device)
                    sp.mark = None  # not a placeholder now: check_untouched looks away
                    sp.param.data = value
                    done[-1][1].append((sp, value))
        except BaseException:
            self.sessions = done
            self._restore()
            self.entered = False
            raise
        self.sessions = done
        return self

    def __exit__(self, exc_type, exc, tb):
        written = []
        try:
            if exc_type is None:
                for session, entries in self.sessions:
                    written += self._store(session, entries)
        finally:
            self._restore()
            self.entered = False
        if written:
            raise RuntimeError(
                "strata.torch.gathered: streamed parameter%s %s %s written inside "
                "gathered(..., writable=False); nothing was stored (their values live in "
                "Strata): use gathered(..., writable=True) to store writes"
                % ("s" if len(written) > 1 else "",
                   ", ".join(repr(n) for n in written[:3]) + (", ..." if len(written) > 3 else ""),
                   "were" if len(written) > 1 else "was"))
        return False

    def _store(self, session, entries):
        """The parameters of `entries` whose values changed (in place, or other data assigned):
        stored with writable=True; their names otherwise. Compared with Strata's values, one
        parameter at a time (a collective under data parallelism, as are the flags)."""
        changed = []
        for sp, value in entries:
            now = sp.param.data
            same = now.data_ptr() == value.data_ptr() and now.shape == value.shape and \
                now.dtype == value.dtype and now.device == value.device
            changed.append(not (same and _bits_equal(now, session.read_weight(sp))))
        changed = [not kept for kept in session.layout.agree([not c for c in changed])]
        if not self.writable:
            return [sp.name for (sp, _), c in zip(entries, changed) if c]
        session.gathered = None  # the stores are this context's own writes
        for (sp, _), c in zip(entries, changed):
            if c:
                session.write_weight(sp, sp.param.data)
        return []

    def _restore(self):
        for session, entries in self.sessions:
            for sp, _ in entries:
                sp.park(session.dtype, session.device)
            session.gathered = None
        self.sessions = []


def _collect(targets):
    """The distinct parameters of `targets` (a module, a tensor, or an iterable of them), in
    order."""
    if isinstance(targets, (torch.nn.Module, torch.Tensor)):
        targets = [targets]
    params, seen = [], set()
    for t in targets:
        for p in t.parameters() if isinstance(t, torch.nn.Module) else [t]:
            if not isinstance(p, torch.Tensor):
                raise TypeError("strata.torch.gathered: expected modules or parameters, got %s"
                                % type(p).__name__)
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _check_enter(session, params):
    session.check_open()
    if session.gathered is not None:
        raise RuntimeError("strata.torch.gathered: nested use (this model's streamed parameters "
                           "are gathered already by an enclosing gathered(...)); gather every "
                           "parameter needed in one context")
    if session.in_step:
        raise RuntimeError("strata.torch.gathered: inside a training step (a forward pass with "
                           "grad waits for its backward; the step's weights are in flight): "
                           "enter it between steps, after loss.backward() (or opt.step())")
    if session.executor is not None:
        for p in params:  # a write into a placeholder since is refused, not overwritten
            session.by_id[id(p)].check_untouched()
        return
    if any(p.is_meta for p in params):
        raise RuntimeError("strata.torch.gathered: streamed parameters of a model built on the "
                           "meta device have no values yet (they get them when the optimizer "
                           "is created, from its init or offload(weights=)): create "
                           "strata.torch.AdamW first, or load the weights with "
                           "model.load_state_dict")


def _bits_equal(a, b):
    """Same dtype, shape and bits (NaNs included, which torch.equal calls unequal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a = a.detach().to(b.device).contiguous().view(-1).view(torch.uint8)
    return torch.equal(a, b.detach().contiguous().view(-1).view(torch.uint8))
