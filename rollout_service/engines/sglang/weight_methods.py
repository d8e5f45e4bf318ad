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
from typing import Any

from rollout_service.engines.base import LoadTimings, WeightUpdate
from rollout_service.engines.sglang.features import ServerFeatures
from rollout_service.engines.sglang.payload import PayloadBuilder, load_buckets


class SGLangWeights:
    """Weight loads over the server's HTTP routes (a mixin: the engine holds ``features``,
    ``_build_payloads``, ``_num_tp_ranks``, ``_num_draft_tokens`` and ``_control``)."""

    features: ServerFeatures
    _build_payloads: PayloadBuilder
    _num_tp_ranks: int
    _num_draft_tokens: int
    _control: Callable[[str, Any], Awaitable[Any]]
    """POST a control call (the engine's): a refusal raises RuntimeError."""
    _built_for_drafter: tuple[str, list[tuple[list[str], Any]]] | None = None
    """A ``target: both`` push's payloads, kept from the main model's load for the
    drafter's, which the push manager makes next (push id, payloads)."""

    async def load_weights(self, update: WeightUpdate, *, draft: bool,
                           version: str | None) -> LoadTimings:
        """One request per bucket (``payload.load_buckets``: ``shm`` one, ``cuda_ipc`` one
        per export) in one session; every payload is built before the first is sent, and
        the version goes with the last.

        Both models load from the same tensors, so a ``target: both`` push builds its
        payloads once: for ``shm`` building is a copy of the whole segment into torch's
        shared memory (the 1b push's 2.28 GB), and SGLang's workers map that copy for the
        drafter as they did for the main model. The copy lives until the drafter's load
        ends (one copy at a time, as before)."""
        start_s = time.perf_counter()
        route = "/update_weights_from_tensor"
        kept, self._built_for_drafter = self._built_for_drafter, None
        if draft and kept is not None and kept[0] == update.push_id:
            built = kept[1]
        else:
            built = await asyncio.to_thread(self._payloads_per_bucket, update)
        del kept
        target = self._target(route, draft)
        await self._begin_session(draft)
        try:
            for i, (payloads, _) in enumerate(built):
                # flush_cache False: reset_prefix_cache flushes once, after both models load.
                await self._control(route, {
                    "serialized_named_tensors": payloads, "load_format": "flattened_bucket",
                    "flush_cache": False,
                    "weight_version": version if i == len(built) - 1 else None, **target})
            loaded_s = time.perf_counter()
            for_drafter = built if not draft and update.target == "both" else None
        finally:
            del built  # what kept shm payloads alive: SGLang has copied the tensors
            await self._end_session()  # a failed load leaves no session open
        if for_drafter is not None:  # kept only once the main model's load has succeeded
            self._built_for_drafter = (update.push_id, for_drafter)
        return LoadTimings(load_s=loaded_s - start_s, finalize_s=time.perf_counter() - loaded_s)

    def _payloads_per_bucket(self, update: WeightUpdate) -> list[tuple[list[str], Any]]:
        return [self._build_payloads(bucket, self._num_tp_ranks)
                for bucket in load_buckets(update)]

    async def _begin_session(self, draft: bool) -> None:
        if self.features.has_weight_update_session:
            await self._control("/begin_weight_update", self._target("/begin_weight_update", draft))

    async def _end_session(self) -> None:
        if self.features.has_weight_update_session:
            await self._control("/end_weight_update", {})

    def _target(self, route: str, draft: bool) -> dict[str, Any]:
        """The field that picks the main model or the drafter on ``route``."""
        if self.features.accepts(route, "selector"):
            return {"selector": "draft" if draft else "target"}
        if self.features.accepts(route, "disable_draft_model"):
            return {"disable_draft_model": not draft}
        if draft:
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
