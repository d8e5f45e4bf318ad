"""``bench/serving_sglang.py``: ``--sglang-arg`` reaches both SGLang servers' commands."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from bench.serving_sglang import launch_command, server_arg, sglang_config


@pytest.mark.parametrize(("text", "expected"), [
    ("tokenizer_worker_num=2", ("tokenizer_worker_num", 2)),
    ("enable_metrics=true", ("enable_metrics", True)),
    ("schedule_conservativeness=0.5", ("schedule_conservativeness", 0.5)),
    ("schedule_policy=lpm", ("schedule_policy", "lpm")),
])
def test_a_server_arg_is_an_engine_kwargs_entry(text: str, expected: tuple) -> None:
    assert server_arg(text) == expected


@pytest.mark.parametrize("text", ["tokenizer_worker_num", "=2", "--tokenizer-worker-num=2",
                                  "tokenizer-worker-num=2"])
def test_a_malformed_server_arg_is_refused_naming_the_form(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        server_arg(text)


def options(*args: tuple[str, object]) -> argparse.Namespace:
    return argparse.Namespace(model="embedded:tiny", num_speculative_tokens=1,
                              gpu_memory_utilization=0.25, eager=False, sglang_arg=list(args))


def test_the_args_reach_both_servers_and_win_over_the_defaults() -> None:
    """SGLang's own server runs ``launch_command``; the service launches from the same
    config's ``engine_kwargs``."""
    cfg = sglang_config(options(("tokenizer_worker_num", 2), ("max_running_requests", 64)),
                        512)
    assert cfg.engine_kwargs["tokenizer_worker_num"] == 2
    assert cfg.engine_kwargs["max_running_requests"] == 64
    command = launch_command(cfg, 30000)
    assert command[command.index("--tokenizer-worker-num") + 1] == "2"
    assert command[command.index("--max-running-requests") + 1] == "64"
    plain = launch_command(sglang_config(options(), 512), 30000)
    assert "--tokenizer-worker-num" not in plain
    assert plain[plain.index("--max-running-requests") + 1] == "512"


def test_a_server_arg_without_sglang_is_refused() -> None:
    run = subprocess.run([sys.executable, "-m", "bench.serving", "--sglang-arg",
                          "tokenizer_worker_num=2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--sglang-arg: for --engine sglang only" in run.stderr
