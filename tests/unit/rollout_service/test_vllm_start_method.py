"""The engine core is spawned on CUDA, forked on the CPU, and a user's choice stands."""

from __future__ import annotations

import os

import pytest

from rollout_service.engines.vllm.start_method import (
    START_METHOD_VARIABLE,
    spawn_engine_core_on_cuda,
)


def test_cuda_spawns_the_engine_core_and_vllm_takes_the_method(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.utils.system_utils import get_mp_context

    monkeypatch.delenv(START_METHOD_VARIABLE, raising=False)
    assert spawn_engine_core_on_cuda(is_cuda=True, environ=os.environ) == "spawn"
    # vLLM reads the same variable when it starts its engine core.
    assert get_mp_context().get_start_method() == "spawn"


def test_the_cpu_engine_keeps_vllms_default() -> None:
    environ: dict[str, str] = {}
    assert spawn_engine_core_on_cuda(is_cuda=False, environ=environ) is None
    assert environ == {}


def test_a_method_the_user_chose_stands() -> None:
    environ = {START_METHOD_VARIABLE: "fork"}
    assert spawn_engine_core_on_cuda(is_cuda=True, environ=environ) == "fork"
    assert environ == {START_METHOD_VARIABLE: "fork"}
