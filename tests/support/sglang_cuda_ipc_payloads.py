"""What a FAKE SGLang server reads of a ``cuda_ipc`` weight payload, without CUDA and
without SGLang.

Runs in the test process. SGLang's TP worker unpickles a payload with its own
``SafeUnpickler`` after patching torch's ``rebuild_cuda_tensor``
(``rollout_service/engines/sglang/cuda_ipc_payload.py`` says where); here
:class:`PayloadUnpickler` loads the same bytes with two names mapped to stand-ins: the
``rebuild_cuda_tensor`` call becomes a :class:`RebuildCall`, a record of its arguments (no
CUDA memory is opened), and SGLang's ``FlattenedTensorMetadata`` this module's
:class:`FlattenedTensorMetadata`, the same fields. Any name outside
:data:`ALLOWED_GLOBALS` is refused, as SGLang refuses names outside its allow-list (of
which these are a part: checked against 0.5.23's sources by the opt-in test of
``test_sglang_cuda_ipc.py``).

:func:`stand_in_for_sglang` registers that class under SGLang's module name, so that the
service's payload builder, which imports SGLang's class, pickles it under SGLang's name in
a process without SGLang. :class:`PayloadReadingFake` is the fake server that records what
each load request carried.
"""

from __future__ import annotations

import base64
import io
import pickle
import sys
import types
from dataclasses import dataclass
from typing import Any

from rollout_service.protocol.tensors import DTYPE_BYTES
from tests.support.fake_sglang import FakeSGLang

SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
REBUILD = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
METADATA = (SGLANG_BUCKET_MODULE, "FlattenedTensorMetadata")
ALLOWED_GLOBALS = {REBUILD, METADATA, ("torch", "Tensor"), ("torch", "Size"),
                   ("torch.storage", "TypedStorage"), *(("torch", d) for d in DTYPE_BYTES)}
"""Every global a ``cuda_ipc`` payload may name."""


@dataclass
class FlattenedTensorMetadata:
    """Stands in for SGLang's class of this name (``srt/weight_sync/tensor_bucket.py``, a
    plain dataclass of these fields), under its module name."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


FlattenedTensorMetadata.__module__ = SGLANG_BUCKET_MODULE


@dataclass(frozen=True)
class RebuildCall:
    """A ``rebuild_cuda_tensor(*args)`` call the payload asks its reader to make."""

    args: tuple[Any, ...]


class PayloadUnpickler(pickle.Unpickler):
    """Loads a payload with the CUDA rebuild recorded and SGLang's class stood in for."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == REBUILD:
            return lambda *args: RebuildCall(args)
        if (module, name) == METADATA:
            return FlattenedTensorMetadata
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def read_payload(payload: str) -> dict[str, Any]:
    """``{"flattened_tensor": RebuildCall, "metadata": [FlattenedTensorMetadata, ...]}``."""
    return PayloadUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()


def stand_in_for_sglang(monkeypatch: Any) -> None:
    """Register :class:`FlattenedTensorMetadata` as SGLang's for the test (pytest's
    ``monkeypatch`` undoes it). pickle imports the module's packages too."""
    parts = SGLANG_BUCKET_MODULE.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]),
                            types.ModuleType(".".join(parts[:i])))
    module = sys.modules[SGLANG_BUCKET_MODULE]
    module.FlattenedTensorMetadata = FlattenedTensorMetadata  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ReceivedLoad:
    """One ``/update_weights_from_tensor`` request as the fake read it."""

    selector: str | None
    weight_version: str | None
    payloads: list[dict[str, Any]]
    """Per TP rank, :func:`read_payload`'s."""


class PayloadReadingFake(FakeSGLang):
    """The fake server, recording each load request's payloads read (``loads``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.loads: list[ReceivedLoad] = []
        super().__init__(*args, **kwargs)

    async def _load(self, obj: dict[str, Any]) -> Any:
        self.loads.append(ReceivedLoad(
            selector=obj.get("selector"), weight_version=obj["weight_version"],
            payloads=[read_payload(p) for p in obj["serialized_named_tensors"]]))
        return await super()._load(obj)
