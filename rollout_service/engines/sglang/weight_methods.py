"""The SGLang engine's weight loads: a push into the main model or the drafter, and the
checksums that show what loaded.

Runs in the service process, as a mixin of ``SGLangEngine`` (``engine.py``). Pushes go to
``/update_weights_from_tensor``; the model is picked by ``selector`` (0.5.23), else by
``disable_draft_model`` (0.5.10-0.5.12, whose draft path loads the drafter and then the
target from the same tensors); ``/begin_weight_update`` ... ``/end_weight_update`` wrap
the load where they exist (sgl-project/sglang ``python/sglang/srt/entrypoints/http_server.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from rollout_service.engines.base import LoadTimings, PushLoads, WeightUpdate
from rollout_service.engines.sglang.features import ServerFeatures
from rollout_service.engines.sglang.payload import PayloadBuilder, load_buckets

SelectorRole = Literal["target", "draft", "all"]
"""The models one load request goes to (SGLang 0.5.23's ``selector``)."""


class SGLangWeights:
    """Weight loads over the server's HTTP routes (a mixin: the engine holds ``features``,
    ``_build_payloads``, ``_num_tp_ranks``, ``_num_draft_tokens`` and ``_control``)."""

    features: ServerFeatures
    _build_payloads: PayloadBuilder
    _num_tp_ranks: int
    _num_draft_tokens: int
    _control: Callable[[str, Any], Awaitable[Any]]
    """POST a control call (the engine's): a refusal raises RuntimeError."""

    async def load_weights(self, update: WeightUpdate, *, version: str) -> PushLoads:
        """One request per bucket (``payload.load_buckets``: ``shm`` one, ``cuda_ipc`` one
        per export) in one session, to the models ``update.target`` names; every payload
        is built before the first is sent, and the main model's version goes with the
        last (none for a drafter-only push).

        A ``target: both`` push loads both models in one pass (``selector: all``;
        ``disable_draft_model: false`` on 0.5.10-0.5.12), timed as the main model's load:
        SGLang deserializes each request once and hands the tensors to every model it
        selects. So a payload is built and opened once per push. For ``shm`` that is one
        copy of the segment into torch's shared memory (the 1b push's 2.28 GB), not one per
        model. For ``cuda_ipc`` it is what frees the trainer's memory at all: torch's
        producer counter of an export is unsigned and must be returned exactly once; two
        opens, one per model, left it at -1, read as 2**64 - 1, and every in-place export
        stayed in the trainer's IPC limbo for good (a live 0.5.23 on an H100: 43 counters
        at -1, a whole checkpoint held per push), as ``engines/vllm/cuda_ipc_backend.py``
        found for vLLM."""
        start_s = time.perf_counter()
        route = "/update_weights_from_tensor"
        role: SelectorRole = {"main": "target", "draft": "draft", "both": "all"}[update.target]
        label = version if update.loads_main else None
        built = await asyncio.to_thread(self._payloads_per_bucket, update)
        await self._begin_session(role)
        try:
            for i, (payloads, _) in enumerate(built):
                # flush_cache False: the push manager's reset_prefix_cache flushes once.
                await self._control(route, {
                    "serialized_named_tensors": payloads, "load_format": "flattened_bucket",
                    "flush_cache": False,
                    "weight_version": label if i == len(built) - 1 else None,
                    **self._target(route, role)})
            loaded_s = time.perf_counter()
        finally:
            del built  # what kept shm payloads alive: SGLang has copied the tensors
            await self._end_session()  # a failed load leaves no session open
        timings = LoadTimings(load_s=loaded_s - start_s,
                              finalize_s=time.perf_counter() - loaded_s)
        return PushLoads(main=timings) if update.loads_main else PushLoads(draft=timings)

    def _payloads_per_bucket(self, update: WeightUpdate) -> list[tuple[list[str], Any]]:
        return [self._build_payloads(bucket, self._num_tp_ranks)
                for bucket in load_buckets(update)]

    async def _begin_session(self, role: SelectorRole) -> None:
        if self.features.has_weight_update_session:
            await self._control("/begin_weight_update", self._target("/begin_weight_update", role))

    async def _end_session(self) -> None:
        if self.features.has_weight_update_session:
            await self._control("/end_weight_update", {})

    def _target(self, route: str, role: SelectorRole) -> dict[str, Any]:
        """The field that picks the models on ``route``: ``selector`` (0.5.23), else
        ``disable_draft_model``, whose draft path loads the drafter and then the target
        (0.5.10-0.5.12: ``all`` and ``draft`` alike)."""
        if self.features.accepts(route, "selector"):
            return {"selector": role}
        if self.features.accepts(route, "disable_draft_model"):
            return {"disable_draft_model": role == "target"}
        if role != "target":
            raise NotImplementedError(f"this SGLang server's {route} cannot target the drafter "
                                      "(no 'selector' field); use SGLang 0.5.23 or later")
        return {}

    async def reset_prefix_cache(self) -> bool:
        await self._control("/flush_cache", None)
        return True

    async def weight_checksums(self) -> dict[str, str]:
        """SGLang's per-engine checksum per model where ``/weights_checker`` can target one
        (0.5.23: SHA-256 over each rank's digest of its own, post-load parameter layout, so
        it is comparable only with itself); {} on servers without it."""
        route = "/weights_checker"
        if route not in self.features.routes or not self.features.accepts(route, "selector"):
            return {}
        roles = {"main": "target", **({"draft": "draft"} if self._num_draft_tokens else {})}
        checksums = {}
        for role, selector in roles.items():
            result = await self._control(route, {"action": "checksum", "selector": selector})
            checksums[role] = result["per_engine_checksum"]
        return checksums
