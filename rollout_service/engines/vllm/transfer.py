"""The ``update_info`` of this project's vLLM weight-transfer backends, and how they load.

Built in the service process (:func:`update_info`, JSON-safe: vLLM ships it to
its workers over its RPC) and parsed in each worker by the backend
(:class:`PushUpdateInfo`), back into the very
:class:`~rollout_service.protocol.placement.TensorPlacement` values the trainer
sent. Both backends, ``shm`` and ``cuda_ipc``, take the same update info and
load the same two ways (:class:`LoadSession`):

- ``reload``: vLLM's layerwise reload around the model's own ``load_weights``.
  Needed where vLLM transforms weights after loading them (its CPU build
  repacks every linear weight; quantized checkpoints).
- ``in_place``: the model's ``load_weights`` alone, which copies each tensor into
  the existing parameter (fused QKV and gate-up shards placed by vLLM's own
  weight loaders). Unquantized weights on CUDA are used as loaded, so this skips
  the reload's re-initialisation and post-processing of every layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter
from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo

from rollout_service.engines.base import WeightUpdate
from rollout_service.protocol.cuda_ipc import CudaIpcHandle
from rollout_service.protocol.placement import CudaIpcLocation, TensorPlacement, Transport
from rollout_service.protocol.store import BucketInfo, StoreRef

_PLACEMENTS = TypeAdapter(list[TensorPlacement])


@dataclass
class PushUpdateInfo(WeightTransferUpdateInfo):
    """One model's load of one push (validated on construction, in the worker)."""

    push_id: str
    """The push: a backend may keep what it opened for the next load of the same push."""
    transport: Transport
    """The transport of every placement; a backend refuses another."""
    tensors: list[Any]
    """``TensorPlacement`` per tensor: dicts on the wire, parsed in ``__post_init__``."""
    is_last_load: bool = True
    """Release what this push opened after this load (main then drafter: the drafter's)."""
    in_place: bool = False
    """Copy into the existing parameters instead of a layerwise reload (module docstring);
    the service sets it only where the engine's weights are used as loaded."""
    cuda_ipc_buffer: dict[str, Any] | None = None
    """``cuda_ipc``: the push's staging buffer (a ``CudaIpcHandle`` as a dict), sent once
    per load instead of once per tensor; parsed in ``__post_init__``."""
    store: dict[str, Any] | None = None
    """``nccl``: the server's received copy (a ``StoreRef`` as a dict: path and buckets);
    parsed in ``__post_init__``."""
    placements: list[TensorPlacement] = field(init=False, repr=False)
    staging_buffer: CudaIpcHandle | None = field(init=False, repr=False)
    store_ref: StoreRef | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.placements = _PLACEMENTS.validate_python(self.tensors)
        self.staging_buffer = (None if self.cuda_ipc_buffer is None
                               else CudaIpcHandle.model_validate(self.cuda_ipc_buffer))
        self.store_ref = None if self.store is None else StoreRef(
            path=str(self.store["path"]),
            buckets=tuple(BucketInfo.model_validate(b) for b in self.store["buckets"]))
        wrong = next((p for p in self.placements if p.transport != self.transport), None)
        if wrong is not None:
            raise ValueError(f"tensors: {wrong.name!r} lies in {wrong.transport!r}, the update "
                             f"is {self.transport!r}")
        unplaced = next((p for p in self.placements if isinstance(p.location, CudaIpcLocation)
                         and p.location.handle is None and self.staging_buffer is None), None)
        if unplaced is not None:
            raise ValueError(f"tensors: {unplaced.name!r} has no handle and the update no "
                             "cuda_ipc_buffer")

    def check_transport(self, transport: Transport) -> None:
        """Raises ValueError unless this update is for ``transport`` (the backend's)."""
        if self.transport != transport:
            raise ValueError(f"transport: this engine loads {transport!r} pushes, the update "
                             f"is {self.transport!r}")


def update_info(update: WeightUpdate, *, draft: bool, in_place: bool = False
                ) -> dict[str, Any]:
    """``update_info`` for ``LLM.update_weights`` of one model's load of ``update``.

    The main model and the drafter get the same placements: the same segment
    offsets, or the same CUDA IPC handles (opened once in the worker for both). vLLM
    loads them in two sessions, main model first, so the drafter's load (or the main
    model's, in a main-only push) is the last, after which the worker releases what
    the push opened.
    """
    is_last_load = draft or update.target == "main"
    buffer, store = update.cuda_ipc_buffer, update.store
    return {"push_id": update.push_id, "transport": update.transport,
            "tensors": [p.model_dump(mode="json") for p in update.tensors],
            "is_last_load": is_last_load, "in_place": in_place,
            "cuda_ipc_buffer": None if buffer is None else buffer.model_dump(mode="json"),
            "store": None if store is None else {
                "path": store.path, "buckets": [b.model_dump(mode="json")
                                                for b in store.buckets]}}


class LoadSession:
    """One model's load inside a backend, reload or in place (module docstring).

    vLLM calls ``start_weight_update`` before the backend sees any update info, so the
    choice is made at the first :meth:`load`: a layerwise reload begins there unless the
    update is ``in_place``, and :meth:`finish` ends whichever began. In place, the
    model's copy plan (:mod:`~rollout_service.engines.vllm.copy_plan`) is recorded by the
    first push and replayed by the next ones; ``plans`` outlives the session (the
    backend keeps it, one plan per model).
    """

    def __init__(self, model: Any, model_config: Any, plans: dict[int, Any]) -> None:
        self._model = model
        self._model_config = model_config
        self._plans = plans
        self._is_reloading = False

    def load(self, info: PushUpdateInfo, tensors: Iterable[tuple[str, Any]]) -> None:
        """Load one update's tensors into the session's model."""
        if info.in_place:
            from rollout_service.engines.vllm.copy_plan import load_in_place

            load_in_place(self._model, tensors, self._plans)
            return
        if not self._is_reloading:
            from vllm.model_executor.model_loader.reload.layerwise import (
                initialize_layerwise_reload,
            )

            initialize_layerwise_reload(self._model)
            self._is_reloading = True
        self._model.load_weights(iter(tensors))

    def finish(self) -> None:
        if self._is_reloading:
            from vllm.model_executor.model_loader.reload.layerwise import (
                finalize_layerwise_reload,
            )

            finalize_layerwise_reload(self._model, self._model_config)
            self._is_reloading = False


class SessionLoads:
    """vLLM's weight-update session as this project's backends run it (a mixin before
    vLLM's ``WeightTransferEngine``): one :class:`LoadSession` per model load, and the
    in-place copy plans kept across pushes, one per model (by ``id`` of the main model
    and of the drafter)."""

    model: Any
    model_config: Any
    _session: LoadSession | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plans: dict[int, Any] = {}

    def start_weight_update(self) -> None:
        self._session = LoadSession(self.model, self.model_config, self._plans)

    def finish_weight_update(self) -> None:
        assert self._session is not None, "finish_weight_update without start"
        self._session.finish()
        self._session = None

    def _load(self, update_info: PushUpdateInfo, transport: Transport,
              tensors: Iterable[tuple[str, Any]]) -> None:
        """Load ``tensors`` (the update's, opened by the backend) into this session's model.

        Raises:
            ValueError: the update is for another transport.
        """
        update_info.check_transport(transport)
        assert self._session is not None, "receive_weights without start_weight_update"
        self._session.load(update_info, tensors)
