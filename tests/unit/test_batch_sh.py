"""``tools/gpu/batch.sh`` without a GPU (``BATCH_DRY_RUN=1``): every step a device call can
name runs a command whose arguments the bench's own parser takes, and the knobs of the
steps the open GPU issues run (``spec-bench``, ``sglang-serving``) reach the command line
as their comments say. A flag the parser refuses would cost a device call."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.speculation_options import parse_options

REPO = Path(__file__).resolve().parents[2]
BATCH = REPO / "tools" / "gpu" / "batch.sh"


def dry_run(*steps: str, **env: str) -> list[tuple[str, int, list[str]]]:
    """Each step's (name, limit in s, command) as the script would run them."""
    out = subprocess.run(["bash", str(BATCH), *steps], capture_output=True, text=True,
                         check=True, cwd=REPO, timeout=60,
                         env={**os.environ, "BATCH_DRY_RUN": "1", "OUT": "/tmp/out", **env})
    blocks = re.findall(r"^== (\S+) \(limit (\d+)s\)\n(.*?)^== end$", out.stdout,
                        re.MULTILINE | re.DOTALL)
    return [(name, int(limit), body.split("\n")[:-1]) for name, limit, body in blocks]


def every_step() -> list[str]:
    """The step names the script knows (its refusal lists them)."""
    refused = subprocess.run(["bash", str(BATCH), "no-such-step"], capture_output=True,
                             text=True, cwd=REPO, timeout=60,
                             env={**os.environ, "BATCH_DRY_RUN": "1", "OUT": "/tmp/out"})
    assert refused.returncode == 2
    return re.search(r"\((.*)\)", refused.stderr).group(1).split()


class Parsed(Exception):
    """Raised in place of returning from ``parse_args``: the arguments parsed."""


def parses(module: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """``args`` through the parser ``python -m module`` builds (the module's ``main``,
    stopped right after ``parse_args``); a refused argument fails with argparse's
    message."""
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self: argparse.ArgumentParser, *a: object, **k: object) -> None:
        raise Parsed(real(self, *a, **k))  # type: ignore[arg-type]

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [module, *args])
    with pytest.raises(Parsed) as parsed:
        importlib.import_module(module).main()
    return parsed.value.args[0]


def bench_steps() -> list[tuple[str, str, list[str]]]:
    """(step, module, arguments) of every step that runs ``python3 -m bench.*``."""
    return [(name, command[2], command[3:]) for name, _, command in dry_run(*every_step())
            if command[:2] == ["python3", "-m"] and command[2].startswith("bench.")]


def test_every_step_is_listed_and_dry_runs() -> None:
    steps = every_step()
    assert {"spec-bench", "sglang-serving", "spec-tests", "sglang-tests"} <= set(steps)
    ran = dry_run(*steps)
    assert len(ran) >= len(steps)  # a step may run several commands
    assert all(limit <= 600 for _, limit, _ in ran)  # the device's limit a call


@pytest.mark.parametrize(("step", "module", "args"), bench_steps(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_the_benches_parsers_take_every_steps_arguments(
        step: str, module: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    parses(module, args, monkeypatch)


def test_the_spec_bench_knobs_reach_the_command() -> None:
    [(name, limit, command)] = dry_run(
        "spec-bench", NOISE="0.3,0.6", STALE="also", FROZEN="1", LEVELS="", PROMPTS="512",
        ROUNDS="4", WAVES="1", STEP_LIMIT_S="480", CAPTURE_TOKENS="2048",
        CALIBRATE_TO="256", STATIC_K="0,3")
    assert name == "spec-bench-0.3_0.6-stale"  # no comma: the device tool drops such names
    assert limit == 480
    assert command[2] == "bench.speculation"
    opts, noises = parse_options(command[3:])  # and the checks after parsing
    assert noises == [0.3, 0.6]
    assert opts.concurrency == []  # the rollout alone
    assert (opts.rounds, opts.waves, opts.rollout_prompts) == (4, 1, 512)
    assert opts.frozen and opts.stale_drafter and not opts.stale_only
    assert opts.max_capture_tokens == 2048 and opts.calibration_max_batch_size == 256
    [(_, _, stale_only)] = dry_run("spec-bench", STALE="1")
    assert "--stale-only" in stale_only and "--frozen" not in stale_only
    [(default_name, default_limit, default)] = dry_run("spec-bench")
    assert (default_name, default_limit) == ("spec-bench-0.1", 570)
    assert default[default.index("--concurrency") + 1] == "1,16,64,256"


def test_the_sglang_serving_knobs_reach_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    [(_, _, command)] = dry_run("sglang-serving", MODES="service,sglang-server",
                                LEVELS="512", ROUNDS="6")
    opts = parses(command[2], command[3:], monkeypatch)
    assert opts.engine == "sglang" and opts.rounds == 6
    assert command[command.index("--concurrency") + 1] == "512"
    assert command[command.index("--modes") + 1] == "service,sglang-server"


def test_the_mixed_lengths_step_takes_the_512_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sglang-serving-mixed`` at 512 in flight: the gap of ``sglang-serving`` on lengths
    that do not all end in one step; by default 128 in flight, 3 rounds, every mode."""
    [(_, _, command)] = dry_run("sglang-serving-mixed", MODES="service,sglang-server",
                                LEVELS="512", ROUNDS="5")
    opts = parses(command[2], command[3:], monkeypatch)
    assert (opts.rounds, opts.length_spread) == (5, 0.5)
    assert command[command.index("--concurrency") + 1] == "512"
    assert command[command.index("--modes") + 1] == "service,sglang-server"
    [(_, _, default)] = dry_run("sglang-serving-mixed")
    assert default[default.index("--concurrency") + 1] == "128" and "--modes" not in default
    assert default[default.index("--rounds") + 1] == "3"


def test_sglang_kwargs_reach_both_serving_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SGLANG_KWARGS='{...}'``: ``--sglang-kwargs``, parsed by the bench; none by
    default."""
    for step in ("sglang-serving", "sglang-serving-mixed"):
        [(_, _, command)] = dry_run(step, SGLANG_KWARGS='{"tokenizer_worker_num": 2, '
                                    '"schedule_policy": "lpm"}')
        opts = parses(command[2], command[3:], monkeypatch)
        assert opts.sglang_kwargs == {"tokenizer_worker_num": 2, "schedule_policy": "lpm"}
        [(_, _, default)] = dry_run(step)
        assert "--sglang-kwargs" not in default


def test_model_reaches_both_serving_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MODEL=embedded:1b``: the serving steps on the 1b; ``embedded:small`` by default."""
    for step in ("sglang-serving", "sglang-serving-mixed"):
        [(_, _, command)] = dry_run(step, MODEL="embedded:1b")
        assert parses(command[2], command[3:], monkeypatch).model == "embedded:1b"
        [(_, _, default)] = dry_run(step)
        assert default[default.index("--model") + 1] == "embedded:small"
