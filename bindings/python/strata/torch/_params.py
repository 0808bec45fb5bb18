"""strata.torch's bookkeeping per parameter, in a table keyed by the parameter rather than in
attributes on torch's objects: which session streams it (its owner), the fp32 values a
resident parameter narrowed by offload keeps for its master (and the parameter's version when
they were last its values), and whether a load before the build gave it its values. The table
holds each parameter weakly: a parameter's death frees its entry.

torch.utils.swap_tensors refuses a tensor that has weak references; swap_data (strata.torch.
_surgery) swaps a parameter inside `unreferenced(p)`, which lets go of the table's reference
for the swap and takes it again after (the swap keeps the parameter's identity)."""

import contextlib
import weakref


class _Entry:
    __slots__ = ("owner", "fp32", "fp32_version", "loaded")

    def __init__(self):
        # The StrataSession that streams the parameter, held weakly: the session holds its
        # parameters, so a strong reference here would keep both alive for good (the table
        # holds the entry as long as the parameter lives), its runtime's pinned memory too.
        self.owner = None
        self.fp32 = None  # a narrowed resident's fp32 values, until its optimizer exists
        self.fp32_version = None  # the parameter's version when `fp32` were its values
        self.loaded = False  # loaded before the build: the build takes its values

    def empty(self):
        return self.owner is None and self.fp32 is None and not self.loaded


_table = {}  # id(parameter) -> (weak reference to it, _Entry)


def _forget(key, ref):
    """The weak reference's callback: the parameter died (its id may be reused later)."""
    found = _table.get(key)
    if found is not None and found[0] is ref:
        del _table[key]


def _watch(p, entry):
    _table[id(p)] = (weakref.ref(p, lambda ref, key=id(p): _forget(key, ref)), entry)


def _entry(p, create=False):
    found = _table.get(id(p))
    if found is not None and found[0]() is p:
        return found[1]
    if not create:
        return None
    entry = _Entry()
    _watch(p, entry)
    return entry


def _prune(p):
    entry = _entry(p)
    if entry is not None and entry.empty():
        del _table[id(p)]


# --- the owner ---------------------------------------------------------------------------

def owner(p):
    """The session streaming `p`, or None."""
    entry = _entry(p)
    return None if entry is None or entry.owner is None else entry.owner()


def set_owner(p, session):
    """`p` streams in `session` (None: in none)."""
    if session is None:
        entry = _entry(p)
        if entry is not None:
            entry.owner = None
            _prune(p)
        return
    _entry(p, create=True).owner = weakref.ref(session)


# --- a resident parameter's fp32 values --------------------------------------------------

def fp32(p):
    """The fp32 values offload kept for resident parameter `p`, or None."""
    entry = _entry(p)
    return None if entry is None else entry.fp32


def fp32_version(p):
    entry = _entry(p)
    return None if entry is None else entry.fp32_version


def keep_fp32(p, values):
    """`values` (fp32) are `p`'s before a cast to a narrower dtype: its master starts there."""
    _entry(p, create=True).fp32 = values


def note_fp32_version(p):
    """`p`'s kept fp32 values are its values at its version now."""
    _entry(p).fp32_version = p._version


def drop_fp32(p):
    entry = _entry(p)
    if entry is not None:
        entry.fp32 = entry.fp32_version = None
        _prune(p)


# --- loaded before the build -------------------------------------------------------------

def mark_loaded(p):
    _entry(p, create=True).loaded = True


def take_loaded(p):
    """Whether `p` was loaded before the build; the mark goes."""
    entry = _entry(p)
    if entry is None or not entry.loaded:
        return False
    entry.loaded = False
    _prune(p)
    return True


# --- swapping ----------------------------------------------------------------------------

@contextlib.contextmanager
def unreferenced(p):
    """Within: the table holds no weak reference to `p` (its entry is kept aside)."""
    found = _table.get(id(p))
    entry = None
    if found is not None and found[0]() is p:
        entry = found[1]
        del _table[id(p)]
    del found  # the weak reference goes with the last name of it
    try:
        yield
    finally:
        if entry is not None:
            _watch(p, entry)
