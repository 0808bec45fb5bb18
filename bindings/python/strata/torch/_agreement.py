"""Failures under data parallelism made collective: a step of the set-up (st.offload's checks and
building, the optimizer's build) that can fail on one rank alone ends in one exchange of every
rank's outcome (EveryRank), so that a failure on any rank stops every rank there, at once,
naming the rank and its error, instead of the others going on to their next collective and
waiting in it for DataParallel's timeout. The exchange is the Mesh's (strata.torch._distributed:
Strata's own process group, with Strata's timeout); nothing here knows about models."""


# The most of a failed rank's error (its first line) that the ranks exchange and name.
_CAUSE_CHARS = 400


class DataParallelError(RuntimeError):
    """A collective of Strata's data parallelism failed or timed out, or another rank's set-up
    failed: another rank failed, was killed or stopped calling collectives. The step is
    abandoned; the job should end."""


class EveryRank:
    """A step of the set-up that can fail on one rank alone (its arguments, its budget, its
    device, its runtime's memory, its disk), made collective under data parallelism (`mesh`):

        with EveryRank(mesh, "creating the runtime") as step:
            ...
            step.value = what this rank shares (it must pickle)
        step.every  # every rank's value, in rank order

    At the end of the block every rank says how its step went (one all_gather_object); when it
    failed on any rank, every rank raises there, at once: a rank that failed raises its own
    error, with a note naming every rank that failed and why (so an error every rank meets
    alike, a budget too small everywhere, stays the error it is), and the others a
    DataParallelError naming them. Without a mesh the block runs as it is (every: [value]).
    The block itself must make no collective: every rank ends it at its own pace.

    deferred(what): a step that runs before the mesh exists (st.offload's argument checks come
    before its process groups): the block's error is held, and agree(mesh) exchanges the
    outcome once the mesh is made (every rank makes it, whether its checks passed or not)."""

    def __init__(self, mesh, what):
        self.mesh, self.what = mesh, what
        self.value = None
        self.every = None
        self.error = None  # this rank's failure in the block
        self._deferred = False

    @classmethod
    def deferred(cls, what):
        step = cls(None, what)
        step._deferred = True
        return step

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is not None and not isinstance(error, Exception):
            return False  # an interrupt or an exit: the process is going anyway
        self.error = error
        if self._deferred:
            return error is not None  # held for agree(): the caller makes the mesh first
        outcome = self._outcome(self.mesh)
        if outcome is None or outcome is error:
            return False  # (this rank's own error, noted, raises as it is)
        raise outcome

    def agree(self, mesh):
        """A deferred step's outcome, once the mesh exists (None: no data parallelism): returns
        when the step passed on every rank, else raises as the with-block would have."""
        outcome = self._outcome(mesh)
        if outcome is not None:
            raise outcome

    def _outcome(self, mesh):
        """None when the step passed on every rank (self.every then holds their values), else
        what this rank raises: its own error (noted) or a DataParallelError naming the others."""
        error = self.error
        if mesh is None:
            self.every = [self.value]
            return error
        mine = None
        if error is not None:  # its first line, bounded: every rank's message names them all
            text = (str(error).strip().splitlines() or [""])[0]
            if len(text) > _CAUSE_CHARS:
                text = text[:_CAUSE_CHARS - 5] + " [...]"
            mine = "%s: %s" % (type(error).__name__, text)
        try:
            every = mesh.gather_objects((mine, None if error is not None else self.value))
        except DataParallelError:
            if error is None:
                raise
            return error  # the job is broken too; this rank's own error says why it stopped
        failed = ["rank %d (%s)" % (r, cause) for r, (cause, _) in enumerate(every)
                  if cause is not None]
        if not failed:
            self.every = [value for _, value in every]
            return None
        said = "%s failed on %s" % (self.what, ", ".join(failed))
        if error is not None:
            error.add_note("strata.torch data parallel (rank %d of %d): %s; every rank stops "
                           "here" % (mesh.rank, mesh.world, said))
            return error
        return DataParallelError(
            "strata.torch data parallel (rank %d of %d): %s; every rank stops here (this one "
            "did not fail: the error of each rank named says why)" % (mesh.rank, mesh.world, said))
