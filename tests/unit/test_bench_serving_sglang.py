"""``bench/serving_sglang.py``: ``--sglang-kwargs`` reaches both SGLang servers' commands;
``bench.engine_options.json_object`` (its type, and ``bench.weight_sync``'s
``--engine-kwargs``'s) refuses what is not a JSON object."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

import pytest

from bench.engine_options import json_object
from bench.serving_sglang import launch_command, sglang_config


def test_a_json_object_is_engine_kwargs() -> None:
    assert json_object('{"tokenizer_worker_num": 2, "enable_metrics": true, '
                       '"schedule_policy": "lpm"}') == {
        "tokenizer_worker_num": 2, "enable_metrics": True, "schedule_policy": "lpm"}


@pytest.mark.parametrize(("text", "message"), [
    ("tokenizer_worker_num=2", "not JSON"), ("[2]", "must be a JSON object"),
    ("2", "must be a JSON object")])
def test_what_is_not_a_json_object_is_refused_naming_why(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        json_object(text)


def options(**kwargs: Any) -> argparse.Namespace:
    return argparse.Namespace(model="embedded:tiny", num_speculative_tokens=1,
                              gpu_memory_utilization=0.25, eager=False, sglang_kwargs=kwargs)


def test_the_kwargs_reach_both_servers_and_win_over_the_defaults() -> None:
    """SGLang's own server runs ``launch_command``; the service launches from the same
    config's ``engine_kwargs``."""
    cfg = sglang_config(options(tokenizer_worker_num=2, max_running_requests=64), 512)
    assert cfg.engine_kwargs["tokenizer_worker_num"] == 2
    assert cfg.engine_kwargs["max_running_requests"] == 64
    command = launch_command(cfg, 30000)
    assert command[command.index("--tokenizer-worker-num") + 1] == "2"
    assert command[command.index("--max-running-requests") + 1] == "64"
    plain = launch_command(sglang_config(options(), 512), 30000)
    assert "--tokenizer-worker-num" not in plain
    assert plain[plain.index("--max-running-requests") + 1] == "512"


@pytest.mark.parametrize(("args", "message"), [
    (["--sglang-kwargs", '{"tokenizer_worker_num": 2}'],
     "--sglang-kwargs: for --engine sglang only"),
    (["--engine", "sglang", "--sglang-kwargs", "tokenizer_worker_num=2"],
     "argument --sglang-kwargs: not JSON")])
def test_misplaced_or_malformed_kwargs_are_refused(args: list[str], message: str) -> None:
    run = subprocess.run([sys.executable, "-m", "bench.serving", *args], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr
