"""The report of ``bench/weight_sync.py``: the tables it prints, the figures it holds
against the issue's targets, and the raw runs it writes as JSON.

Runs in the caller's process once the rounds are over, on their ``Timed`` results: it
talks to no service or engine (torch only names the GPU). Apart from the modes and the
driver because what is printed does not depend on how it was timed;
``bench/weight_sync_sglang.py`` prints its own rounds with the same ``print_report``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.weight_sync_modes import PUSH_MODES, Timed

GPU_TARGET_S = {"1b": 0.060, "7b": 0.30}
"""The issue's targets for one push of main model + drafter into GPU memory."""
CPU_TARGET_SPEEDUP = 2.0
CPU_TARGET_GB_PER_S = 1.0


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU, {os.cpu_count()} cores, trainer torch threads {torch.get_num_threads()}"


def print_checksums(console: Console, checksums: dict[str, dict[str, str]]) -> None:
    table = Table("mode", "main sha256", "draft sha256", "same as first")
    first = next(iter(checksums.values()), {})
    for name, c in checksums.items():
        table.add_row(name, c.get("main", "-")[:16], c.get("draft", "-")[:16],
                      "yes" if c == first else "NO")
    console.print(table)


def print_report(console: Console, opts: argparse.Namespace, num_bytes: int,
                 results: dict[str, Timed]) -> None:
    """Totals, parts per mode, and the ratios and targets that decide the question."""
    console.print(f"model: embedded:{opts.size}, main + MTP drafter; engines on "
                  f"{opts.engine_device}, kwargs {opts.engine_kwargs}; trainer tensors on "
                  f"{opts.device}: {device_name(opts.device)}; load average "
                  f"{os.getloadavg()[0]:.1f}")
    console.print(f"bytes per push: {num_bytes:,} ({num_bytes / 1e9:.3f} GB), written once: "
                  f"the drafter loads from the same bytes; {opts.rounds} rounds after 1 "
                  "warm-up, order rotated each round")
    table = Table("mode", "median s", "min - max s", "GB/s (median)")
    for name, timed in results.items():
        table.add_row(name, f"{timed.median_s:.4f}",
                      f"{min(timed.total_s):.4f} - {max(timed.total_s):.4f}",
                      f"{num_bytes / timed.median_s / 1e9:.2f}")
    console.print(table)
    for name, timed in results.items():
        parts = Table(f"{name}: part", "median s", "min - max s", "% of total")
        for part, values in timed.parts.items():
            median = statistics.median(values)
            parts.add_row(part, f"{median:.4f}", f"{min(values):.4f} - {max(values):.4f}",
                          f"{100 * median / timed.median_s:.0f}")
        console.print(parts)
    ratios = Table("figure", "value", "target", "met")
    for row in ratio_rows(opts, num_bytes, {n: t.median_s for n, t in results.items()}):
        ratios.add_row(*row)
    if ratios.row_count:
        console.print(ratios)


def ratio_rows(opts: argparse.Namespace, num_bytes: int,
               medians: dict[str, float]) -> list[tuple[str, str, str, str]]:
    """(figure, value, target, met) rows: each push mode against the floor, the disk
    reload and the issue's target; in place against reload per transport."""
    rows = []

    def met(ok: bool) -> str:
        return "yes" if ok else "NO"

    for name in (n for n in medians if n in PUSH_MODES):
        push_s = medians[name]
        rate = num_bytes / push_s / 1e9
        if "floor" in medians:
            rows.append((f"{name} over the floor", f"{push_s / medians['floor']:.1f}x", "-", "-"))
        if "disk" in medians:
            speedup = medians["disk"] / push_s
            target = CPU_TARGET_SPEEDUP if opts.device == "cpu" else None
            rows.append((f"{name}: speed-up over disk", f"{speedup:.2f}x",
                         f">= {target:g}x" if target else "-",
                         met(speedup >= target) if target else "-"))
        if opts.device == "cpu":
            rows.append((f"{name}: rate, end to end", f"{rate:.2f} GB/s",
                         f">= {CPU_TARGET_GB_PER_S:g} GB/s", met(rate >= CPU_TARGET_GB_PER_S)))
        elif opts.size in GPU_TARGET_S:
            target_s = GPU_TARGET_S[opts.size]
            rows.append((f"{name}: push, end to end", f"{push_s * 1e3:.1f} ms ({rate:.1f} GB/s)",
                         f"<= {target_s * 1e3:.0f} ms (>= {num_bytes / target_s / 1e9:.0f} GB/s)",
                         met(push_s <= target_s)))
        if name.endswith("-reload") and name.removesuffix("-reload") in medians:
            in_place = name.removesuffix("-reload")
            rows.append((f"{in_place} over {name}: speed-up",
                         f"{push_s / medians[in_place]:.2f}x", "-", "-"))
    return rows


def write_json(path: Path, opts: argparse.Namespace, num_bytes: int,
               results: dict[str, Timed]) -> None:
    """The raw per-run numbers, for plots and comparisons across machines."""
    path.write_text(json.dumps({
        "size": opts.size, "device": opts.device, "device_name": device_name(opts.device),
        "engine_kwargs": opts.engine_kwargs, "num_bytes": num_bytes, "rounds": opts.rounds,
        "modes": {name: {"total_s": list(t.total_s),
                         "parts": {p: list(v) for p, v in t.parts.items()}}
                  for name, t in results.items()}}, indent=2))
