"""The Python bindings against the header, one source of truth: strata_layout_probe, a C program
generated from strata.h (tests/abi/gen_layout_probe.py), prints the compiler's offset and size of
every field of every struct and the value of every STRATA_* integer macro; every ctypes struct in
strata._lib and every constant table in strata.core must match it, field by field."""
import ctypes
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bindings" / "python"))

from strata import _lib, core, step_plan  # noqa: E402
import strata  # noqa: E402

SCALARS = {"size_t": ctypes.c_size_t, "int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32,
           "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "uint8_t": ctypes.c_uint8,
           "uint16_t": ctypes.c_uint16, "float": ctypes.c_float, "double": ctypes.c_double,
           "char": ctypes.c_char}


def _probe_path():
    env = os.environ.get("STRATA_LAYOUT_PROBE")
    if env:
        return env
    for preset in ("release", "gpu", "debug"):
        candidate = ROOT / "build" / preset / "tests" / "strata_layout_probe"
        if candidate.exists():
            return str(candidate)
    pytest.fail("strata_layout_probe not found: build the tests (cmake --build --preset release) "
                "or set STRATA_LAYOUT_PROBE")


@pytest.fixture(scope="module")
def header():
    out = subprocess.run([_probe_path()], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def ctypes_name(c_name):
    """strata_tier_usage_t -> TierUsage; DLPack's names stay as they are."""
    if not c_name.startswith("strata_"):
        return c_name
    return "".join(part.capitalize() for part in c_name[len("strata_"):-len("_t")].split("_"))


def compatible(c_type, py_type, header):
    """Whether ctypes type py_type can stand for the C type spelled c_type."""
    c_type = " ".join(re.sub(r"\b(const|struct)\b", " ", c_type).split())
    if "(*)" in c_type:
        return issubclass(py_type, ctypes._CFuncPtr)
    if c_type.endswith("*"):
        target = c_type[:-1].strip()
        if py_type is ctypes.c_void_p:
            return True  # any pointer may travel as void* (opaque handles do)
        if py_type is ctypes.c_char_p:
            return target == "char"
        if issubclass(py_type, ctypes._Pointer):
            return compatible(target, py_type._type_, header)
        return False
    c_type = header["typedefs"].get(c_type, c_type)
    if c_type in header["structs"]:
        return py_type is getattr(_lib, ctypes_name(c_type), None)
    if c_type in header["enums"]:
        return py_type in (ctypes.c_int32, ctypes.c_uint32)
    return c_type in SCALARS and py_type is SCALARS[c_type]


def test_every_struct_has_its_ctypes_class_and_no_other(header):
    declared = {ctypes_name(name) for name in header["structs"]}
    bound = {name for name, value in vars(_lib).items()
             if isinstance(value, type) and issubclass(value, ctypes.Structure)
             and value not in (ctypes.Structure, _lib.Struct)}
    assert declared - bound == set(), "strata.h structs without a ctypes class in strata/_lib.py"
    assert bound - declared == set(), "ctypes classes in strata/_lib.py that strata.h lacks"


def test_every_field_matches_the_header(header):
    problems = []
    for c_name, struct in header["structs"].items():
        cls = getattr(_lib, ctypes_name(c_name))
        c_fields = [f["name"] for f in struct["fields"]]
        py_fields = [f[0] for f in cls._fields_]
        if c_fields != py_fields:
            problems.append("%s: fields %s in strata.h, %s in _lib.%s"
                            % (c_name, c_fields, py_fields, cls.__name__))
            continue
        for field, (_, py_type) in zip(struct["fields"], cls._fields_):
            where = "%s.%s (_lib.%s)" % (c_name, field["name"], cls.__name__)
            descriptor = getattr(cls, field["name"])
            if (descriptor.offset, descriptor.size) != (field["offset"], field["size"]):
                problems.append("%s: offset %d size %d in C, %d and %d in ctypes"
                                % (where, field["offset"], field["size"], descriptor.offset,
                                   descriptor.size))
            if field["count"]:
                if not issubclass(py_type, ctypes.Array) or py_type._length_ != field["count"]:
                    problems.append("%s: an array of %d in C, %s in ctypes"
                                    % (where, field["count"], py_type))
                elif not compatible(field["type"], py_type._type_, header):
                    problems.append("%s: elements are %s in C, %s in ctypes"
                                    % (where, field["type"], py_type._type_))
            elif not compatible(field["type"], py_type, header):
                problems.append("%s: %s in C, %s in ctypes" % (where, field["type"], py_type))
        if ctypes.sizeof(cls) != struct["size"]:
            problems.append("%s: sizeof %d in C, %d in ctypes"
                            % (c_name, struct["size"], ctypes.sizeof(cls)))
    assert not problems, "strata/_lib.py disagrees with strata.h:\n" + "\n".join(problems)


def test_versioned_structs_cover_their_size_macro(header):
    """A Python struct_size (the ctypes size) is never below the header's STRUCT_SIZE."""
    for c_name, struct in header["structs"].items():
        if struct["size_macro"] is not None:
            cls = getattr(_lib, ctypes_name(c_name))
            assert cls().struct_size >= struct["size_macro"], c_name


def _check_table(header, table, prefix):
    """Every entry of a Python table is the header's STRATA_<prefix><NAME>; where the header
    counts the values (STRATA_<prefix>COUNT) the table has them all. (Prefixes are not unique
    enough to demand completeness otherwise: STRATA_STATE_ could name two enums.)"""
    constants = header["constants"]
    for key, value in table.items():
        name = prefix + key.upper()
        assert name in constants, "%s: strata.h has no %s" % (key, name)
        assert constants[name] == value, "%s is %d in strata.h, %d in Python" % (
            name, constants[name], value)
    if prefix + "COUNT" in constants:
        assert len(table) == constants[prefix + "COUNT"], "%sCOUNT" % prefix


@pytest.mark.parametrize("table,prefix", [
    (core.BACKENDS, "STRATA_DEVICE_BACKEND_"), (core.TIERS, "STRATA_TIER_"),
    (core.ROLES, "STRATA_ROLE_"), (core.OPTIMIZERS, "STRATA_OPTIMIZER_"),
    (core.UPDATE_MODES, "STRATA_UPDATE_"), (core.STATES, "STRATA_STATE_"),
    (dict((name, i) for i, name in enumerate(core.LINKS)), "STRATA_LINK_"),
    ({"FORWARD": core.FORWARD, "BACKWARD": core.BACKWARD}, "STRATA_PHASE_"),
    ({"WEIGHT": core.VIEW_WEIGHT, "GRAD": core.VIEW_GRAD, "ACTIVATION": core.VIEW_ACTIVATION},
     "STRATA_VIEW_"),
    (core.STATE_PLACEMENTS, "STRATA_STATE_PLACEMENT_"),
    (core.MASTER_LAYOUTS, "STRATA_MASTER_"), (core.GRAD_SUMS, "STRATA_GRAD_SUM_"),
    ({k.upper(): v for k, v in step_plan.RESIDENCY.items()}, "STRATA_RESIDENCY_"),
    ({k.upper(): v for k, v in step_plan.KEEP.items()}, "STRATA_KEEP_"),
    ({"FORWARD": step_plan.POINTS["f"], "BACKWARD": step_plan.POINTS["b"],
      "END": step_plan.POINTS["end"]}, "STRATA_STEP_POINT_"),
    ({k.upper(): v for k, v in step_plan.FLAGS.items()}, "STRATA_STEP_"),
    ({k.upper(): v for k, v in step_plan.STATE_REASONS.items()}, "STRATA_STEP_STATE_"),
    ({k.upper().replace("_PLANNED", "").replace("KEEP", "KEPT"): v
      for k, v in step_plan.PLANNED.items()}, "STRATA_STEP_PLANNED_"),
])
def test_constant_tables_match_the_header(header, table, prefix):
    _check_table(header, table, prefix)


def test_dtypes_match_the_header_and_sizes_come_from_the_library(header):
    import numpy as np
    spelled = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
               "int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64",
               "bool": "BOOL"}
    _check_table(header, {spelled[k]: v for k, v in core.DTYPES.items()}, "STRATA_DTYPE_")
    for name in core.DTYPES:
        expected = 2 if name == "bfloat16" else np.dtype(name).itemsize
        assert strata.dtype_size(name) == expected, name


def test_array_lengths_and_abi_version_match_the_header(header):
    c = header["constants"]
    assert _lib.MAX_NAME_LENGTH == c["STRATA_MAX_NAME_LENGTH"]
    assert _lib.MAX_NDIM == c["STRATA_MAX_NDIM"]
    assert _lib.TIER_COUNT == c["STRATA_TIER_COUNT"]
    assert _lib.TRACE_KIND_COUNT == c["STRATA_TRACE_KIND_COUNT"]
    assert _lib.ABI_VERSION == (c["STRATA_VERSION_MAJOR"], c["STRATA_VERSION_MINOR"]), \
        "strata/_lib.py's ABI_VERSION is not strata.h's version: bind the new ABI, then raise it"


def test_status_names_and_version_come_from_the_library(header):
    c = header["constants"]
    codes = {name: value for name, value in c.items()
             if name == "STRATA_OK" or name.startswith("STRATA_ERROR_")}
    assert len(codes) >= 16
    for name, value in codes.items():
        assert _lib.lib.strata_status_string(value).decode() == name
        assert strata.errors.status_name(value) == name.replace("STRATA_ERROR_", "").replace(
            "STRATA_", "")
    assert strata.errors.status_name(99999) == "UNKNOWN(99999)"
    version = "%d.%d.%d" % (c["STRATA_VERSION_MAJOR"], c["STRATA_VERSION_MINOR"],
                            c["STRATA_VERSION_PATCH"])
    assert strata.__version__ == strata.version() == version
    assert _lib.lib.strata_version() == c["STRATA_VERSION_NUMBER"]
    # The package's version is strata.h's by construction (pyproject.toml's regex provider):
    # tests/python/core/test_library_loading.py checks the regex.
