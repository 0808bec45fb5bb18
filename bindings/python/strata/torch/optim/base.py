"""StrataOptimizer: what every strata.torch optimizer shares, a real torch.optim.Optimizer over
an offloaded model (strata.torch.optim.kinds names each one's Strata kind, torch counterpart,
state and groups).

The streamed parameters are updated by Strata's CPU optimizer of the same kind (fp32 masters in
DRAM; the update of each block is queued at step() and runs while the next forward pass streams
the blocks below it in); the resident ones (embedding, final norm, head) by torch's own
optimizer on the device (strata.torch.optim.resident), with fp32 masters where they are not
fp32. Semantics are the torch optimizer's: updates happen at step(), from the grads as they are
then (accumulated over any number of backward passes, clipped or scaled in between), for
parameters that have a grad; per-group hyperparameters read at every step; LR schedulers,
state_dict()/load_state_dict() (strata.torch.optim.state) and zero_grad(set_to_none=...) work
as usual."""

import time

import torch

from .. import _params
from .._agreement import EveryRank
from .checks import check_arguments, check_paged_state, check_session, session_of
from .resident import ResidentOptimizer, kept_fp32_values
from .state import StateIO


class StrataOptimizer(torch.optim.Optimizer):
    """What every strata.torch optimizer shares (see the module's docstring). A subclass sets
    NAME, KIND (core.OPTIMIZERS's key), HYPER (the group keys the resident optimizer copies at
    every step), STATE (torch's state key -> Strata's state tensor) and implements
    _settings, _make_resident and _set_groups. It owns two parts: the resident parameters'
    optimizer (strata.torch.optim.resident.ResidentOptimizer) and its state's reading and
    writing (strata.torch.optim.state.StateIO)."""

    NAME = KIND = None
    HYPER = ()
    STATE = {}
    STEP_IN_STATE = True  # torch keeps a "step" per parameter (SGD and Lion do not)

    def _settings(self):
        """core.Optimizer's settings for the streamed blocks (group 0's, from the defaults)."""
        raise NotImplementedError

    def _make_resident(self, groups):
        """The torch optimizer over the resident masters' param groups."""
        raise NotImplementedError

    def _set_groups(self, optimizer):
        """Every group's hyperparameters as they are now into Strata's optimizer."""
        raise NotImplementedError

    def _check_groups(self):
        """Refuse param groups Strata's optimizer cannot run, before anything is laid out."""

    def _state_kinds(self):
        return self.STATE

    def _initial_value(self, key):
        """The constant a state tensor holds before any update, as torch's optimizer starts it
        (zeros, Adagrad's initial_accumulator_value)."""
        return 0.0

    def _initial_state(self, key, shape, device):
        """A state tensor before any update (torch's initial value)."""
        return torch.full(shape, self._initial_value(key), device=device)

    def _fresh_resident_state(self, master):
        """A resident parameter's torch state when it has none (None: torch makes it)."""
        return None

    def _state_from_start(self):
        """Whether torch holds state for a parameter never updated (Adagrad: from creation)."""
        return False

    def _start(self, params, defaults, max_grad_norm, threads, accumulation_steps=None):
        who = "strata.torch." + self.NAME
        self._ready = False
        self._session = None
        self._state_io = StateIO(self)
        # The arguments' checks, then the build (collective under data parallelism): every
        # rank learns whether the checks passed on every rank before the build's first
        # collective (strata.torch._agreement), instead of the others waiting in it until
        # DataParallel's timeout. Those before the session is known (torch's own, of the
        # params and groups) raise where they fail: the same call fails alike on every rank.
        checking = EveryRank.deferred("checking %s's arguments" % who)
        with checking:
            group_of = self._check_start(params, defaults, max_grad_norm, accumulation_steps,
                                         who)
        session = self._session
        checking.agree(None if session is None else session.mesh)
        if session is not None and session.executor is not None and session.blocks_train():
            # Built without an optimizer by a checkpoint's load (st.load_checkpoint before
            # the optimizer): laid out again from the loaded weights, as the plain model
            # that loaded them and then made its optimizer.
            session.builder.unbuild()
        if session is not None and session.executor is None:
            # (frozen blocks built before: nothing to lay out)
            session.builder.build(dict(self._settings(), kind=self.KIND, threads=threads),
                                  group_of)
        started = time.perf_counter()  # the resident parameters' masters and torch optimizer
        kept = kept_fp32_values(  # (collective under data parallelism: the ranks agree)
            [p for g in self.param_groups for p in g["params"] if _params.owner(p) is None],
            None if session is None else session.layout)
        # The rest is this rank's own work until the first step's collectives.
        mesh = None if session is None else session.mesh
        try:
            with EveryRank(mesh, "creating %s's state" % who):
                if session is not None and session.optimizer is not None:
                    initial = time.perf_counter()
                    self._state_io.init_streamed()
                    started += session.timed("initial_state", initial) - initial
                self._make_masters(kept)
        except BaseException:
            if mesh is not None:  # as a failed build: half made on every rank, the job ends
                session.close()
            raise
        if session is not None:
            session.timed("resident_optimizer", started)

    def _check_start(self, params, defaults, max_grad_norm, accumulation_steps, who):
        """The optimizer's arguments checked against its session (self._session, found here),
        nothing built: returns id(param) -> group index."""
        params = check_arguments(params, max_grad_norm, accumulation_steps, who)
        torch.optim.Optimizer.__init__(self, params, defaults)
        self._check_groups()
        self.max_grad_norm = float(max_grad_norm)
        self._session = session_of(self.param_groups, who)
        check_paged_state(self.PAGED_STATE, who)
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self._group_of = group_of
        if self._session is not None:
            check_session(self._session, self.param_groups, who)
        return group_of

    def _make_masters(self, kept):
        """The resident parameters' fp32 masters and torch optimizer, and the pager of their
        state. kept: kept_fp32_values' (offload's fp32 copies still valid)."""
        residents = ResidentOptimizer(self.param_groups, self.HYPER, self._make_resident, kept)
        self._residents = residents
        if self._session is not None:  # its masters took offload's fp32 copies: they go
            self._session.optimizer_created()
        residents.pager = residents.make_pager(self._session, self.PAGED_STATE)
        residents.mark_all_synced()
        self._ready = True
        if residents.pager is not None:
            residents.pager.page_out(timed=False)  # the masters, from the first forward pass on

    # The resident parameters' optimizer state paged to host memory between a step and the
    # next backward pass (strata.torch.paging; docs/python-reference.md, Performance):
    # "auto" (on CUDA, as much of every resident parameter's as fits in half the host's
    # available memory at the first step's end), None every resident parameter's, an int the
    # first that many resident blocks', 0 none. Read when the optimizer is created.
    PAGED_STATE = "auto"

    def add_param_group(self, param_group):
        if self._ready:
            raise NotImplementedError(
                "strata.torch.%s: param groups are fixed at construction (the streamed blocks' "
                "optimizer state is laid out then); pass every group to the constructor"
                % self.NAME)
        super().add_param_group(param_group)

    def _streamed(self):
        s = self._session
        return [] if s is None or s.optimizer is None else \
            [sp for entries in s.layers for sp in entries if sp.trainable]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        session = self._session
        if session is not None:
            session.check_open()
            session.check_not_gathered("opt.step()")
            # A forward pass whose backward never came changes nothing, as in plain PyTorch.
            session.abort()
            if session.optimizer is not None:
                session.passes.sync_grads()
        if self.max_grad_norm > 0:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if session is not None and session.optimizer is not None:
            # Every group's hyperparameters as they are now: torch's optimizers read them from
            # their param groups at every step (OneCycleLR cycles AdamW's betas too), and so
            # does Strata's, bias corrections included.
            self._set_groups(session.optimizer)
            session.optimizer.step()
        residents = self._residents
        if residents.inner is not None:
            residents.step(self.param_groups, self.RESIDENT_CHUNK)
        keeper = None if session is None else session.activations
        if keeper is not None:
            # Which resident blocks may keep their activations from now on: decided once the
            # steps run as every later one will (the pager has sized what pages).
            # `paged`: the pager took tensors at some page-out, even if its sizing then
            # stopped it (the steps before used memory in another pattern).
            pager = residents.pager
            keeper.on_step(settled=pager is None or pager.settled,
                           paged=pager is not None and pager.has_paged)
        return loss

    # Elements per resident update: the fp32 grads and torch's foreach temporaries exist for
    # chunks of whole tensors up to this size (a larger tensor is a chunk of its own), not for
    # every resident parameter at once.
    RESIDENT_CHUNK = 1 << 26

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        if self._session is not None and self._session.optimizer is not None:
            self._session.passes.sync_grads()

    def synchronize(self):
        """Wait for the streamed blocks' queued updates (reading their weights does so itself)."""
        if self._session is not None:
            self._session.check_open()
            if self._session.optimizer is not None:
                self._session.optimizer.synchronize()

    # --- state ----------------------------------------------------------------------------------

    def state_dict(self):
        self.synchronize()
        saved = self.state
        try:
            self.state = self._state_io.filled()
            return super().state_dict()
        finally:
            self.state = saved

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        self.synchronize()
        self._state_io.load(state_dict)

    def resident_state(self):
        """What a whole-state checkpoint keeps besides Strata's files (StateIO.resident_state)."""
        return self._state_io.resident_state()

    def load_resident_state(self, saved):
        """A whole-state checkpoint's resident part (StateIO.load_resident_state)."""
        self._state_io.load_resident_state(saved)
