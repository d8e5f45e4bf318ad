"""Tensor shapes and dtypes, and what a push may carry: the checkpoint's tensors.

The checkpoint readers run in the service process; the shape arithmetic (:func:`numel`,
:func:`contiguous_stride`) wherever a tensor is described. Names on the wire are the
checkpoint's own (Hugging Face) names, exactly what the model's loader accepts, so the
served checkpoint's safetensors headers are the reference. Only the headers are read
(8-byte length + JSON), no tensor is loaded and torch is not imported.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator, Field, WithJsonSchema

if TYPE_CHECKING:
    import torch

# safetensors dtype codes -> torch dtype names (the names used on the wire)
SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32",
    "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
DTYPE_BYTES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
    "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorMeta:
    """Shape and dtype of one checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: str
    """torch dtype name, e.g. ``bfloat16``."""

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPE_BYTES[self.dtype]


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape`` (1 for a scalar)."""
    return math.prod(shape)


def contiguous_stride(shape: Sequence[int]) -> list[int]:
    """Row-major strides (elements) of ``shape``, as torch reports them."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return strides[::-1]


def check_dtype(dtype: str) -> str:
    """``dtype`` if it names a tensor dtype this protocol carries.

    Raises:
        ValueError: naming the accepted dtypes.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: {dtype!r} is not a tensor dtype (accepted: "
                         f"{', '.join(sorted(DTYPE_BYTES))})")
    return dtype


Dtype = Annotated[str, AfterValidator(check_dtype),
                  WithJsonSchema({"type": "string", "enum": sorted(DTYPE_BYTES)})]
"""A message's dtype field: a torch dtype name (``bfloat16``) this protocol carries."""
Dim = Annotated[int, Field(ge=0)]
"""A message's tensor dimension."""


def read_safetensors_header(path: Path) -> dict[str, TensorMeta]:
    """Tensor metadata of one ``.safetensors`` file, from its header alone."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return {name: TensorMeta(shape=tuple(entry["shape"]),
                             dtype=SAFETENSORS_DTYPES[entry["dtype"]])
            for name, entry in header.items()}


def checkpoint_tensors(model_dir: str | Path) -> dict[str, TensorMeta]:
    """Every tensor of a checkpoint directory (all its ``*.safetensors`` files).

    Raises:
        ValueError: the directory holds no safetensors file.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors file in {model_dir}; weight pushes are "
                         "validated against the checkpoint's tensors")
    tensors: dict[str, TensorMeta] = {}
    for file in files:
        tensors.update(read_safetensors_header(file))
    return tensors


def view_in(base: torch.Tensor, offset: int, shape: tuple[int, ...] | list[int],
            dtype: str) -> torch.Tensor:
    """The tensor of this shape and dtype at byte ``offset`` of ``base``: ``base`` itself
    when it is that tensor, else a view into ``base`` as a byte buffer (no copy).

    Byte buffers carry a push's tensors in the ``cuda_ipc`` staging buffer and the
    ``nccl`` broadcast; the caller has checked the placement's offset and bounds.
    """
    import torch

    torch_dtype = getattr(torch, dtype)
    if offset == 0 and base.dtype == torch_dtype and list(base.shape) == list(shape):
        return base
    nbytes = numel(list(shape)) * DTYPE_BYTES[dtype]
    return base[offset:offset + nbytes].view(torch_dtype).view(tuple(shape))
