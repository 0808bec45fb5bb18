"""offload()'s undo log (Rollback): what each stage changed, as functions that undo it, run in
reverse order when a later stage fails; and the attribute changes it records."""

import functools


class Rollback:
    """What the stages did, as functions that undo it, run in reverse order on failure."""

    def __init__(self):
        self._undo = []

    def push(self, undo):
        self._undo.append(undo)

    def run(self, error):
        """Undo everything, last first, for `error` (the failure that stops offload, which is
        the one raised): an undo that fails too does not stop the others; it is noted on
        `error`."""
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as e:  # noqa: BLE001 (every undo runs; the first error is raised)
                error.add_note("strata.torch.offload: undoing %r failed too: %r" % (undo, e))


def set_attribute(obj, name, value, rollback):
    """obj.name = value, undone on rollback."""
    remember_attribute(obj, name, rollback)
    setattr(obj, name, value)


def remember_attribute(obj, name, rollback):
    """On rollback, obj's instance attribute `name` becomes what it is now, or none again."""
    rollback.push(functools.partial(_reset_attribute, obj, name,
                                    obj.__dict__.get(name, _ABSENT)))


_ABSENT = object()


def _reset_attribute(obj, name, before):
    if before is _ABSENT:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = before
