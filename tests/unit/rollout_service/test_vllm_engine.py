"""The vLLM engine's decisions that need no running engine: the engine args it builds
(resolved by vLLM's own config classes, as ``AsyncLLM`` would), whether its drafter
can load a push, and how vLLM's per-request counts become stats.

The running engine is in tests/integration/rollout_service/ (MTP on: test_api.py and
test_weights.py; MTP off: test_no_speculation.py).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout_service.config import EMBEDDED_ENGINE_KWARGS
from rollout_service.embedded import ensure_model
from rollout_service.engines.speculative import MTPSettings, load_checkpoint_config
from rollout_service.engines.vllm.engine_args import (
    build_engine_args,
    has_pushable_drafter,
    loads_in_place,
)
from rollout_service.engines.vllm.outputs import to_stats
from rollout_service.engines.vllm.spec_schedule import with_startup_schedule
from rollout_service.protocol.acceptance import InvalidSpecDecodeStats, SpecDecodeStats

MODEL = str(Path(ensure_model("tiny")))


def engine_config(mtp: MTPSettings, **engine_kwargs: object):  # noqa: ANN201 - VllmConfig
    """vLLM's resolved config for the service's engine args on the tiny checkpoint."""
    args = build_engine_args(MODEL, {**EMBEDDED_ENGINE_KWARGS, **engine_kwargs}, mtp,
                             load_checkpoint_config(MODEL))
    return args.create_engine_config()


def test_speculation_off_asks_vllm_for_no_per_request_metrics() -> None:
    """vLLM refuses per-request metrics without a speculative config: a service with
    ``mtp.enabled: false`` must not ask for them, or it never starts."""
    config = engine_config(MTPSettings(enabled=False))
    assert config.speculative_config is None
    assert config.observability_config.per_request_spec_decode_metrics == "none"
    assert not has_pushable_drafter(config.speculative_config, config.model_config)


def test_speculation_on_asks_for_summary_metrics() -> None:
    config = engine_config(MTPSettings(num_speculative_tokens=2))
    assert config.observability_config.per_request_spec_decode_metrics == "summary"


def test_per_request_metrics_without_speculation_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="engine_kwargs.per_request_spec_decode_metrics: "
                                         "'summary' needs speculative decoding"):
        build_engine_args(MODEL, {"per_request_spec_decode_metrics": "summary"},
                          MTPSettings(enabled=False), None)


@pytest.mark.parametrize("method", ["mtp", "mimo_mtp"])
def test_the_checkpoints_mtp_drafter_is_pushable(method: str) -> None:
    config = engine_config(MTPSettings(method=method, num_speculative_tokens=2))
    assert config.speculative_config.method == "mtp"  # vLLM's name for every *_mtp
    assert has_pushable_drafter(config.speculative_config, config.model_config)


def test_an_ngram_drafter_is_not_pushable() -> None:
    config = engine_config(MTPSettings(method="ngram", num_speculative_tokens=2))
    assert config.speculative_config.method == "ngram"
    assert config.observability_config.per_request_spec_decode_metrics == "summary"
    assert not has_pushable_drafter(config.speculative_config, config.model_config)


def test_an_mtp_drafter_from_another_checkpoint_is_not_pushable() -> None:
    # Stands in for a separate MTP checkpoint, which this machine does not have.
    model_config = SimpleNamespace(model=MODEL, model_weights="")
    assert not has_pushable_drafter(SimpleNamespace(method="mtp", model="/elsewhere/mtp"),
                                    model_config)
    assert not has_pushable_drafter(SimpleNamespace(method="eagle", model=MODEL), model_config)


def test_contradictory_vllm_counts_become_invalid_stats_not_an_error() -> None:
    metrics = SimpleNamespace(histogram=[0, 5], num_draft_tokens=2)  # 5 accepted of 2
    invalid = to_stats(metrics)
    assert isinstance(invalid, InvalidSpecDecodeStats)
    assert "[0, 5]" in invalid.detail and "num_accepted_tokens > num_draft_tokens" in invalid.detail
    assert to_stats(SimpleNamespace(histogram=[1, 2], num_draft_tokens=3)) == SpecDecodeStats(
        num_drafts=3, num_draft_tokens=3, num_accepted_tokens=2, num_verify_steps=3,
        accepted_per_position=(2,))
    assert to_stats(None) is None


@pytest.mark.parametrize("platform,quantization,weights_load,expected", [
    ("cuda", None, "auto", True),
    ("cuda", None, "reload", False),
    ("cuda", "fp8", "auto", False),
    ("cpu", None, "auto", False),
])
def test_pushes_load_in_place_only_where_vllm_uses_weights_as_loaded(
        monkeypatch: pytest.MonkeyPatch, platform: str, quantization: str | None,
        weights_load: str, expected: bool) -> None:
    """vLLM's CPU build repacks linear weights after loading and quantized methods
    transform theirs: an in-place copy there would serve wrong weights."""
    from vllm import platforms

    fake = SimpleNamespace(is_cuda=lambda: platform == "cuda")
    monkeypatch.setattr(platforms, "_current_platform", fake)
    assert loads_in_place(weights_load, SimpleNamespace(quantization=quantization)) is expected


def test_the_cpu_engine_reloads() -> None:
    config = engine_config(MTPSettings())
    assert not loads_in_place("auto", config.model_config)


def service_args(mtp: MTPSettings, **engine_kwargs: object):  # noqa: ANN201 - AsyncEngineArgs
    return build_engine_args(MODEL, {**EMBEDDED_ENGINE_KWARGS, **engine_kwargs}, mtp,
                             load_checkpoint_config(MODEL))


def test_the_controlled_engine_starts_with_every_k_in_its_schedule() -> None:
    """Without a start-up schedule vLLM has no lookup to change; with a K missing, model
    runner V2 would capture no graphs for it."""
    args = with_startup_schedule(service_args(MTPSettings(num_speculative_tokens=2),
                                              max_num_seqs=64))
    ranges = args.speculative_config["num_speculative_tokens_per_batch_size"]
    assert ranges[0][0] == 1 and ranges[-1][1] == 64
    assert {k for _, _, k in ranges} == {0, 1, 2}
    config = args.create_engine_config()
    assert config.speculative_config.uses_dynamic_speculative_decoding()
    assert config.speculative_config.num_speculative_tokens == 2


def test_the_start_up_schedule_spans_the_api_servers_default_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The service starts vLLM as its API server does (``usage_context.py``): with
    ``max_num_seqs`` left out, the start-up schedule must cover the batch sizes of that
    engine, not of an embedded one (on an H200: 1024 against 128). The CPU resolves both
    contexts alike, so the defaults are made to differ here."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    def batch_defaults(cls: type, world_size: int) -> tuple[dict, dict]:
        return ({UsageContext.OPENAI_API_SERVER: 4096}, {UsageContext.OPENAI_API_SERVER: 96})

    monkeypatch.setattr(EngineArgs, "get_batch_defaults", classmethod(batch_defaults))
    args = with_startup_schedule(service_args(MTPSettings(num_speculative_tokens=2)))
    ranges = args.speculative_config["num_speculative_tokens_per_batch_size"]
    assert ranges[-1][1] == 96


@pytest.mark.parametrize("mtp, engine_kwargs, message", [
    (MTPSettings(enabled=False), {}, "speculation_control.enabled: needs speculative decoding"),
    (MTPSettings(num_speculative_tokens=2),
     {"speculative_config": {"num_speculative_tokens_per_batch_size": [[1, 8, 1]]}},
     "engine_kwargs.speculative_config.num_speculative_tokens_per_batch_size: the "
     "speculation control sets it"),
    (MTPSettings(num_speculative_tokens=2), {"data_parallel_size": 2},
     "vLLM drops a K schedule with data parallelism"),
])
def test_engines_the_controller_cannot_drive_are_refused_naming_the_field(
        mtp: MTPSettings, engine_kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        with_startup_schedule(service_args(mtp, **engine_kwargs))


def test_skipping_the_drafter_at_k0_is_refused_before_a_v1_engine_starts() -> None:
    """vLLM's CPU engine runs model runner V1, which has no speculator to change: the
    service refuses ``drafter_at_k0: skip`` from the resolved config, before any start."""
    from rollout_service.engines.vllm.drafter_at_k0 import check_engine_args

    with pytest.raises(ValueError, match="speculation_control.drafter_at_k0: 'skip' changes "
                                         "model runner V2's speculator.*runs model runner V1"):
        check_engine_args(service_args(MTPSettings(num_speculative_tokens=2)))


def test_auto_runs_the_drafter_at_k0_where_skip_is_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    """``drafter_at_k0: auto`` (the default) on the CPU engine: the drafter runs at K = 0,
    and the log says why; ``skip`` refuses; ``run`` asks nothing."""
    from rollout_service.engines.vllm.drafter_at_k0 import resolve

    args = service_args(MTPSettings(num_speculative_tokens=2))
    with caplog.at_level("INFO", logger="rollout_service.engines.vllm.drafter_at_k0"):
        assert resolve("auto", args) is False
    assert "runs model runner V1" in caplog.text
    with pytest.raises(ValueError, match="'skip' changes model runner V2's speculator"):
        resolve("skip", args)
    assert resolve("run", args) is False
