"""``engines/vllm/graph_policy.py``: what the controller does with FULL CUDA graphs.

vLLM's CPU engine captures no graphs, so the aligned start itself is a GPU test
(``test_spec_churn.py``); here: the refusal per graph mode and policy, which modes get
aligned, the engine arguments that carry the sizes (resolved by vLLM), and the check
that refuses sizes whose drafter would diverge.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
from vllm.config.compilation import CUDAGraphMode
from vllm.engine.arg_utils import AsyncEngineArgs

from bench.graph_divergence import DEFAULT_GRID, default_sizes, ladder
from rollout_service.config import EMBEDDED_ENGINE_KWARGS, load_config
from rollout_service.embedded import ensure_model
from rollout_service.engines.speculative import MTPSettings, load_checkpoint_config
from rollout_service.engines.vllm import graph_policy
from rollout_service.engines.vllm.engine_args import build_engine_args
from rollout_service.engines.vllm.graph_ladder import aligned_capture_sizes
from rollout_service.engines.vllm.graph_policy import (
    align_full_graphs,
    apply_full_graph_policy,
    can_diverge,
    check_cuda_graphs,
    check_no_divergence,
    warn_divergence,
    with_capture_sizes,
    with_user_schedule_graphs,
)
from rollout_service.engines.vllm.spec_schedule import startup_ranges
from rollout_service.local import engine_spec

FULL_MODES = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY,
              CUDAGraphMode.FULL_AND_PIECEWISE)
QUERY_LENS = (1, 2, 3, 4)
STARTUP = startup_ranges(3, 1024)  # every K: the query lengths 1 to 4


@pytest.fixture(scope="module")
def engine_args() -> AsyncEngineArgs:
    model = str(ensure_model("tiny"))
    return build_engine_args(model, EMBEDDED_ENGINE_KWARGS,
                             MTPSettings(num_speculative_tokens=3), load_checkpoint_config(model))


@pytest.mark.parametrize("mode", list(CUDAGraphMode))
@pytest.mark.parametrize("policy", ["refuse", "align", "as_is"])
def test_full_cuda_graphs_are_refused_on_cuda_under_refuse(mode: CUDAGraphMode,
                                                           policy: str) -> None:
    """Every vLLM graph mode with FULL graphs in it is refused on CUDA under ``refuse``,
    naming the field and the ways out; PIECEWISE, NONE, the other policies and the CPU
    start are not."""
    refused = mode.has_full_cudagraphs() and policy == "refuse"
    assert refused == (mode in FULL_MODES and policy == "refuse")
    if refused:
        with pytest.raises(ValueError, match=r"^speculation_control\.full_cuda_graphs: "
                                             rf".*\({mode.name}\).*enforce_eager.*align"):
            check_cuda_graphs(mode, is_cuda=True, policy=policy)  # type: ignore[arg-type]
    else:
        check_cuda_graphs(mode, is_cuda=True, policy=policy)  # type: ignore[arg-type]
    check_cuda_graphs(mode, is_cuda=False, policy=policy)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", list(CUDAGraphMode))
def test_only_full_and_piecewise_graphs_are_aligned(
        mode: CUDAGraphMode, engine_args: AsyncEngineArgs) -> None:
    assert can_diverge(mode) == (mode == CUDAGraphMode.FULL_AND_PIECEWISE)
    config = h200_config(DEFAULT_GRID, mode=mode)
    aligned = apply_full_graph_policy(engine_args, config, policy="align",  # type: ignore[arg-type]
                                      query_lens=QUERY_LENS)
    assert (aligned is not engine_args) == (mode == CUDAGraphMode.FULL_AND_PIECEWISE)
    assert apply_full_graph_policy(engine_args, config, policy="as_is",  # type: ignore[arg-type]
                                   query_lens=QUERY_LENS) is engine_args


def h200_config(sizes: tuple[int, ...] | list[int], *,
                mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE,
                schedule: list[list[int]] | None = None) -> SimpleNamespace:
    """What the graph policy reads of vLLM's resolution on an H200 (the CPU engine resolves
    no graphs)."""
    return SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_capture_sizes=list(sizes), max_cudagraph_capture_size=max(sizes),
            cudagraph_mode=mode),
        scheduler_config=SimpleNamespace(max_num_seqs=1024, max_num_batched_tokens=8192),
        speculative_config=SimpleNamespace(num_speculative_tokens_per_batch_size=schedule,
                                           num_speculative_tokens=3))


def test_as_is_warns_where_the_drafter_diverges(caplog: pytest.LogCaptureFixture) -> None:
    config = h200_config(DEFAULT_GRID)
    with caplog.at_level(logging.WARNING):
        warn_divergence(config, QUERY_LENS)  # type: ignore[arg-type]
    assert [record.getMessage().split(" the drafter")[0] for record in caplog.records] == [
        "speculation_control.full_cuda_graphs: at K = 0",
        "speculation_control.full_cuda_graphs: at K = 1"]
    assert "[3, 5, 6, 9," in caplog.records[0].getMessage()


def test_sizes_whose_drafter_diverges_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^speculation_control\.full_cuda_graphs: .* at "
                                         r"\d+ batch sizes \(3 requests at query length 1"):
        check_no_divergence(ladder(list(DEFAULT_GRID), STARTUP, 1024))
    check_no_divergence(ladder(aligned_capture_sizes(DEFAULT_GRID, QUERY_LENS,
                                                     max_num_tokens=8192), STARTUP, 1024))


def test_the_sizes_travel_in_the_compilation_config(engine_args: AsyncEngineArgs) -> None:
    """Set through ``compilation_config`` with the top-level shortcuts cleared (vLLM refuses
    both at once), the rest of the user's compilation config kept, vLLM resolves them."""
    user = dataclasses.replace(engine_args, cudagraph_capture_sizes=[1, 2],
                               compilation_config={"mode": 0})
    aligned = with_capture_sizes(user, [12, 24, 36])
    assert aligned.compilation_config.cudagraph_capture_sizes == [12, 24, 36]
    assert aligned.compilation_config.max_cudagraph_capture_size == 36
    assert aligned.compilation_config.mode == 0
    assert aligned.cudagraph_capture_sizes is None
    assert user.compilation_config.cudagraph_capture_sizes is None  # not changed in place
    dataclasses.replace(aligned).create_engine_config()  # vLLM takes them


def test_align_resolves_checks_and_returns_new_args(engine_args: AsyncEngineArgs) -> None:
    """On the CPU vLLM resolves no graphs, so the sizes are one multiple; the same calls
    run on CUDA."""
    aligned = align_full_graphs(engine_args, QUERY_LENS)
    assert aligned.compilation_config.cudagraph_capture_sizes == [12]
    assert engine_args.compilation_config.cudagraph_capture_sizes is None
    up_to_six = align_full_graphs(engine_args, (1, 2, 3, 4, 5, 6))
    assert up_to_six.compilation_config.cudagraph_capture_sizes == [60]
    with pytest.raises(ValueError, match=r"^speculation_control\.full_cuda_graphs: .*420.*"
                                         r"FULL_DECODE_ONLY"):
        align_full_graphs(engine_args, (1, 2, 3, 4, 5, 6, 7))


# --- the CUDA path, with vLLM's resolution stood in (the CPU engine resolves no graphs) ---

USER_SCHEDULE = [[1, 1, 3], [2, 2, 2], [3, 31, 3], [32, 1024, 1]]  # K = 1 from 32 on


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``is_cuda`` True, and ``resolve`` giving what vLLM 0.32.0 resolves on an H200 for
    FULL_AND_PIECEWISE: the args' own capture sizes, else its defaults for their schedule
    (``bench.graph_divergence.default_sizes``)."""
    from vllm.platforms import current_platform

    def resolve(args: AsyncEngineArgs) -> SimpleNamespace:
        schedule = args.speculative_config["num_speculative_tokens_per_batch_size"]
        sizes = (args.compilation_config.cudagraph_capture_sizes
                 or default_sizes(schedule, 1024))
        return h200_config(sizes, schedule=schedule)

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(graph_policy, "resolve", resolve)


def with_schedule(args: AsyncEngineArgs, schedule: list[list[int]]) -> AsyncEngineArgs:
    return dataclasses.replace(args, speculative_config={
        **args.speculative_config, "num_speculative_tokens_per_batch_size": schedule})


@pytest.mark.usefixtures("on_cuda")
def test_a_users_own_schedule_is_aligned_under_align(engine_args: AsyncEngineArgs) -> None:
    args = with_schedule(engine_args, USER_SCHEDULE)
    aligned = with_user_schedule_graphs(args, "align")
    sizes = aligned.compilation_config.cudagraph_capture_sizes
    assert sizes and all(size % 12 == 0 for size in sizes) and max(sizes) >= 512


@pytest.mark.usefixtures("on_cuda")
def test_a_service_on_its_defaults_aligns(engine_args: AsyncEngineArgs) -> None:
    """The default policy (H200: 1000 random K changes ran clean with it) flows from the
    service's config into the engine's start."""
    spec = engine_spec(load_config(model="embedded:tiny"))
    aligned = with_user_schedule_graphs(with_schedule(engine_args, USER_SCHEDULE),
                                        spec.full_cuda_graphs)
    assert all(size % 12 == 0 for size in aligned.compilation_config.cudagraph_capture_sizes)


@pytest.mark.usefixtures("on_cuda")
@pytest.mark.parametrize("policy", ["refuse", "as_is"])
def test_a_users_own_schedule_otherwise_starts_as_given_with_a_warning(
        policy: str, engine_args: AsyncEngineArgs, caplog: pytest.LogCaptureFixture) -> None:
    args = with_schedule(engine_args, USER_SCHEDULE)
    with caplog.at_level(logging.WARNING):
        assert with_user_schedule_graphs(args, policy) is args  # type: ignore[arg-type]
    (record,) = caplog.records  # K = 1 diverges at 9 and 21 too, where this schedule runs K = 3
    assert "at K = 1 " in record.getMessage() and ": [33, 45, 57," in record.getMessage()


@pytest.mark.usefixtures("on_cuda")
def test_no_schedule_of_the_users_is_left_alone(engine_args: AsyncEngineArgs) -> None:
    assert with_user_schedule_graphs(engine_args, "align") is engine_args


def test_a_users_own_schedule_off_cuda_is_left_alone(engine_args: AsyncEngineArgs) -> None:
    args = with_schedule(engine_args, USER_SCHEDULE)
    assert with_user_schedule_graphs(args, "align") is args  # vLLM's CPU engine: no graphs


@pytest.mark.usefixtures("on_cuda")
def test_align_refuses_a_config_that_still_diverges(engine_args: AsyncEngineArgs,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM that resolved other sizes than the aligned ones it was given (here: its
    defaults again) is caught by the check on the resolved config, naming the field."""
    args = with_schedule(engine_args, startup_ranges(3, 1024))
    assert align_full_graphs(args, QUERY_LENS).compilation_config.cudagraph_capture_sizes
    defaults = graph_policy.resolve(args)
    monkeypatch.setattr(graph_policy, "resolve", lambda _: defaults)
    with pytest.raises(ValueError, match=r"^speculation_control\.full_cuda_graphs: .*"
                                         r"leave engine_kwargs\.compilation_config"):
        align_full_graphs(args, QUERY_LENS)
