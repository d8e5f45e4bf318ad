"""Per-request acceptance counts from the ``meta_info`` of SGLang's ``/generate`` responses.

Runs in the rollout service process, on each response the engine receives over HTTP.
Three generations of SGLang name the counts differently:

==========  =======================  ========================  =============================
SGLang      accepted                 proposed                  per-step histogram
==========  =======================  ========================  =============================
<= 0.5.10   spec_accept_token_num    spec_draft_token_num      spec_accept_histogram
0.5.11      spec_accepted_drafts     spec_proposed_drafts      spec_accept_histogram
>= 0.5.12   spec_num_correct_drafts  spec_num_proposed_drafts  spec_correct_drafts_histogram
==========  =======================  ========================  =============================

``spec_verify_ct`` (verify steps) is stable; 0.5.12 also repeats the 0.5.11 names. SGLang
sets these keys only for a request with at least one verify step. They map onto
:class:`~rollout_service.protocol.acceptance.SpecDecodeStats` with vLLM's definitions:
``num_verify_steps = num_drafts = spec_verify_ct`` (SGLang drafts in every verify step),
``num_draft_tokens`` = SGLang's proposed count (``verify_ct * (speculative_num_draft_tokens
- 1)``, derived that way when the key is absent), ``num_accepted_tokens`` = SGLang's
accepted drafts, ``accepted_per_position`` from the histogram (``h[j]``: steps accepting j).
SGLang grows a request's histogram only up to the most drafts one of its steps accepted
(``Req.update_spec_correct_drafts_histogram``), so a request that never had all k
accepted has a shorter one; its missing positions are zeros, filled in up to the
server's ``speculative_num_steps`` (the positions a step can accept).

SGLang's "proposed" equals vLLM's "draft tokens" only for a chain (``speculative_eagle_topk``
1: k tokens per step). With topk > 1 SGLang verifies a tree and counts every non-root node
it verified (``speculative_num_draft_tokens - 1`` per step), although at most
``speculative_num_steps`` can be accepted: the exported accept rate is accepted / tree
tokens (lower than a chain's at the same accept length); accept length compares across
both. SGLang's own ``spec_accept_length`` (completion tokens / verify steps, prefill token
included) is not used. A request without the keys gets None (counted as missing), except
that with speculation on a request of <= 1 completion token never reached a verify step
and gets zero counts (accept length 1.0). Counts that contradict themselves (more accepted
than proposed) are :class:`~rollout_service.protocol.acceptance.InvalidSpecDecodeStats`,
counted and warned about once by the exporter, as vLLM's are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_service.protocol.acceptance import InvalidSpecDecodeStats, SpecDecodeStats

SPEC_KEY_GENERATIONS = (
    ("spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_correct_drafts_histogram"),
    ("spec_accepted_drafts", "spec_proposed_drafts", "spec_accept_histogram"),
    ("spec_accept_token_num", "spec_draft_token_num", "spec_accept_histogram"),
)
"""``(accepted, proposed, histogram)`` meta_info keys of each generation, newest first."""


def spec_stats_from_meta_info(meta_info: Mapping[str, Any], num_draft_tokens: int,
                              num_positions: int | None = None
                              ) -> SpecDecodeStats | InvalidSpecDecodeStats | None:
    """SGLang's per-request counts as :class:`SpecDecodeStats` (see the module docstring).

    Args:
        meta_info: a ``/generate`` response's ``meta_info``.
        num_draft_tokens: the server's ``speculative_num_draft_tokens``; 0 when
            speculative decoding is off.
        num_positions: the server's ``speculative_num_steps``: the per-position counts are
            padded with zeros to this length (a histogram longer than it is inconsistent);
            None: as long as the histogram says.

    Returns:
        The counts; None when the response carries none; invalid when they contradict
        themselves (a histogram that disagrees with the totals only loses the per-position
        counts).
    """
    verify_ct = meta_info.get("spec_verify_ct")
    keys = next((k for k in SPEC_KEY_GENERATIONS if k[0] in meta_info), None)
    if verify_ct is None or keys is None:
        if num_draft_tokens and meta_info.get("completion_tokens", 2) <= 1:
            return SpecDecodeStats(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                                   num_verify_steps=0)
        return None
    accepted_key, proposed_key, histogram_key = keys
    accepted = meta_info[accepted_key]
    proposed = meta_info.get(proposed_key)
    if proposed is None:
        proposed = verify_ct * (num_draft_tokens - 1)
    histogram = meta_info.get(histogram_key) or []
    per_position: tuple[int, ...] = ()
    is_consistent = (sum(histogram) == verify_ct
                     and sum(j * n for j, n in enumerate(histogram)) == accepted
                     and (num_positions is None or len(histogram) <= num_positions + 1))
    if is_consistent:
        num = len(histogram) - 1 if num_positions is None else num_positions
        per_position = tuple(sum(histogram[i + 1:]) for i in range(num))
    try:
        return SpecDecodeStats(num_drafts=verify_ct, num_draft_tokens=proposed,
                               num_accepted_tokens=accepted, num_verify_steps=verify_ct,
                               accepted_per_position=per_position)
    except ValueError as exc:
        counts = {k: meta_info.get(k) for k in ("spec_verify_ct", *keys)}
        return InvalidSpecDecodeStats(detail=f"SGLang meta_info {counts}: {exc}")
