"""``engines/vllm/capture_ceiling.py``: the controlled engine's CUDA graphs reach
``k_max + 1`` times vLLM's default ceiling, unless the user chose the capture.

vLLM's CPU engine captures no graphs, so the CUDA path runs here on a stand-in for
vLLM's resolution on an H100/H200 (``on_cuda``); on the H100 the same start logged
"134 sizes, multiples of 12 up to 2052 tokens (were 147 sizes up to 2048)"
(docs/speculation-control.md, Benchmark).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from vllm.config.compilation import CUDAGraphMode
from vllm.engine.arg_utils import AsyncEngineArgs

from bench.graph_divergence import default_sizes
from rollout_service.config import EMBEDDED_ENGINE_KWARGS
from rollout_service.embedded import ensure_model
from rollout_service.engines.speculative import MTPSettings, load_checkpoint_config
from rollout_service.engines.vllm import graph_policy, spec_schedule
from rollout_service.engines.vllm.capture_ceiling import (
    controlled_ceiling,
    sets_capture,
    with_controlled_ceiling,
)
from rollout_service.engines.vllm.engine_args import build_engine_args
from rollout_service.engines.vllm.graph_ladder import divergent_batches, query_lens_of
from rollout_service.engines.vllm.spec_schedule import startup_ranges, with_startup_schedule

K_MAX = 3
BUDGET = 8192
"""vLLM's ``max_num_batched_tokens`` for the service on a GPU (the H100's log)."""


@pytest.fixture(scope="module")
def engine_args() -> AsyncEngineArgs:
    model = str(ensure_model("tiny"))
    return build_engine_args(model, EMBEDDED_ENGINE_KWARGS,
                             MTPSettings(num_speculative_tokens=K_MAX),
                             load_checkpoint_config(model))


def explicit_grid(ceiling: int) -> list[int]:
    """vLLM 0.32.0's capture sizes for an explicit ceiling (``_set_cudagraph_sizes``)."""
    return sorted({1, 2, 4, *range(8, min(ceiling + 1, 256), 8),
                   *range(256, ceiling + 1, 16), ceiling})


def gpu_resolution(args: AsyncEngineArgs, *,
                   mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE,
                   enforce_eager: bool = False) -> SimpleNamespace:
    """What the service's start reads of vLLM's resolution of ``args`` on an H100/H200:
    the args' own sizes, else the grid of their own ceiling, else vLLM's defaults."""
    compilation = args.compilation_config
    schedule = (args.speculative_config or {}).get("num_speculative_tokens_per_batch_size")
    ceiling = compilation.max_cudagraph_capture_size
    sizes = (compilation.cudagraph_capture_sizes
             or (explicit_grid(ceiling) if ceiling else default_sizes(schedule or [], 1024)))
    return SimpleNamespace(
        use_v2_model_runner=True, model_config=SimpleNamespace(enforce_eager=enforce_eager),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=sizes,
                                           max_cudagraph_capture_size=max(sizes),
                                           cudagraph_mode=mode),
        scheduler_config=SimpleNamespace(max_num_seqs=1024, max_num_batched_tokens=BUDGET),
        speculative_config=SimpleNamespace(num_speculative_tokens=K_MAX,
                                           num_speculative_tokens_per_batch_size=schedule),
        parallel_config=SimpleNamespace(data_parallel_size=1))


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(graph_policy, "resolve", gpu_resolution)
    monkeypatch.setattr(spec_schedule, "resolve", gpu_resolution)


def test_the_ceiling_is_vllms_times_the_longest_query_within_the_token_budget() -> None:
    assert controlled_ceiling(3, is_blackwell=False, max_num_batched_tokens=BUDGET) == 2048
    assert controlled_ceiling(1, is_blackwell=False, max_num_batched_tokens=BUDGET) == 1024
    assert controlled_ceiling(3, is_blackwell=True, max_num_batched_tokens=BUDGET) == 4096
    assert controlled_ceiling(3, is_blackwell=False, max_num_batched_tokens=1500) == 1500


@pytest.mark.usefixtures("on_cuda")
def test_the_controlled_start_captures_every_k_up_to_512_requests(
        engine_args: AsyncEngineArgs) -> None:
    """Through the service's start: aligned sizes up to 2052 tokens, so K = 3 has FULL
    graphs up to 513 requests where vLLM's ceiling ended them at 128, and no batch size
    diverges."""
    started = with_startup_schedule(engine_args)
    sizes = started.compilation_config.cudagraph_capture_sizes
    assert max(sizes) == 2052 and all(size % 12 == 0 for size in sizes)
    assert engine_args.compilation_config.max_cudagraph_capture_size is None  # a copy
    ranges = started.speculative_config["num_speculative_tokens_per_batch_size"]
    assert ranges == startup_ranges(K_MAX, 1024)
    assert not divergent_batches(graph_policy.ladder_of(gpu_resolution(started),
                                                        query_lens_of(ranges)))


@pytest.mark.usefixtures("on_cuda")
def test_vllms_own_graphs_under_as_is(engine_args: AsyncEngineArgs) -> None:
    """``as_is`` keeps vLLM's graphs as vLLM makes them (the benches that reproduce the
    crash start so)."""
    started = with_startup_schedule(engine_args, full_cuda_graphs="as_is")
    assert started.compilation_config.max_cudagraph_capture_size is None
    assert started.compilation_config.cudagraph_capture_sizes is None


@pytest.mark.parametrize("choice", [
    {"max_cudagraph_capture_size": 512},
    {"cudagraph_capture_sizes": [1, 2, 4, 8]},
    {"compilation_config": {"max_cudagraph_capture_size": 512}},
    {"compilation_config": {"cudagraph_capture_sizes": [8, 16]}},
])
def test_a_users_own_capture_is_kept(choice: dict[str, object],
                                     engine_args: AsyncEngineArgs) -> None:
    args = dataclasses.replace(engine_args, **choice)
    assert sets_capture(args)
    assert with_controlled_ceiling(args, gpu_resolution(args)) is args


@pytest.mark.parametrize(("mode", "enforce_eager"), [
    (CUDAGraphMode.NONE, False), (CUDAGraphMode.FULL_AND_PIECEWISE, True)])
def test_an_engine_without_graphs_is_left_alone(mode: CUDAGraphMode, enforce_eager: bool,
                                                engine_args: AsyncEngineArgs) -> None:
    config = gpu_resolution(engine_args, mode=mode, enforce_eager=enforce_eager)
    assert with_controlled_ceiling(engine_args, config) is engine_args


def test_the_ceiling_travels_in_the_compilation_config(engine_args: AsyncEngineArgs) -> None:
    """The rest of the user's compilation config is kept, and vLLM takes the result."""
    user = dataclasses.replace(engine_args, compilation_config={"mode": 0})
    raised = with_controlled_ceiling(user, gpu_resolution(user))
    assert raised.compilation_config.max_cudagraph_capture_size == 2048
    assert raised.compilation_config.mode == 0
    assert user.compilation_config.max_cudagraph_capture_size is None
    dataclasses.replace(raised).create_engine_config()


def test_off_cuda_the_start_is_unchanged(engine_args: AsyncEngineArgs) -> None:
    """vLLM's CPU engine captures no graphs: the start sets no ceiling there."""
    started = with_startup_schedule(engine_args)
    assert started.compilation_config.max_cudagraph_capture_size is None
