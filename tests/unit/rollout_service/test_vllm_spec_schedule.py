"""The K schedule as vLLM takes it: the table -> ranges conversion read back through vLLM's
own lookup builder, the start-up schedule, and the engine-core patch's refusals (the CUDA
graph policy: test_vllm_graph_policy.py).

The running engine is in tests/integration/rollout_service/test_speculation_control.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.engine.core import EngineCore
from vllm.v1.spec_decode.dynamic import utils as vllm_dynamic_sd

from rollout_service.engines.vllm.patches import spec_schedule as patch
from rollout_service.engines.vllm.spec_schedule import (
    check_schedule,
    lookup_to_schedule,
    schedule_to_ranges,
    startup_ranges,
)
from rollout_service.speculation.controller import k_at

MAX_NUM_SEQS = 64


def vllm_lookup(ranges: list[list[int]], k_max: int, max_num_seqs: int = MAX_NUM_SEQS
                ) -> list[int]:
    """K per batch size 1..max_num_seqs, as vLLM's scheduler would read it."""
    return vllm_dynamic_sd.build_dynamic_sd_schedule_lookup(
        ranges, vllm_max_batch_size=max_num_seqs, vllm_num_speculative_tokens=k_max)[1:]


def test_table_becomes_ranges_from_one_with_equal_neighbours_merged() -> None:
    assert schedule_to_ranges({4: 2, 16: 1, 64: 1, 256: 0}) == \
        [[1, 4, 2], [5, 64, 1], [65, 256, 0]]
    assert schedule_to_ranges({8: 3}) == [[1, 8, 3]]


tables = st.dictionaries(st.integers(1, 2 * MAX_NUM_SEQS), st.integers(0, 3), min_size=1,
                         max_size=8)


@settings(max_examples=200, deadline=None)
@given(tables)
def test_vllm_runs_the_tables_k_at_every_batch_size(table: dict[int, int]) -> None:
    """Whatever the edges (past vLLM's max_num_seqs too), vLLM's lookup from the ranges
    gives every batch size the K the controller's reading of the table gives it."""
    lookup = vllm_lookup(schedule_to_ranges(table), k_max=3)
    assert lookup == [k_at(table, b) for b in range(1, MAX_NUM_SEQS + 1)]
    assert all(k_at(lookup_to_schedule(lookup), b) == k for b, k in enumerate(lookup, 1))


def test_the_lookup_read_back_is_the_smallest_table() -> None:
    assert lookup_to_schedule([2, 2, 1, 1, 1, 0]) == {2: 2, 5: 1, 6: 0}
    assert lookup_to_schedule([0, 0, 0]) == {3: 0}


@pytest.mark.parametrize("table, message", [
    ({}, "empty"),
    ({0: 1}, "batch size 0 must be an integer >= 1"),
    ({True: 1}, "batch size True"),
    ({4: -1}, "K -1 at batch size 4"),
    ({4: 1.0}, "K 1.0 at batch size 4"),
])
def test_malformed_tables_are_refused_naming_the_entry(table: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_schedule(table)
    with pytest.raises(ValueError, match=message):
        schedule_to_ranges(table)


@pytest.mark.parametrize("k_max, max_num_seqs", [(1, 2), (2, 3), (2, 128), (3, 256), (3, 512)])
def test_the_startup_schedule_runs_every_k_rising_to_k_max_at_the_widest_batch(
        k_max: int, max_num_seqs: int) -> None:
    lookup = vllm_lookup(startup_ranges(k_max, max_num_seqs), k_max, max_num_seqs)
    assert set(lookup) == set(range(k_max + 1))
    assert lookup == sorted(lookup) and lookup[-1] == k_max
    # K = k_max holds the widest tier: the capture sizes reach the ceiling for every K.
    assert lookup.count(k_max) == max(lookup.count(k) for k in range(k_max + 1))


def test_the_startup_schedule_needs_room_for_every_k() -> None:
    with pytest.raises(ValueError, match="max_batch_size > k_max"):
        startup_ranges(2, 2)


# ---- the engine-core patch -------------------------------------------------------------

def fake_core(k_max: int = 2, max_num_seqs: int = 8, *, has_lookup: bool = True
              ) -> SimpleNamespace:
    """A fake of vLLM's EngineCore holding only what the patch reads: a scheduler with its
    lookup (building a real scheduler needs a model and its KV cache)."""
    lookup = [0] + [k_max] * max_num_seqs if has_lookup else None
    scheduler = SimpleNamespace(dynamic_sd_lookup=lookup, num_spec_tokens=k_max,
                                scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))
    return SimpleNamespace(scheduler=scheduler)


def test_set_swaps_the_lookup_the_scheduler_reads() -> None:
    core = fake_core()
    assert patch.set_spec_schedule(core, [[1, 2, 0], [3, 8, 1]]) == [0, 0, 1, 1, 1, 1, 1, 1]
    assert core.scheduler.dynamic_sd_lookup == [0, 0, 0, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("ranges, message", [
    ([[1, 8, 3]], "K=3 in range \\[1, 8\\] exceeds the engine's num_speculative_tokens=2"),
    ([[1, 8, "1"]], "integers"),
    ([[1, 8, 1.5]], "integers"),
    ([[1, 8, True]], "integers"),
    ([[1, 8]], "\\[start, end, K\\]"),
    ([], "non-empty"),
    ([[2, 8, 1]], "must start at 1"),  # vLLM's own validator
    ([[1, 4, 1], [3, 8, 0]], "non-overlapping"),
])
def test_bad_ranges_are_refused_and_the_lookup_stays(ranges: list, message: str) -> None:
    core = fake_core()
    before = core.scheduler.dynamic_sd_lookup
    with pytest.raises(ValueError, match=message):
        patch.set_spec_schedule(core, ranges)
    assert core.scheduler.dynamic_sd_lookup is before


def test_an_engine_started_without_a_schedule_cannot_change_k() -> None:
    with pytest.raises(RuntimeError, match="started without speculative_config"):
        patch.set_spec_schedule(fake_core(has_lookup=False), [[1, 8, 1]])


@pytest.fixture
def bare_engine_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's EngineCore without the patch's methods for the test (put back after)."""
    for name in (patch.SET_METHOD, patch.GET_METHOD):
        monkeypatch.delattr(EngineCore, name, raising=False)


def test_the_patch_adds_both_methods_once(bare_engine_core: None) -> None:
    assert patch.apply() and patch.apply()  # idempotent
    assert getattr(EngineCore, patch.SET_METHOD) is patch._rollout_set_spec_schedule
    assert getattr(EngineCore, patch.GET_METHOD) is patch._rollout_get_spec_schedule


def test_other_vllm_versions_get_nothing(bare_engine_core: None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert not patch.apply()
    assert not hasattr(EngineCore, patch.SET_METHOD)


def test_a_changed_lookup_builder_fails_loudly(bare_engine_core: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def build_dynamic_sd_schedule_lookup(schedule: object, max_batch_size: int) -> list[int]:
        return []

    monkeypatch.setattr(vllm_dynamic_sd, "build_dynamic_sd_schedule_lookup",
                        build_dynamic_sd_schedule_lookup)
    with pytest.raises(RuntimeError, match="build_dynamic_sd_schedule_lookup has parameters"):
        patch.apply()
    assert not hasattr(EngineCore, patch.SET_METHOD)


def test_a_foreign_method_of_the_same_name_is_not_replaced(
        bare_engine_core: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EngineCore, patch.SET_METHOD, lambda self, ranges: None, raising=False)
    with pytest.raises(RuntimeError, match="already has a rollout_set_spec_schedule"):
        patch.apply()


def test_the_controlled_engine_reports_each_steps_counts() -> None:
    """The acceptance per position needs each verify step's K, which vLLM's histogram of
    k_max + 1 buckets does not give: the controlled engine asks for the per-step counts."""
    from rollout_service.config import EMBEDDED_ENGINE_KWARGS
    from rollout_service.embedded import ensure_model
    from rollout_service.engines.speculative import MTPSettings, load_checkpoint_config
    from rollout_service.engines.vllm.engine_args import build_engine_args
    from rollout_service.engines.vllm.spec_schedule import with_startup_schedule

    model = str(ensure_model("tiny"))
    args = build_engine_args(model, EMBEDDED_ENGINE_KWARGS, MTPSettings(num_speculative_tokens=2),
                             load_checkpoint_config(model))
    assert args.per_request_spec_decode_metrics == "summary"  # the service's default
    controlled = with_startup_schedule(args)
    assert controlled.per_request_spec_decode_metrics == "detailed"
    config = controlled.create_engine_config()
    assert config.observability_config.per_request_spec_decode_metrics == "detailed"
