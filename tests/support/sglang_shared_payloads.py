"""What a FAKE SGLang server reads of an ``shm`` or ``nccl`` weight payload, without
SGLang: the flattened tensor torch shared in a file of its own, and the tensors SGLang's
loader would slice out of it.

Runs in the test process. The service builds these payloads with SGLang's
``MultiprocessingSerializer`` (``engines/sglang/payload.py``), which is not installed
here: :func:`stand_in_for_sglang_serializer` registers a stand-in under SGLang's module
name that does what 0.5.23's does (``srt/utils/common.py``: torch's ``ForkingPickler``,
then base64), besides ``stand_in_for_sglang``'s ``FlattenedTensorMetadata``.
:class:`SharedPayloadFake` is the fake server that unpickles each load's payloads as
SGLang's TP worker does (torch maps the shared file) and records every tensor by name,
as ``WeightUpdater._update_weights_from_flattened_bucket`` slices them.
"""

from __future__ import annotations

import base64
import io
import pickle
import sys
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from tests.support.fake_sglang import FakeSGLang
from tests.support.sglang_cuda_ipc_payloads import stand_in_for_sglang

SGLANG_UTILS_MODULE = "sglang.srt.utils"


class MultiprocessingSerializer:
    """Stands in for SGLang's class of this name: ``serialize`` only."""

    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes | str:
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(obj)
        raw = buffer.getvalue()
        return base64.b64encode(raw).decode() if output_str else raw


def stand_in_for_sglang_serializer(monkeypatch: Any) -> None:
    """SGLang's serializer and metadata class, stood in for the test (undone after)."""
    stand_in_for_sglang(monkeypatch)
    if SGLANG_UTILS_MODULE not in sys.modules:
        monkeypatch.setitem(sys.modules, SGLANG_UTILS_MODULE,
                            types.ModuleType(SGLANG_UTILS_MODULE))
    monkeypatch.setattr(sys.modules[SGLANG_UTILS_MODULE], "MultiprocessingSerializer",
                        MultiprocessingSerializer, raising=False)


@dataclass(frozen=True)
class SlicedLoad:
    """One ``/update_weights_from_tensor`` request: every tensor it carried, by name, as
    the first TP rank's payload gives them (copies)."""

    selector: str | None
    weight_version: str | None
    tensors: dict[str, torch.Tensor]
    num_payloads: int


class SharedPayloadFake(FakeSGLang):
    """The fake server, recording each load's tensors sliced out of its payload."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.loads: list[SlicedLoad] = []
        super().__init__(*args, **kwargs)

    async def _load(self, obj: dict[str, Any]) -> Any:
        payloads = obj["serialized_named_tensors"]
        bucket = pickle.loads(base64.b64decode(payloads[0]))
        flat: torch.Tensor = bucket["flattened_tensor"]
        tensors = {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape).clone()
                   for m in bucket["metadata"]}
        self.loads.append(SlicedLoad(selector=obj.get("selector"),
                                     weight_version=obj["weight_version"], tensors=tensors,
                                     num_payloads=len(payloads)))
        return await super()._load(obj)
