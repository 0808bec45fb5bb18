"""Errors: every failing C ABI call raises a StrataError carrying the status and the library's
message (which names what was wrong); subclasses per status so callers can catch what they
handle. Status names come from the library (strata_status_string), never from a copy here."""
from . import _lib


def status_name(status):
    """The library's name of a status without its prefix ("BUSY" for STRATA_ERROR_BUSY);
    "UNKNOWN(n)" for a value the library does not know."""
    name = _lib.lib.strata_status_string(status).decode()
    if name == "STRATA_UNKNOWN_STATUS":
        return "UNKNOWN(%d)" % status
    return name.replace("STRATA_ERROR_", "", 1).replace("STRATA_", "", 1)


class StrataError(RuntimeError):
    """A C ABI call failed. `status` is the strata_status_t, `status_name` its name."""

    def __init__(self, status, message):
        self.status = status
        self.status_name = status_name(status)
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


_BY_NAME = {"INVALID_ARGUMENT": InvalidArgument, "OUT_OF_MEMORY": OutOfMemory,
            "NOT_FOUND": NotFound, "DATA_CORRUPTION": DataCorruption,
            "INVALID_STATE": InvalidState}


def check(status):
    """Raise the StrataError for `status` (with the thread's last error message) unless OK."""
    if status != 0:
        message = _lib.lib.strata_last_error_message()
        error = _BY_NAME.get(status_name(status), StrataError)
        raise error(status, message.decode() if message else "")
