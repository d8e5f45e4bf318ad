"""``speculation_control.drafter_at_k0: skip``: the change to vLLM's speculator object and
its refusals. The model runner V2 it acts on needs CUDA; here a real
``MTPSpeculator`` object is made without its GPU state, and its ``propose`` is a
stand-in with vLLM 0.32.0's parameters that records its calls (the GPU run is
``bench/speculation.py --drafter-at-k0 skip``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator

from rollout_service.config import SpeculationControlSettings
from rollout_service.engines.vllm.drafter_at_k0 import (
    DrafterSkipUnsupported,
    skip_drafter_at_k0,
)
from rollout_service.engines.vllm.schedule_methods import SpecScheduleMethods

MAX_REQS, K_MAX = 4, 3


def speculator(calls: list[dict[str, Any]]) -> MTPSpeculator:
    spec = object.__new__(MTPSpeculator)
    spec.draft_tokens = torch.zeros(MAX_REQS, K_MAX, dtype=torch.int64)
    spec.pcp_manager, spec.dp_size = None, 1

    def propose(input_batch: Any, attn_metadata: Any, *, num_speculative_tokens: int | None
                = None, dummy_run: bool = False, is_profile: bool = False,
                **kwargs: Any) -> torch.Tensor:
        calls.append({"num_speculative_tokens": num_speculative_tokens,
                      "dummy_run": dummy_run, "attn_metadata": attn_metadata, **kwargs})
        spec.draft_tokens[:input_batch.num_reqs] = 7
        return spec.draft_tokens[:input_batch.num_reqs]

    spec.propose = propose
    return spec


def runner(spec: object) -> SimpleNamespace:
    return SimpleNamespace(speculator=spec, adaptive_verification=None)


def test_k0_returns_no_drafts_without_running_the_drafter() -> None:
    calls: list[dict[str, Any]] = []
    spec = speculator(calls)
    assert skip_drafter_at_k0(runner(spec)) == "MTPSpeculator"
    drafts = spec.propose(SimpleNamespace(num_reqs=3), "meta", num_speculative_tokens=0,
                          seeds="s")
    assert calls == [] and drafts.shape == (3, K_MAX) and bool((drafts == -1).all())


def test_k_above_0_dummy_and_profile_runs_still_run_the_drafter() -> None:
    calls: list[dict[str, Any]] = []
    spec = speculator(calls)
    skip_drafter_at_k0(runner(spec))
    skip_drafter_at_k0(runner(spec))  # once per worker, however often it is asked
    batch = SimpleNamespace(num_reqs=2)
    assert bool((spec.propose(batch, "meta", num_speculative_tokens=2) == 7).all())
    spec.propose(input_batch=batch, attn_metadata="meta", dummy_run=True)  # vLLM's dummy run
    spec.propose(batch, "meta", num_speculative_tokens=0, is_profile=True)
    assert [(c["num_speculative_tokens"], c["dummy_run"]) for c in calls] == [
        (2, False), (None, True), (0, False)]
    assert all(c["attn_metadata"] == "meta" for c in calls)


@pytest.mark.parametrize("change, reason", [
    (lambda r: setattr(r, "speculator", None), "model runner V2 .* is needed"),
    (lambda r: setattr(r, "speculator", object()), "not a TargetDependentARSpeculator"),
    (lambda r: setattr(r, "adaptive_verification", object()), "adaptive verification"),
    (lambda r: setattr(r.speculator, "dp_size", 2), "data parallelism"),
    (lambda r: setattr(r.speculator, "propose", lambda input_batch, num_speculative_tokens,
                       dummy_run: None), r"no longer takes \['is_profile'\]"),
])
def test_anything_but_the_supported_setup_is_refused_with_the_reason(change: Any,
                                                                     reason: str) -> None:
    calls: list[dict[str, Any]] = []
    r = runner(speculator(calls))
    change(r)
    with pytest.raises(DrafterSkipUnsupported, match=reason):
        skip_drafter_at_k0(r)


def test_skip_needs_the_controller_and_auto_is_the_default() -> None:
    with pytest.raises(ValueError, match="drafter_at_k0: 'skip' .* needs enabled: true"):
        SpeculationControlSettings(drafter_at_k0="skip")
    assert SpeculationControlSettings(enabled=True, drafter_at_k0="skip").drafter_at_k0 == "skip"
    assert SpeculationControlSettings().drafter_at_k0 == "auto"  # also without the controller


class RefusingLLM:
    """An ``AsyncLLM`` whose workers refuse the change, as a V1 worker does."""

    async def collective_rpc(self, method: str) -> list[str]:
        raise RuntimeError(f"{method}: ModelRunner has no speculator")


async def test_a_workers_refusal_fails_skip_and_leaves_auto_running_the_drafter(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = SpecScheduleMethods()
    engine._llm = RefusingLLM()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="drafter_at_k0: 'skip' is not possible on this "
                                         "engine: .*has no speculator"):
        await engine.skip_drafter_at_k0()
    with caplog.at_level("WARNING"):
        assert await engine.skip_drafter_at_k0(required=False) is False
    assert "a worker refused to skip it" in caplog.text
    assert engine.skips_drafter_at_k0 is False
