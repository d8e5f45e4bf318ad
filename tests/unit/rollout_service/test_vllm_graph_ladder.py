"""``engines/vllm/graph_ladder.py`` against vLLM 0.32.0's own ``CudaGraphManager``.

The manager is built without a GPU or a process group (its ``__init__`` asks for the
pipeline group): the fields ``_init_candidates`` and ``dispatch`` read are set here, and
its candidates are then vLLM's own. A vLLM whose capture or dispatch rules differ from
the model in ``graph_ladder.py`` fails these tests.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

from bench.graph_divergence import default_sizes, ladder
from rollout_service.engines.vllm.graph_ladder import (
    GraphChoice,
    GraphLadder,
    aligned_capture_sizes,
    divergent_batches,
    query_lens_of,
)
from rollout_service.engines.vllm.spec_schedule import ScheduleRanges, startup_ranges

K_MAX = 3


def vllm_manager(sizes: list[int], schedule: ScheduleRanges, max_num_reqs: int,
                 mode: CUDAGraphMode) -> CudaGraphManager:
    manager = object.__new__(CudaGraphManager)
    speculative = SimpleNamespace(num_speculative_tokens_per_batch_size=schedule,
                                  uses_dynamic_speculative_decoding=lambda: True)
    manager.vllm_config = SimpleNamespace(
        speculative_config=speculative, num_speculative_tokens=K_MAX,
        cache_config=SimpleNamespace(use_kda_recoverssm=False))
    manager.compilation_config = SimpleNamespace(cudagraph_capture_sizes=sizes,
                                                 max_cudagraph_capture_size=max(sizes))
    manager.cudagraph_mode = mode
    manager.max_num_reqs = max_num_reqs
    manager.decode_query_len = K_MAX + 1
    manager.varlen_decode = False
    manager.ubatch_runner = None
    manager.lora_capture_cases = [0]
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0
    manager._candidates, manager._capture_descs = {}, {}
    manager._init_candidates()
    manager._graphs_captured = True
    return manager


def ladder_for(sizes: list[int], schedule: ScheduleRanges, max_num_reqs: int,
               mode: CUDAGraphMode) -> GraphLadder:
    return ladder(sizes, schedule, max_num_reqs,
                  has_piecewise=mode == CUDAGraphMode.FULL_AND_PIECEWISE)


def as_choice(desc: object) -> GraphChoice:
    mode = desc.cg_mode.name  # type: ignore[attr-defined]
    return GraphChoice(mode, desc.num_tokens,  # type: ignore[attr-defined]
                       desc.num_reqs if mode == "FULL" else None)  # type: ignore[attr-defined]


def vllm_divergences(manager: CudaGraphManager, query_lens: tuple[int, ...],
                     max_num_reqs: int) -> list[tuple[int, int]]:
    """Where vLLM's drafter prefill picks another graph than its target: the target's call
    (``model_runner.py``) with ``max_query_len``, the drafter's (``speculator.py``) on the
    target's padded token count, without it."""
    found = []
    for q in query_lens:
        for r in range(1, max_num_reqs + 1):
            target = manager.dispatch(r, r * q, q, 0, max_query_len=q)
            drafter = manager.dispatch(r, max(r * q, target.num_tokens), q, 0)
            if drafter != target:
                found.append((q, r))
    return found


CASES = {
    "start-up schedule, 1024 requests": (startup_ranges(K_MAX, 1024), 1024),
    "start-up schedule, 256 requests": (startup_ranges(K_MAX, 256), 256),
    "start-up schedule, 64 requests": (startup_ranges(K_MAX, 64), 64),  # 256 decode tokens
    "K = 1 from 3 requests on": ([[1, 1, 3], [2, 2, 2], [3, 1024, 1]], 1024),
    "static, K = 3 then 0": ([[1, 16, 3], [17, 1024, 0]], 1024),
}


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL_AND_PIECEWISE,
                                  CUDAGraphMode.FULL_DECODE_ONLY])
@pytest.mark.parametrize("case", CASES)
def test_dispatch_is_vllms(case: str, mode: CUDAGraphMode) -> None:
    schedule, max_num_reqs = CASES[case]
    sizes = default_sizes(schedule, max_num_reqs)
    manager = vllm_manager(sizes, schedule, max_num_reqs, mode)
    ladder = ladder_for(sizes, schedule, max_num_reqs, mode)
    for q in ladder.query_lens:
        probes = {(r, tokens) for r in range(1, max_num_reqs + 1)
                  for tokens in (r * q, r * q + 1, ladder.dispatch(r, r * q, q).num_tokens)}
        probes |= {(min(max_num_reqs, max(1, tokens // q)), tokens)  # every size, any q
                   for tokens in range(1, max(sizes) + 2)}
        for r, tokens in probes:
            expected = as_choice(manager.dispatch(r, tokens, q, 0))
            assert ladder.dispatch(r, tokens, q) == expected, (q, r, tokens)
    assert ([(d.query_len, d.num_reqs) for d in divergent_batches(ladder)]
            == vllm_divergences(manager, ladder.query_lens, max_num_reqs))


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY,
                                  CUDAGraphMode.PIECEWISE])
@pytest.mark.parametrize("case", CASES)
def test_only_full_and_piecewise_graphs_diverge_in_vllm(case: str, mode: CUDAGraphMode) -> None:
    """Why ``graph_policy`` aligns FULL_AND_PIECEWISE only: with vLLM's sizes the other
    modes' drafter always replays the target's graph (or none), in vLLM's own dispatch."""
    schedule, max_num_reqs = CASES[case]
    manager = vllm_manager(default_sizes(schedule, max_num_reqs), schedule, max_num_reqs, mode)
    query_lens = query_lens_of(schedule)
    assert vllm_divergences(manager, query_lens, max_num_reqs) == []


def test_the_start_up_schedule_diverges_at_the_sizes_the_h200_crashed_near() -> None:
    """The project's start-up schedule on vLLM's sizes: K = 0 (query length 1) pinned with
    17 requests running, where bench.speculation's engine died twice, is a batch whose
    drafter replays a FULL graph of more requests than its target ran; K = 2 and 3 have
    none."""
    schedule, max_num_reqs = CASES["start-up schedule, 1024 requests"]
    sizes = default_sizes(schedule, max_num_reqs)
    ladder = ladder_for(sizes, schedule, max_num_reqs, CUDAGraphMode.FULL_AND_PIECEWISE)
    found = {(d.query_len, d.num_reqs): d for d in divergent_batches(ladder)}
    assert (1, 17) in found
    assert found[(1, 17)].target.mode == "PIECEWISE"
    assert found[(1, 17)].drafter.mode == "FULL"
    assert found[(1, 17)].drafter.num_reqs > 17
    assert {q for q, _ in found} <= {1, 2}


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 600), min_size=1, max_size=40),
       schedule=st.sampled_from(list(CASES)))
def test_aligned_sizes_never_diverge_in_vllm(sizes: list[int], schedule: str) -> None:
    """Checked with vLLM's own dispatch, not the model's."""
    ranges, max_num_reqs = CASES[schedule]
    query_lens = query_lens_of(ranges)
    aligned = aligned_capture_sizes(sizes, query_lens, max_num_tokens=8192)
    assert all(size % q == 0 for size in aligned for q in query_lens)
    assert max(aligned) >= min(max(sizes), 8192)
    manager = vllm_manager(aligned, ranges, max_num_reqs, CUDAGraphMode.FULL_AND_PIECEWISE)
    assert vllm_divergences(manager, query_lens, max_num_reqs) == []


def test_aligned_sizes_stay_within_the_batched_tokens() -> None:
    assert aligned_capture_sizes([1, 8, 100, 255, 500], (1, 2, 3, 4),
                                 max_num_tokens=256) == [12, 108, 252]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        aligned_capture_sizes([8], (3, 4), max_num_tokens=8)


def test_a_static_schedule_diverges_only_where_it_runs_the_query_length() -> None:
    """K = 1 from 32 requests on: its divergent batches at query length 2 start at 33, not
    at 9 and 21 (K = 3 runs there); the lookup is vLLM's own."""
    schedule = [[1, 1, 3], [2, 2, 2], [3, 31, 3], [32, 1024, 1]]
    ladder = ladder_for(default_sizes(schedule, 1024), schedule, 1024,
                        CUDAGraphMode.FULL_AND_PIECEWISE)
    lookup = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=1024,
                                              vllm_num_speculative_tokens=K_MAX)
    everywhere = [(d.query_len, d.num_reqs) for d in divergent_batches(ladder)]
    where_run = [(d.query_len, d.num_reqs)
                 for d in divergent_batches(ladder, [k + 1 for k in lookup])]
    assert (2, 9) in everywhere and (2, 33) in everywhere
    assert where_run == [(q, r) for q, r in everywhere if r >= 32 and q == 2]
    assert where_run[0] == (2, 33)
