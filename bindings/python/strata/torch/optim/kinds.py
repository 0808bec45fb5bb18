"""strata.torch's optimizers: AdamW, Adam, SGD, Lion and Adagrad for an offloaded model, each a
real torch.optim.Optimizer (strata.torch.optim.base.StrataOptimizer holds what they share) and
a small subclass naming its Strata kind, its torch counterpart, its state and how its groups
reach Strata's. Lion's resident parameters use strata.torch.optim.resident.TorchLion, the same
formula in torch."""

import torch

from .. import _params
from .base import StrataOptimizer
from .checks import check_betas, check_options
from .resident import TorchLion, resident_torch


class AdamW(StrataOptimizer):
    """torch.optim.AdamW (decoupled weight decay)."""

    NAME, KIND = "AdamW", "adamw"
    HYPER = ("lr", "betas", "eps", "weight_decay")
    STATE = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    TORCH = torch.optim.AdamW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, max_grad_norm=0.0, threads=0,
                 accumulation_steps=None):
        check_options(self.NAME, amsgrad=amsgrad, maximize=maximize, capturable=capturable,
                       differentiable=differentiable)
        defaults = dict(lr=lr, betas=check_betas(self.NAME, betas), eps=eps,
                        weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=foreach, capturable=False, differentiable=False, fused=fused)
        self._start(params, defaults, max_grad_norm, threads, accumulation_steps)

    def _settings(self):
        d = self.defaults
        return dict(lr=d["lr"], beta1=d["betas"][0], beta2=d["betas"][1], eps=d["eps"],
                    weight_decay=d["weight_decay"])

    def _make_resident(self, groups):
        return resident_torch(self.TORCH, groups, self.defaults["foreach"],
                               self.defaults["fused"])

    def _set_groups(self, optimizer):
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            optimizer.set_group(gi, float(group["lr"]), float(group["weight_decay"]),
                                betas=(float(beta1), float(beta2)), eps=float(group["eps"]))


class Adam(AdamW):
    """torch.optim.Adam (L2 weight decay: added to the grad; bias corrections as torch's)."""

    NAME, KIND = "Adam", "adam"
    TORCH = torch.optim.Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, max_grad_norm=0.0, threads=0):
        AdamW.__init__(self, params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                       foreach=foreach, capturable=capturable, differentiable=differentiable,
                       fused=fused, max_grad_norm=max_grad_norm, threads=threads)


class SGD(StrataOptimizer):
    """torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay). The streamed blocks'
    momentum, dampening and nesterov are their optimizer's config: the same in every group,
    fixed at creation (a change is refused at the next step); lr and weight decay are read
    from the groups at every step."""

    NAME, KIND = "SGD", "sgd"
    HYPER = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    STEP_IN_STATE = False
    _FIXED = ("momentum", "dampening", "nesterov")

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, max_grad_norm=0.0, threads=0):
        check_options(self.NAME, maximize=maximize, differentiable=differentiable)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("strata.torch.SGD: Nesterov momentum requires a momentum and zero "
                             "dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=False,
                        foreach=foreach, differentiable=False, fused=fused)
        self._fixed = tuple(float(defaults[k]) for k in self._FIXED)
        self.STATE = {"momentum_buffer": "exp_avg"} if momentum > 0 else {}
        self._start(params, defaults, max_grad_norm, threads)

    def _check_groups(self, when=None):
        """The groups holding streamed parameters take the config's momentum, dampening and
        nesterov; `when`: the call that found a change (None: creation)."""
        for gi, group in enumerate(self.param_groups):
            now = tuple(float(group[k]) for k in self._FIXED)
            if now == self._fixed or all(_params.owner(p) is None for p in group["params"]):
                continue
            raise ValueError(
                "strata.torch.SGD: momentum, dampening and nesterov of the streamed blocks' "
                "groups are fixed when the optimizer is created (%s) and the same in every "
                "group, but %sgroup %d has %s; give every group the same, and change only lr "
                "and weight_decay while training (OneCycleLR: cycle_momentum=False)"
                % (dict(zip(self._FIXED, self._fixed)), "at %s " % when if when else "", gi,
                   dict(zip(self._FIXED, now))))

    def _settings(self):
        d = self.defaults
        return dict(lr=d["lr"], momentum=d["momentum"], dampening=d["dampening"],
                    nesterov=int(bool(d["nesterov"])), weight_decay=d["weight_decay"])

    def _make_resident(self, groups):
        extra = {} if self.defaults["fused"] is None else {"fused": self.defaults["fused"]}
        return torch.optim.SGD(groups, foreach=self.defaults["foreach"], **extra)

    def _set_groups(self, optimizer):
        self._check_groups("step()")
        for gi, group in enumerate(self.param_groups):
            optimizer.set_group(gi, float(group["lr"]), float(group["weight_decay"]))


class Lion(StrataOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as
    lion-pytorch: update = sign(beta1 m + (1 - beta1) g), p -= lr (update + weight_decay p)
    (decoupled), m = beta2 m + (1 - beta2) g. torch has no Lion: the resident parameters use
    TorchLion, the same formula. State: exp_avg."""

    NAME, KIND = "Lion", "lion"
    HYPER = ("lr", "betas", "weight_decay")
    STATE = {"exp_avg": "exp_avg"}
    STEP_IN_STATE = False

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 max_grad_norm=0.0, threads=0):
        betas = check_betas(self.NAME, betas)
        if not lr > 0 or not all(0 <= b <= 1 for b in betas):
            raise ValueError("strata.torch.Lion: lr must be > 0 and betas in [0, 1]")
        self._start(params, dict(lr=lr, betas=betas, weight_decay=weight_decay),
                    max_grad_norm, threads)

    def _settings(self):
        d = self.defaults
        return dict(lr=d["lr"], beta1=d["betas"][0], beta2=d["betas"][1],
                    weight_decay=d["weight_decay"])

    def _make_resident(self, groups):
        return TorchLion(groups)

    def _set_groups(self, optimizer):
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            optimizer.set_group(gi, float(group["lr"]), float(group["weight_decay"]),
                                betas=(float(beta1), float(beta2)))


class Adagrad(StrataOptimizer):
    """torch.optim.Adagrad (lr_decay, L2 weight decay, initial_accumulator_value, eps). State
    (from creation, as torch's): step and sum. lr_decay divides a group's lr by
    1 + (step - 1) lr_decay at each step; with lr_decay the streamed parameters of a group must
    have taken the same number of steps (they do unless some had no grad at some step)."""

    NAME, KIND = "Adagrad", "adagrad"
    HYPER = ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value")
    STATE = {"sum": "exp_avg_sq"}

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, fused=None, max_grad_norm=0.0, threads=0):
        check_options(self.NAME, maximize=maximize, differentiable=differentiable)
        for key, value in (("lr", lr), ("lr_decay", lr_decay), ("weight_decay", weight_decay),
                           ("initial_accumulator_value", initial_accumulator_value)):
            if not value >= 0:
                raise ValueError("strata.torch.Adagrad: %s must be >= 0, got %r" % (key, value))
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                        maximize=False, differentiable=False, fused=fused)
        self._start(params, defaults, max_grad_norm, threads)

    def _state_from_start(self):
        return True

    def _initial_value(self, key):
        return float(self.defaults["initial_accumulator_value"])

    def _fresh_resident_state(self, master):
        return {"step": torch.tensor(0.0),
                "sum": torch.full_like(master, self._initial_value("sum"),
                                       memory_format=torch.preserve_format)}

    def _settings(self):
        d = self.defaults
        return dict(lr=d["lr"], eps=d["eps"], weight_decay=d["weight_decay"])

    def _make_resident(self, groups):
        extra = {} if self.defaults["fused"] is None else {"fused": self.defaults["fused"]}
        # torch's Adagrad starts every sum from its constructor's initial_accumulator_value
        # (not the group's): passed, as the user passed it to this one.
        return torch.optim.Adagrad(
            groups, initial_accumulator_value=self.defaults["initial_accumulator_value"],
            foreach=self.defaults["foreach"], **extra)

    def _set_groups(self, optimizer):
        steps = {}  # group -> the update counts its streamed parameters holding a grad are at
        if any(g["lr_decay"] != 0 for g in self.param_groups):
            for sp in self._streamed():
                has_grad, _, t = optimizer.grad_info(sp.weight)
                if has_grad:
                    steps.setdefault(self._group_of[id(sp.param)], set()).add(t)
        for gi, group in enumerate(self.param_groups):
            lr = float(group["lr"])
            counts = steps.get(gi)
            if group["lr_decay"] != 0 and counts:
                if len(counts) > 1:
                    raise ValueError(
                        "strata.torch.Adagrad: lr_decay with the streamed parameters of group "
                        "%d at different step counts %s (some had no grad at some step): the "
                        "streamed blocks' update takes one learning rate per group; give "
                        "those parameters a group of their own" % (gi, sorted(counts)))
                lr = lr / (1 + next(iter(counts)) * float(group["lr_decay"]))
            optimizer.set_group(gi, lr, float(group["weight_decay"]), eps=float(group["eps"]))
