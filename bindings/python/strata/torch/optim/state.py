"""A strata.torch optimizer's state as torch's optimizers hold it (StateIO): read for
state_dict() (the streamed parameters' from Strata, the resident ones' from the inner torch
optimizer), written by load_state_dict(), the whole-state checkpoint's resident part, and the
streamed state's initial values where torch's do not start at zero."""

import torch


class StateIO:
    """The state in and out of one strata.torch optimizer, which owns it; what differs per
    optimizer (its state keys, their initial values, whether torch keeps a step) it asks of
    the optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def init_streamed(self):
        """The streamed parameters' state where torch's does not start at zero (Adagrad's
        initial_accumulator_value): Strata's starts zeroed. Decided from the constant, not by
        building each parameter's initial tensor to test it: that was a tensor per parameter
        and state, about 210 GB written and read for a 30B's AdamW (its 47 streamed blocks'
        moments; 49 s of its setup)."""
        o = self.optimizer
        for key, kind in o._state_kinds().items():
            if o._initial_value(key) == 0.0:
                continue
            for sp in o._streamed():
                o._session.write_state(sp, kind, o._initial_state(key, sp.shape, "cpu"))

    def streamed_entry(self, sp):
        """A streamed parameter's state as torch's optimizer holds it, or None (no state)."""
        o = self.optimizer
        _, _, t = o._session.optimizer.grad_info(sp.weight)
        if t == 0 and not o._state_from_start():
            return None
        entry = {"step": torch.tensor(float(t))} if o.STEP_IN_STATE else {}
        for key, kind in o._state_kinds().items():
            entry[key] = o._session.read_state(sp, kind)
        if not entry:
            return None  # SGD without momentum keeps none (torch neither)
        if o._session.dtype != torch.float32:
            entry["master"] = o._session.read_state(sp, "master")
        return entry

    def filled(self):
        """optimizer.state as the torch optimizer would hold it (streamed state read from
        Strata)."""
        o, residents = self.optimizer, self.optimizer._residents
        state = {}
        for sp in o._streamed():
            entry = self.streamed_entry(sp)
            if entry is not None:
                state[sp.param] = entry
        if residents.inner is not None:
            residents.bring_in(writes=False)
            residents.sync_masters()
            # Paged state leaves the device at the next forward pass, its tensors' storage
            # freed: what is returned must outlive that (a state dict held while training
            # goes on, saved from a thread), so it is copied to host memory; unpaged, the
            # tensors themselves, as torch's optimizers return them.
            paged = residents.pager is not None and residents.pager.has_paged

            def kept(v):
                if not torch.is_tensor(v) or not paged:
                    return v
                return v.detach().to("cpu", copy=True)
            for p, master, _ in residents.entries:
                if master in residents.inner.state and residents.inner.state[master]:
                    entry = {key: kept(v) for key, v in residents.inner.state[master].items()}
                    if master is not p:
                        entry["master"] = kept(master) if paged else master.detach().clone()
                    state[p] = entry
        return state

    @torch.no_grad()
    def load(self, state_dict):
        """load_state_dict's work, the updates synchronized: the groups' hyperparameters, the
        streamed parameters' state written to Strata (torch's initial values where the dict
        has none), the resident ones' restored."""
        o, residents = self.optimizer, self.optimizer._residents
        groups = state_dict["param_groups"]
        if len(groups) != len(o.param_groups) or any(
                len(g["params"]) != len(mine["params"])
                for g, mine in zip(groups, o.param_groups)):
            raise ValueError("strata.torch.%s.load_state_dict: the state dict's param groups "
                             "do not match this optimizer's (counts of groups or parameters "
                             "differ)" % o.NAME)
        by_index = {}
        for g, mine in zip(groups, o.param_groups):
            by_index.update(zip(g["params"], mine["params"]))
            for key, value in g.items():
                if key != "params":
                    mine[key] = value
        saved = {by_index[k]: v for k, v in state_dict["state"].items()}
        session = o._session
        if session is not None and session.optimizer is not None:
            for sp in o._streamed():
                entry = saved.get(sp.param) or {}
                for key, kind in o._state_kinds().items():
                    value = entry.get(key)
                    session.write_state(sp, kind, o._initial_state(key, sp.shape, "cpu")
                                        if value is None else value)
                if "master" in entry and session.dtype != torch.float32:
                    session.write_state(sp, "master", entry["master"])
                if o.STEP_IN_STATE:
                    step = int(entry["step"]) if "step" in entry else 0
                else:  # any count above 0 is "updated before" (SGD's buffer then exists)
                    step = 1 if any(k in entry for k in o._state_kinds()) else 0
                session.optimizer.set_param_step(sp.weight, step)
        if residents.inner is not None:
            residents.bring_in()
            for p, master, _ in residents.entries:
                residents.restore(p, master, saved.get(p), o._fresh_resident_state)

    def resident_state(self):
        """What a whole-state checkpoint keeps besides Strata's files: the resident parameters'
        optimizer state (with masters) and every group's hyperparameters."""
        o, residents = self.optimizer, self.optimizer._residents
        state = {}
        if residents.inner is not None:
            residents.bring_in(writes=False)
            residents.sync_masters()
            for k, (p, master, _) in enumerate(residents.entries):
                if master in residents.inner.state and residents.inner.state[master]:
                    entry = {key: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                             for key, v in residents.inner.state[master].items()}
                    if master is not p:
                        entry["master"] = master.detach().cpu().clone()
                    state[k] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
        return {"resident": state, "param_groups": groups}

    @torch.no_grad()
    def load_resident_state(self, saved):
        """A whole-state checkpoint's resident part (resident_state's) into the optimizer."""
        o, residents = self.optimizer, self.optimizer._residents
        if len(saved["param_groups"]) != len(o.param_groups):
            raise ValueError("strata.torch.load_checkpoint: the checkpoint's optimizer has %d "
                             "param groups, this one %d" % (len(saved["param_groups"]),
                                                            len(o.param_groups)))
        for g, mine in zip(saved["param_groups"], o.param_groups):
            mine.update(g)
        if residents.inner is None:
            return
        residents.bring_in()
        for k, (p, master, _) in enumerate(residents.entries):
            residents.restore(p, master, saved["resident"].get(k), o._fresh_resident_state)
