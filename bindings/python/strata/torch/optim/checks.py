"""What a strata.torch optimizer's creation refuses, before anything is laid out: torch options
it does not implement, malformed betas, the arguments of the shared constructor, the
parameters of several offloaded models, a bad PAGED_STATE, and a session that cannot take an
optimizer now (one made already, blocks laid out without it, trainable streamed parameters left
out)."""

from torch import nn

from .. import _params


def check_options(name, **flags):
    """torch options strata.torch does not implement, refused by name when set."""
    on = sorted(k for k, v in flags.items() if v)
    if on:
        raise ValueError("strata.torch.%s: %s not supported" % (name, ", ".join(on)))


def check_betas(name, betas):
    """`betas` as a tuple of two numbers (beta1, beta2), else refused."""
    if len(tuple(betas)) != 2:
        raise ValueError("strata.torch.%s: betas must be two numbers (beta1, beta2), got %r"
                         % (name, betas))
    return tuple(betas)


def check_arguments(params, max_grad_norm, accumulation_steps, who):
    """The shared constructor's own arguments; returns `params` (a module: its parameters that
    require grad)."""
    if isinstance(params, nn.Module):
        params = [p for p in params.parameters() if p.requires_grad]
    if accumulation_steps not in (None, 1):
        raise ValueError(
            "%s: accumulation_steps is gone: accumulate as in plain PyTorch ((loss / "
            "N).backward() per micro-batch, step() and zero_grad() every N), which Strata "
            "follows exactly" % who)
    if not 0.0 <= max_grad_norm:
        raise ValueError("%s: max_grad_norm must be >= 0" % who)
    return params


def session_of(param_groups, who):
    """The session the groups' streamed parameters belong to, or None (no streamed
    parameter); several are refused."""
    sessions = {}
    for group in param_groups:
        for p in group["params"]:
            s = _params.owner(p)
            if s is not None:
                sessions[id(s)] = s
    if len(sessions) > 1:
        raise ValueError("%s: the parameters belong to several offloaded models; use one "
                         "optimizer per model" % who)
    return next(iter(sessions.values()), None)


def check_paged_state(paged, who):
    """The optimizer's PAGED_STATE: 'auto', None or a count of resident blocks >= 0."""
    if not (paged in ("auto", None) or isinstance(paged, int) and
            not isinstance(paged, bool) and paged >= 0):
        # Before anything is built: the optimizer can be created again once it is set right.
        raise ValueError("%s.PAGED_STATE is %r, not 'auto', None (every resident "
                         "parameter's) or a count of resident blocks >= 0" % (who, paged))


def check_session(session, param_groups, who):
    """Whether `session` can take this optimizer now: open, no optimizer made for it yet, its
    blocks not laid out without one (unless they can be laid out again), and every streamed
    parameter that requires grad among `param_groups`."""
    mine = {id(p) for g in param_groups for p in g["params"]}
    session.check_open()
    if session.optimizer is None:
        # A forward pass whose backward never came (a loss computed for logging)
        # changes nothing, as in plain PyTorch.
        session.abort()
    trainable = session.blocks_train()
    # (abort above: no forward pass is waiting for its backward)
    if session.optimizer is not None or session.executor is not None and trainable \
            and not (session.relayable and session.layout.can_relay):
        raise RuntimeError(
            "%s: create the optimizer once, before the first forward pass with grad "
            "(the streamed blocks' optimizer state is laid out with them)%s" % (
                who, "" if session.optimizer is not None else
                         "; the blocks were laid out without it (a checkpoint "
                         "loaded, a forward pass of frozen blocks) and cannot be "
                         "laid out again under data parallelism"
                         if not session.layout.can_relay else
                         "; the blocks were laid out without it, with values wider "
                         "than the compute dtype rounded then or written since: "
                         "offload the model afresh and create the optimizer first"))
    for block in session.blocks:
        for name, p in block.named_parameters():
            if p.requires_grad and id(p) not in mine:
                raise ValueError(
                    "%s: the streamed parameter %r requires grad but is not among "
                    "the optimizer's parameters; pass all of them (or "
                    "requires_grad_(False) the ones to freeze)"
                    % (who, session.prefixes[session.blocks.index(block)] + name))
