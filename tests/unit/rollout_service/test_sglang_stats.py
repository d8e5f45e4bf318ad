"""SGLang engine against the FAKE SGLang server (``fake_sglang``): each request's
speculative-decoding stats and weight-version spans. SGLang cannot serve here.

Everything below runs against the fake, in this process, over httpx's ASGI transport;
nothing here has run against a live SGLang server. SGLang reports a request's drafts in
``meta_info`` under names that changed across 0.5.10, 0.5.11, 0.5.12 and 0.5.23; these
tests read each generation's names into the one ``SpecDecodeStats``, and tell stats that
are missing (no speculation, or only the prefill's token) from stats that contradict
themselves (``InvalidSpecDecodeStats``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from rollout_service.engines.sglang.stats import spec_stats_from_meta_info
from rollout_service.protocol.acceptance import InvalidSpecDecodeStats, SpecDecodeStats
from tests.support.fake_sglang import FakeSGLang
from tests.support.sglang_on_fake import VERSIONS, connect, greedy, make_fake


async def test_no_speculation_reports_zero_tokens_and_no_stats(checkpoint: str) -> None:
    engine = await connect(FakeSGLang("0.5.23", model_path=checkpoint))
    assert engine.info.num_speculative_tokens == 0
    assert engine.info.speculative_method is None and not engine.info.has_pushable_drafter
    result = await engine.generate([1, 2], greedy(8), "r0")
    assert result.spec_decode is None


# --- acceptance stats ---

# One request's counts as each SGLang generation names them: 4 verify steps accepting
# 2, 2, 2 and 1 tokens of 3 proposed each (12 completion tokens, the first from prefill).
META_INFO_BY_VERSION = {
    "0.5.10": {"spec_accept_token_num": 7, "spec_draft_token_num": 12,
               "spec_accept_histogram": [0, 1, 3]},
    "0.5.11": {"spec_accepted_drafts": 7, "spec_proposed_drafts": 12,
               "spec_accept_histogram": [0, 1, 3]},
    "0.5.12": {"spec_num_correct_drafts": 7, "spec_num_proposed_drafts": 12,
               "spec_accepted_drafts": 7, "spec_proposed_drafts": 12,
               "spec_correct_drafts_histogram": [0, 1, 3]},
    "0.5.23": {"spec_num_correct_drafts": 7, "spec_num_proposed_drafts": 12,
               "spec_correct_drafts_histogram": [0, 1, 3]},
}
EXPECTED_STATS = SpecDecodeStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7,
                                 num_verify_steps=4, accepted_per_position=(4, 3))


@pytest.mark.parametrize("version", VERSIONS)
def test_stats_from_each_meta_info_generation(version: str) -> None:
    meta = {**META_INFO_BY_VERSION[version], "spec_verify_ct": 4, "completion_tokens": 12,
            "spec_accept_rate": 7 / 12, "spec_accept_length": 3.0}
    assert spec_stats_from_meta_info(meta, num_draft_tokens=4) == EXPECTED_STATS


@pytest.mark.parametrize("version", VERSIONS)
async def test_stats_end_to_end(version: str, checkpoint: str) -> None:
    fake = make_fake(version, checkpoint)
    fake.model.accept_per_step = 2
    engine = await connect(fake)
    result = await engine.generate([1], greedy(12), "spec")
    assert len(result.token_ids) == 12
    # 4 steps of 2 accepted drafts: the last one's run is counted whole although
    # max_tokens keeps 1 of its 2 tokens, as a live SGLang 0.5.23 counts it
    # (test_sglang_live.py). No step accepted all 3 drafts, so the histogram stops at 2:
    # position 3 is 0.
    assert result.spec_decode == replace(EXPECTED_STATS, num_accepted_tokens=8,
                                         accepted_per_position=(4, 4, 0))
    assert result.spec_decode.accept_length == 1 + 8 / 4


def test_a_short_histogram_is_padded_to_the_servers_steps() -> None:
    """SGLang grows a request's histogram only as far as its steps accepted."""
    meta = {"spec_verify_ct": 4, "spec_num_correct_drafts": 2, "spec_num_proposed_drafts": 12,
            "spec_correct_drafts_histogram": [2, 2], "completion_tokens": 7}
    assert spec_stats_from_meta_info(meta, 4, num_positions=3).accepted_per_position == \
        (2, 0, 0)
    assert spec_stats_from_meta_info(meta, 4).accepted_per_position == (2,)
    longer = {**meta, "spec_num_correct_drafts": 6, "spec_correct_drafts_histogram": [0, 2, 2]}
    assert spec_stats_from_meta_info(longer, 4, num_positions=1).accepted_per_position == ()


def test_proposed_derived_when_absent() -> None:
    meta = {"spec_verify_ct": 4, "spec_num_correct_drafts": 7, "completion_tokens": 12}
    stats = spec_stats_from_meta_info(meta, num_draft_tokens=4)
    assert (stats.num_draft_tokens, stats.accepted_per_position) == (12, ())


def test_missing_stats() -> None:
    assert spec_stats_from_meta_info({"completion_tokens": 9}, num_draft_tokens=4) is None
    assert spec_stats_from_meta_info({"completion_tokens": 1}, num_draft_tokens=0) is None
    # With speculation on, one token came from prefill: no verify step, nothing drafted.
    only_prefill = spec_stats_from_meta_info({"completion_tokens": 1}, num_draft_tokens=4)
    assert only_prefill == SpecDecodeStats(num_drafts=0, num_draft_tokens=0,
                                           num_accepted_tokens=0, num_verify_steps=0)
    assert only_prefill.accept_length == 1.0 and only_prefill.accept_rate is None


def test_inconsistent_counts() -> None:
    bad_histogram = {"spec_verify_ct": 4, "spec_num_correct_drafts": 7,
                     "spec_num_proposed_drafts": 12, "spec_correct_drafts_histogram": [3, 1]}
    assert spec_stats_from_meta_info(bad_histogram, 4).accepted_per_position == ()
    too_many = {"spec_verify_ct": 1, "spec_num_correct_drafts": 5, "spec_num_proposed_drafts": 3}
    # Dropped from every figure as before, and now told apart from missing stats (the
    # exporter counts it as invalid and warns once; vLLM's contradictions go the same way).
    invalid = spec_stats_from_meta_info(too_many, 4)
    assert isinstance(invalid, InvalidSpecDecodeStats)
    assert "num_accepted_tokens > num_draft_tokens" in invalid.detail
    assert "spec_num_correct_drafts" in invalid.detail


async def test_missing_stats_end_to_end(checkpoint: str) -> None:
    fake = make_fake("0.5.23", checkpoint)
    engine = await connect(fake)
    one = await engine.generate([1], greedy(1), "one-token")
    assert one.spec_decode is not None and one.spec_decode.num_verify_steps == 0
    fake.is_reporting_spec = False
    assert (await engine.generate([1], greedy(5), "silent")).spec_decode is None


# --- weight versions ---


@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
async def test_weight_version_span(version: str, checkpoint: str) -> None:
    fake = make_fake(version, checkpoint)
    engine = await connect(fake)
    fake.weight_version = "7"
    result = await engine.generate([1], greedy(3), "versioned")
    [span] = result.weight_versions
