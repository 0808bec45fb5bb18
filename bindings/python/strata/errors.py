"""Errors: every failing C ABI call raises a StrataError carrying the status and the library's
message (which names what was wrong); subclasses per status so callers can catch what they
handle."""
from . import _lib

STATUS_NAMES = {
    0: "OK", 1: "INVALID_ARGUMENT", 2: "OUT_OF_MEMORY", 3: "NOT_FOUND", 4: "ALREADY_EXISTS",
    5: "BUSY", 6: "NOT_READY", 7: "UNSUPPORTED", 8: "NO_DEVICE", 9: "BACKEND", 10: "IO",
    11: "DATA_CORRUPTION", 12: "CANCELLED", 13: "TIMEOUT", 14: "INVALID_STATE", 15: "INTERNAL",
}


class StrataError(RuntimeError):
    """A C ABI call failed. `status` is the strata_status_t, `status_name` its name."""

    def __init__(self, status, message):
        self.status = status
        self.status_name = STATUS_NAMES.get(status, "UNKNOWN(%d)" % status)
        self.message = message
        super().__init__("%s: %s" % (self.status_name, message))


class InvalidArgument(StrataError, ValueError):
    pass


class OutOfMemory(StrataError, MemoryError):
    pass


class NotFound(StrataError, LookupError):
    pass


class InvalidState(StrataError):
    pass


class DataCorruption(StrataError):
    pass


_BY_STATUS = {1: InvalidArgument, 2: OutOfMemory, 3: NotFound, 11: DataCorruption,
              14: InvalidState}


def check(status):
    """Raise the StrataError for `status` (with the thread's last error message) unless OK."""
    if status != 0:
        message = _lib.lib.strata_last_error_message()
        raise _BY_STATUS.get(status, StrataError)(status, message.decode() if message else "")
