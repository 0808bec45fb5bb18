"""DLPack producers over the C ABI's DLManagedTensorVersioned: capsules named
"dltensor_versioned" (DLPack 1.0) for consumers that ask for it (torch.from_dlpack passes
max_version), legacy "dltensor" capsules (DLManagedTensor, wrapping the versioned one) for
those that do not (jax.dlpack); both zero-copy. A capsule nobody consumed calls the managed
tensor's deleter when it is collected."""
import ctypes

from . import _lib

# Private function objects: attributes of ctypes.pythonapi are shared process-wide, and other
# libraries set their own argtypes on them (jax.ffi.pycapsule declares PyCapsule_New's
# destructor as a CFUNCTYPE), which would break these calls.
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                   ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
# The destructor sees the capsule as a raw pointer: it is being deallocated, so it must not be
# turned back into a Python object (that re-enters its deallocation).
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

_NAME = b"dltensor_versioned"
_Managed = ctypes.POINTER(_lib.DLManagedTensorVersioned)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule_ptr):
    # Consumers rename the capsule to "used_dltensor_versioned" and own the tensor from then;
    # only an unconsumed capsule still owns it.
    if _PyCapsule_IsValid(capsule_ptr, _NAME):
        managed = ctypes.cast(_PyCapsule_GetPointer(capsule_ptr, _NAME), _Managed)
        if managed.contents.deleter:
            managed.contents.deleter(managed)


def _versioned_capsule(managed):
    return _PyCapsule_New(ctypes.cast(managed, ctypes.c_void_p), _NAME,
                          ctypes.cast(_capsule_destructor, ctypes.c_void_p))


class _DLManagedTensor(ctypes.Structure):  # DLPack < 1.0
    _fields_ = [("dl_tensor", _lib.DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_LEGACY = b"dltensor"
_live = {}  # address of a legacy struct -> (the struct, the versioned tensor it wraps)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _legacy_deleter(address):
    entry = _live.pop(address, None)
    if entry is not None and entry[1].contents.deleter:
        entry[1].contents.deleter(entry[1])


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _legacy_capsule_destructor(capsule_ptr):
    if _PyCapsule_IsValid(capsule_ptr, _LEGACY):
        _legacy_deleter(_PyCapsule_GetPointer(capsule_ptr, _LEGACY))


def _legacy_capsule(managed):
    legacy = _DLManagedTensor()
    legacy.dl_tensor = managed.contents.dl_tensor  # its shape array lives in `managed`
    legacy.deleter = ctypes.cast(_legacy_deleter, ctypes.c_void_p)
    address = ctypes.addressof(legacy)
    _live[address] = (legacy, managed)
    return _PyCapsule_New(address, _LEGACY, ctypes.cast(_legacy_capsule_destructor, ctypes.c_void_p))


def capsule_from_managed(managed, max_version=None):
    """The capsule for a consumer that passed `max_version` to __dlpack__ (None: legacy)."""
    if max_version is not None and tuple(max_version)[0] >= 1:
        return _versioned_capsule(managed)
    return _legacy_capsule(managed)


class DLPackView:
    """One exported view: hand it to torch.from_dlpack / jax.dlpack.from_dlpack once."""

    def __init__(self, managed):
        self._managed = managed

    def __dlpack_device__(self):
        d = self._managed.contents.dl_tensor.device
        return (d.device_type, d.device_id)

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        if self._managed is None:
            raise RuntimeError("this DLPack view was already consumed")
        # The stream argument asks the producer to order its data before `stream`: the
        # executor's acquire already made the compute stream wait for the layer's copies.
        managed, self._managed = self._managed, None
        return capsule_from_managed(managed, max_version)

    def __del__(self):
        if self._managed is not None and self._managed.contents.deleter:
            self._managed.contents.deleter(self._managed)
