"""strata-prof against a trace written by strata_trace_tests: the JSON is what Perfetto needs,
and the summary's bytes and counts match the runtime's own counters."""
import importlib.machinery
import importlib.util
import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
TRACE = os.environ.get("STRATA_TRACE_FILE", "")


def load_prof():
    loader = importlib.machinery.SourceFileLoader("strata_prof", str(ROOT / "tools" / "strata-prof"))
    spec = importlib.util.spec_from_loader("strata_prof", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trace():
    if not TRACE or not os.path.exists(TRACE):
        pytest.fail("STRATA_TRACE_FILE must name the trace strata_trace_tests wrote")
    return TRACE


def test_trace_loads_with_the_fields_perfetto_needs(trace):
    with open(trace) as f:
        data = json.load(f)
    events = data["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans
    for e in spans:
        for field in ("name", "cat", "ph", "ts", "dur", "pid", "tid", "args"):
            assert field in e, (field, e)
        assert e["dur"] >= 0
    named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {e["tid"] for e in spans} <= named  # every track has a name
    track_names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"link h2d", "link nvme_read", "link nvme_write", "migrations"} <= track_names


def test_summary_matches_the_counters(trace):
    prof = load_prof()
    summary = prof.summarize(trace)
    with open(trace + ".counters.json") as f:
        expected = json.load(f)
    for link in ("copy_h2d", "copy_d2h", "nvme_read", "nvme_write"):
        assert summary["links"][link]["bytes"] == expected[link], link
    assert summary["migrations"]["count"] == expected["migrations"]
    assert summary["acquires"] == expected["acquires"]
    assert summary["links"]["copy_h2d"]["gbps"] > 0
    assert 0 <= summary["links"]["copy_h2d"]["busy_percent"] <= 100


def test_cli_summary_plot_and_compare(trace, tmp_path, capsys):
    prof = load_prof()
    assert prof.main([trace]) == 0
    assert "copy_h2d" in capsys.readouterr().out
    assert prof.main([trace, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["links"]["nvme_read"]["bytes"] > 0
    png = tmp_path / "timeline.png"
    assert prof.main([trace, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert prof.main(["--compare", trace, trace]) == 0
    assert "1.000" in capsys.readouterr().out


def test_interval_helpers():
    prof = load_prof()
    merged = prof.union([(5, 7), (0, 2), (1, 3), (6, 9)])
    assert merged == [[0, 3], [5, 9]]
    assert prof.length(merged) == 7
    assert prof.intersect(merged, [[2, 6]]) == 2
