"""TEST-ONLY vLLM worker extension that records every draft token the MTP drafter proposes.

Runs inside vLLM's worker process (``worker_extension_cls``); the test talks to it through
``LLM.collective_rpc``. vLLM exposes drafts only as acceptance counters, never the drafted
tokens themselves, and the parity test (``test_parity_vllm.py``) must compare the tokens
the drafter really proposed with Megatron's MTP argmax. So this wraps the proposer's
``propose`` on the worker's instance (not the class, and only in the test's own engine:
production code never imports this module) and logs, per request and step, the drafter
slot it sampled from and what it proposed.

What a record means (vLLM 0.32 ``SpecDecodeBaseProposer.propose``, default EAGLE path):
the drafter's input at slot ``p`` is the target's hidden state at position ``p`` and the
token at position ``p + 1`` (the input ids shifted left by one, the newly sampled token at
the sampled slot), so a draft sampled from slot ``p`` predicts the token at ``p + 2``.
"""

from __future__ import annotations

from typing import Any

import torch


class DraftRecorderExtension:
    """Mixed into vLLM's worker; call the methods with ``LLM.collective_rpc``."""

    def start_recording_drafts(self) -> None:
        """Wrap this worker's drafter so each ``propose`` call is logged."""
        worker: Any = self
        drafter = worker.model_runner.drafter
        if getattr(drafter, "_recorded_drafts", None) is not None:
            drafter._recorded_drafts.clear()
            return
        records: list[tuple[str, int, int, int]] = []
        original = drafter.propose
        runner = worker.model_runner

        def propose(*args: Any, **kwargs: Any) -> torch.Tensor:
            if args:
                raise RuntimeError("draft recorder: propose called positionally; vLLM's "
                                   "call changed, update the recorder")
            cad = kwargs["common_attn_metadata"]
            indices = kwargs["token_indices_to_sample"]
            if indices is None:  # what set_inputs_first_pass uses then
                indices = cad.query_start_loc[1:] - 1
            slots = kwargs["target_positions"][indices].tolist()
            next_ids = kwargs["next_token_ids"].tolist()
            req_ids = list(runner.input_batch.req_ids)
            drafts = original(*args, **kwargs)
            first = drafts[:, 0].tolist()
            records.extend(zip(req_ids, slots, next_ids, first, strict=True))
            return drafts

        drafter.propose = propose
        drafter._recorded_drafts = records

    def recorded_drafts(self) -> list[tuple[str, int, int, int]]:
        """``(request id, slot p, token at p + 1, draft for p + 2)`` per proposal, in order."""
        worker: Any = self
        return list(worker.model_runner.drafter._recorded_drafts)
