"""Methods mixed into vLLM's worker processes (``worker_extension_cls``).

The service process calls them through ``AsyncLLM.collective_rpc``; they run in
every worker and read the worker's own models. Checks, measurements, the ``nccl``
transport's group and broadcast (which fill a buffer of the worker's own, never a
parameter) and the opt-in drafter skip at K = 0 (``drafter_at_k0.py``): nothing in this
module changes a weight.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from rollout_service.engines.vllm.verify_cost import measure_verify_cost


class RolloutWorkerExtension:
    """Parameter checksums of the main model and the drafter (``GET /weights/checksums``,
    every worker its own shard), the measured cost of a verify step (``verify_cost.py``),
    and the ``nccl`` transport's group and buckets (``broadcast_backend.py``; each call
    returns at once, the work runs on threads of the backend and these report its
    state)."""

    def rollout_group_join(self, spec: dict[str, Any]) -> None:
        """Join the trainer's group at the server's ``rank_offset`` plus this worker's
        rank; the first worker writes the server's stored copy of each push."""
        rank = int(self.rank)  # type: ignore[attr-defined]
        self._broadcast().join_group(spec, rank=spec["rank_offset"] + rank,
                                     is_writer=rank == 0)

    def rollout_group_state(self, group_id: str) -> str:
        return self._broadcast().group_state(group_id)

    def rollout_group_leave(self) -> None:
        self._broadcast().leave_group()

    def rollout_bucket_start(self, receive: dict[str, Any], bucket: dict[str, Any]) -> None:
        self._broadcast().start_bucket(receive, bucket)

    def rollout_bucket_state(self, push_id: str, index: int) -> str:
        return self._broadcast().bucket_state(push_id, index)

    def rollout_receive_report(self, push_id: str, num_buckets: int) -> dict[str, Any]:
        return self._broadcast().receive_report(push_id, num_buckets)

    def _broadcast(self) -> Any:
        from rollout_service.engines.vllm.broadcast_backend import (
            BroadcastWeightTransferEngine,
        )

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, BroadcastWeightTransferEngine):
            raise RuntimeError("this engine was not started with weights_transport 'nccl'")
        return engine

    def rollout_skip_drafter_at_k0(self) -> str:
        """``speculation_control.drafter_at_k0: skip`` on this worker (``drafter_at_k0.py``);
        returns the speculator's class name."""
        from rollout_service.engines.vllm.drafter_at_k0 import skip_drafter_at_k0

        return skip_drafter_at_k0(self.model_runner)  # type: ignore[attr-defined]

    def rollout_verify_cost(self, batch_size: int, num_speculative_tokens: int,
                          repeats: int) -> dict[str, float] | None:
        """A verify step's time over a plain decode step's, measured on this worker's
        model runner (``verify_cost.measure_verify_cost``); None when not measurable."""
        return measure_verify_cost(self.model_runner,  # type: ignore[attr-defined]
                                 batch_size=batch_size,
                                 num_speculative_tokens=num_speculative_tokens,
                                 repeats=repeats)

    def rollout_weight_checksums(self) -> dict[str, str]:
        """SHA-256 over the main model's parameters and over the drafter's own ones.

        vLLM shares the embedding and the head between an MTP drafter and its
        target; those count as the main model's, so the drafter digest moves only
        when a drafter-only tensor (the MTP layers) changes. Tests compare these
        before and after a rejected push: they must not move.
        """
        main = self.get_model()  # type: ignore[attr-defined]
        draft = self.get_draft_model()  # type: ignore[attr-defined]
        main_storage = {p.untyped_storage().data_ptr() for p in main.parameters()}
        digests = {"main": _digest(main.named_parameters())}
        if draft is not None:
            digests["draft"] = _digest(
                (name, p) for name, p in draft.named_parameters()
                if p.untyped_storage().data_ptr() not in main_storage)
        return digests


def _digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(named, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8)
                      .numpy().tobytes())
    return digest.hexdigest()


def combined_checksums(per_rank: list[dict[str, str]]) -> dict[str, str]:
    """Every worker's digests (``rollout_weight_checksums``, in rank order) as one map:
    ``main`` and ``draft`` over all ranks (a digest of the ranks' digests, so a shard
    that differs on any rank moves it), and each rank's own as ``main/rank<i>``."""
    combined: dict[str, str] = {}
    for role in sorted({role for digests in per_rank for role in digests}):
        digest = hashlib.sha256()
        for rank, digests in enumerate(per_rank):
            digest.update(f"{rank}:{digests.get(role, '')};".encode())
            combined[f"{role}/rank{rank}"] = digests.get(role, "")
        combined[role] = per_rank[0][role] if len(per_rank) == 1 else digest.hexdigest()
    return combined
