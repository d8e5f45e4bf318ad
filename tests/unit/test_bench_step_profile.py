"""``bench/step_profile.py``'s reading of a torch profiler trace: kernels by name, the
device's busy share, CPU ops without their nested children, one trace per engine."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from rich.console import Console

from bench.step_profile import comparison, read_trace, summarize_trace


def event(name: str, ts: float, dur: float, cat: str = "kernel", tid: int = 7) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_kernels_sum_by_name_and_overlaps_count_once_in_the_busy_time() -> None:
    trace = {"traceEvents": [
        event("gemm", 0, 10), event("gemm", 20, 10), event("softmax", 25, 10),  # 25-35
        event("aten::mm", 0, 100, cat="cpu_op"),  # ignored: the trace has kernels
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 50},  # no duration
    ]}
    summary = summarize_trace(trace)
    assert summary.category == "kernel"
    assert summary.time_us == {"gemm": 20.0, "softmax": 10.0}
    assert summary.calls == {"gemm": 2, "softmax": 1}
    assert summary.busy_us == 25.0  # 0-10 and 20-35
    assert summary.span_us == 35.0


def test_a_trace_without_kernels_counts_its_top_level_cpu_ops() -> None:
    trace = {"traceEvents": [
        event("step", 0, 100, cat="cpu_op"), event("aten::mm", 10, 30, cat="cpu_op"),
        event("aten::add", 50, 5, cat="cpu_op"), event("other", 20, 10, cat="cpu_op", tid=8),
        event("step", 200, 50, cat="cpu_op")]}
    summary = summarize_trace(trace)
    assert summary.category == "cpu_op"
    assert summary.time_us == {"step": 150.0, "other": 10.0}  # mm and add are inside step
    assert summary.busy_us == 150.0 and summary.span_us == 250.0
    with pytest.raises(ValueError, match="no kernel and no cpu_op"):
        summarize_trace({"traceEvents": [event("x", 0, 1, cat="python_function")]})


def test_one_gzipped_trace_per_engine_is_read_and_compared(tmp_path: Path) -> None:
    for mode, kernels in (("off", [event("gemm", 0, 40)]),
                          ("k0", [event("gemm", 0, 40), event("rejection", 100, 20)])):
        (tmp_path / mode).mkdir()
        with gzip.open(tmp_path / mode / "w0.1.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": kernels}, f)
    off, k0 = read_trace(tmp_path / "off"), read_trace(tmp_path / "k0")
    console = Console(width=200, record=True)
    console.print(comparison(off, k0, tokens=4, top=5))
    text = console.export_text()
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:5]]
            for line in text.splitlines() if line.count("│") > 4}
    assert rows["rejection"] == ["0.00", "5.00", "+5.00"]
    assert rows["gemm"] == ["10.00", "10.00", "+0.00"]
    assert rows["all"] == ["10.00", "15.00", "+5.00"]
    (tmp_path / "off" / "w0.2.pt.trace.json").write_text("{}")
    with pytest.raises(ValueError, match="expected one worker trace, found 2"):
        read_trace(tmp_path / "off")
