"""The frameworks' weight-sync calls as pushes of the service's own protocol: shared by
SGLang's and vLLM's weight routes (``sglang/weights_*.py``, ``vllm/weights_*.py``).

Runs in the service process (standalone, or the Ray Serve ingress). A framework's trainer
announces its tensors call by call (SGLang's ``update_weights_from_distributed``, vLLM's
``update_weights``) and broadcasts them in its own framing: one collective per tensor
(SGLang; vLLM unpacked) or vLLM's packed chunks (tensors back to back, a chunk closed once
it holds more than ``packed_buffer_size_bytes``: vllm-project/vllm 0.32
``vllm/distributed/weight_transfer/packed_tensor.py``, ``pack_tensors``). :func:`layout`
turns one call into buckets of the push's byte stream (the frameworks' framing: no
header, no checksum) and the placements of its tensors in them; the service then checks
every tensor against the served checkpoint before any bucket is received
(``weights/checks.py``). The push itself lives in the service
(:class:`~rollout_service.protocol.messages.ActivePushState`), so the dialects keep no
state of their own and work the same behind the Ray Serve ingress.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from rollout_service.protocol import messages
from rollout_service.protocol.placement import BroadcastLocation, TensorPlacement
from rollout_service.protocol.tensors import DTYPE_BYTES
from rollout_service.weights.checks import PushError

ALIGN = 64
"""Where each bucket starts in the push's stream (the stored copy): a multiple of 64, as
the service's own trainer lays out its stream."""
WEIGHT_VERSION_PATTERN = r"^[0-9]{1,15}$"
"""A framework's weight version as this service orders versions: a decimal integer."""
DTYPE_PATTERN = "^(torch\\.)?(" + "|".join(sorted(DTYPE_BYTES)) + ")$"
"""A dtype a framework names (``bfloat16``, or torch's ``torch.bfloat16``) that the service
loads."""
_VERSION = re.compile(WEIGHT_VERSION_PATTERN)


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """One tensor of a framework's call, as it names it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def specs(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *,
          dtype_field: str) -> list[TensorSpec]:
    """The call's tensors; raises PushError(400) naming the field of a list whose length
    differs from ``names`` or a dtype this protocol does not carry."""
    if len(dtypes) != len(names) or len(shapes) != len(names):
        raise PushError(400, f"{dtype_field}, shapes: {len(dtypes)} dtypes and "
                             f"{len(shapes)} shapes for {len(names)} names")
    if not names:
        raise PushError(400, "names: the call names no tensor")
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dtype = dtype.removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            raise PushError(400, f"{dtype_field}: {dtype!r} (tensor {name!r}) is not a dtype "
                                 f"this service loads ({', '.join(sorted(DTYPE_BYTES))})")
        out.append(TensorSpec(name=name, dtype=dtype, shape=tuple(shape)))
    return out


def layout(tensors: list[TensorSpec], active: messages.ActivePushState, *,
           packed_bytes: int | None) -> messages.PushUpdateRequest:
    """One call's update of ``active``: its buckets after the stream so far, and where
    each tensor lies in them.

    Args:
        packed_bytes: vLLM's ``packed_buffer_size_bytes`` (chunks of tensors), or None
            for one collective per tensor.
    """
    groups: list[list[TensorSpec]] = []
    if packed_bytes is None:
        groups = [[t] for t in tensors]
    else:
        chunk: list[TensorSpec] = []
        for tensor in tensors:  # vLLM's pack_tensors: close once past the buffer size
            chunk.append(tensor)
            if sum(t.nbytes for t in chunk) > packed_bytes:
                groups.append(chunk)
                chunk = []
        if chunk:
            groups.append(chunk)
    buckets, placements = [], []
    offset, index = _aligned(active.stream_bytes), active.num_buckets
    for group in groups:
        position = offset
        for tensor in group:
            placements.append(TensorPlacement(name=tensor.name, dtype=tensor.dtype,
                                              shape=tensor.shape,
                                              location=BroadcastLocation(offset=position)))
            position += tensor.nbytes
        nbytes = position - offset
        if nbytes == 0:
            raise PushError(400, f"shapes: tensor {group[0].name!r} has no elements; the "
                                 "frameworks' framing cannot carry an empty collective")
        buckets.append(messages.BucketInfo(index=index, offset=offset, nbytes=nbytes,
                                           checksum=None))
        offset, index = _aligned(position), index + 1
    return messages.PushUpdateRequest(push_id=active.push_id, tensors=placements,
                                      buckets=buckets)


def largest_collective(group_state: messages.WeightGroupState,
                       packed_bytes: int | None) -> int:
    """The ring slot a trainer's collectives need: the largest tensor, or for vLLM's
    packed chunks the buffer size plus the largest tensor (a chunk closes on the tensor
    that takes it past the buffer)."""
    largest = group_state.max_tensor_bytes or ALIGN
    return _aligned(largest + (packed_bytes or 0))


def parse_version(value: str | None, status: messages.WeightStatus, *, field: str) -> int:
    """A framework's version string as the service's version: a decimal integer as it is
    (ordered: it must be newer than the served one, checked by the service), none given
    as the next after the newest served.

    Raises:
        PushError(400): any other string, naming ``field``.
    """
    if value is None:
        return status.newest_version + 1
    if not _VERSION.match(value):
        raise PushError(400, f"{field}: {value!r} is not a decimal integer; this service "
                             "orders weight versions as integers (send str(step))")
    return int(value)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN
