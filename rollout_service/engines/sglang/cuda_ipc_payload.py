"""A ``cuda_ipc`` weight push as SGLang ``/update_weights_from_tensor`` payloads, written
without touching CUDA.

Runs in the rollout service process (in a worker thread), once per load, beside
``payload.py`` (``shm``). The trainer shares its GPU memory as CUDA IPC handles
(``protocol/cuda_ipc.py``), which the push intake has checked against the served
checkpoint and the announcement before anything loads. This process never opens that
memory: it writes a pickle in which the ``flattened_tensor`` of SGLang's
``flattened_bucket`` format is a *call* of torch's ``rebuild_cuda_tensor`` with the
handle's own fields as arguments and the GPU's UUID as the device (argument 6). SGLang's
TP worker makes the call when it unpickles, maps the trainer's memory and slices every
tensor out of it on the GPU: no copy through the host.

What SGLang 0.5.23 does with the payload (the sources of its wheel):

- ``srt/managers/scheduler_components/weight_updater.py``,
  ``SchedulerWeightUpdaterManager.update_weights_from_tensor``: one
  ``tp_worker.deserialize_own_rank`` per request, the result handed to each runner the
  ``selector`` picks (target or draft).
- ``srt/managers/tp_worker.py``, ``BaseTpWorker.deserialize_own_rank``: calls
  ``monkey_patch_torch_reductions()``, then unpickles its own rank's entry with
  ``MultiprocessingSerializer.deserialize`` (``srt/utils/common.py``: base64, then
  ``SafeUnpickler``, whose ``ALLOWED_GLOBALS`` hold every name this pickle uses and whose
  ``find_class`` looks each name up in its module at load time).
- ``srt/utils/patch_torch.py``, ``monkey_patch_torch_reductions``: sets
  ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` to
  ``_rebuild_cuda_tensor_modified``, which turns argument 6 from a UUID string into the
  index of the local device with that UUID (``_device_from_maybe_uuid``) and calls torch's
  own. The pickle names torch's function, so the worker's patched one runs.
- ``srt/model_executor/model_runner_components/weight_updater.py``,
  ``WeightUpdater._update_weights_from_flattened_bucket``: copies each metadata entry's
  fields into a ``FlattenedTensorMetadata`` and loads
  ``FlattenedTensorBucket(...).reconstruct_tensors()`` (``srt/weight_sync/tensor_bucket.py``:
  ``flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape)``, views on the
  flattened tensor's own device; this format alone moves nothing with ``.to``).

The format takes one flattened tensor per request, so a load is one request per export
(:func:`export_buckets`): the staging buffer, or each tensor exported in place (a
tensor's own export is read as the bytes it holds). Reference counting: torch's producer
counter starts at 1 per export and a receiver returns 1 each time it opens one (the
handle's ``ref_counter_*``, passed through unchanged, as is the event the open waits on);
the trainer frees an export once its counter is back to 0. The counter is unsigned
(``CudaIPCSentData::counter_value`` in torch's ``torch/csrc/CudaIPCTypes.h``), so each
export must be opened exactly once: a second open leaves it at -1, read as 2**64 - 1, and
the export stays in the trainer's IPC limbo for good. A ``both`` push therefore sends each
export once, for both models (``selector: all``, ``weight_methods.py``); SGLang
deserializes each request once and hands the tensors to every runner it selects.
``WeightPusher`` keeps its staging buffer for the run and its in-place exports until
``/weights/finish`` returns (``PushRun.release``), after SGLang has answered the loads
and dropped the tensors (at the end of its handler).

Every TP rank gets the same payload (SGLang indexes the list by rank). Run on a GPU at
TP 1 only; with TP > 1, ranks on other GPUs would map the trainer's GPU by its UUID.
A handle SGLang cannot open (a GPU its worker does not see, a trainer that has freed the
memory) raises in ``deserialize_own_rank``, outside any handler of 0.5.23's scheduler
(``run_scheduler_process`` then signals the server to quit): the server dies rather than
refuse the push, and the service reports its engine gone, as for a bad ``shm`` payload.
SGLang's ``FlattenedTensorMetadata`` is pickled by reference, so the sglang package must
be importable here, as for ``shm``; torch is imported for its classes, never for CUDA.
"""

from __future__ import annotations

import base64
import dataclasses
from multiprocessing.reduction import ForkingPickler
from typing import Any

from rollout_service.engines.base import WeightUpdate
from rollout_service.engines.sglang.bucket_metadata import flattened_metadata
from rollout_service.protocol.cuda_ipc import ByteBufferHandle, CudaIpcHandle
from rollout_service.protocol.placement import CudaIpcLocation, TensorPlacement
from rollout_service.protocol.tensors import DTYPE_BYTES

REBUILD_DEVICE_ARG = 6
"""Where ``rebuild_cuda_tensor`` takes the device (SGLang's
``_REDUCE_TENSOR_ARG_DEVICE_INDEX``): here the GPU's UUID."""


class RebuildCudaTensor:
    """Pickles as the call ``torch.multiprocessing.reductions.rebuild_cuda_tensor(*args)``,
    made by the process that unpickles it, never by this one."""

    __slots__ = ("args",)

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from torch.multiprocessing import reductions

        rebuild = reductions.rebuild_cuda_tensor
        # pickle writes a function's module and name; this process never applies SGLang's
        # patch, which would put its own name in the payload
        assert (rebuild.__module__, rebuild.__name__) == (
            "torch.multiprocessing.reductions", "rebuild_cuda_tensor"), rebuild
        return rebuild, self.args


def export_buckets(update: WeightUpdate) -> list[WeightUpdate]:
    """``update`` split by CUDA IPC export, in announcement order: one request each.

    Raises:
        ValueError: no tensors, a tensor outside CUDA IPC memory (``shm`` placements in a
            ``cuda_ipc`` push), or one without a handle in a push without a staging buffer.
    """
    if not update.tensors:
        raise ValueError(f"push {update.push_id}: no tensors to load")
    groups: dict[tuple[str, str, int], list[TensorPlacement]] = {}
    for placement in update.tensors:
        groups.setdefault(_handle_of(update, placement).export_key, []).append(placement)
    return [dataclasses.replace(update, tensors=tuple(group)) for group in groups.values()]


def build_cuda_ipc_payloads(update: WeightUpdate, num_ranks: int) -> tuple[list[str], None]:
    """One base64 ``flattened_bucket`` pickle per TP rank of the export every tensor of
    ``update`` lies in (a :data:`~rollout_service.engines.sglang.payload.PayloadBuilder`).

    Returns:
        The payloads, and nothing to keep alive here: the trainer holds the memory.

    Raises:
        ValueError: see :func:`export_buckets`; or tensors in more than one export.
        RuntimeError: sglang is not installed in this process's environment.
    """
    if len(export_buckets(update)) > 1:
        raise ValueError(f"push {update.push_id}: tensors in several CUDA IPC exports; a "
                         "request to SGLang takes one (split with export_buckets)")

    metadata = flattened_metadata(update)
    handle = _as_bytes(_handle_of(update, update.tensors[0]))
    flat = RebuildCudaTensor(handle.to_rebuild_args(handle.gpu_uuid))
    # What SGLang's MultiprocessingSerializer.serialize(obj, output_str=True) writes.
    pickled = ForkingPickler.dumps({"flattened_tensor": flat, "metadata": metadata})
    return [base64.b64encode(pickled).decode("ascii")] * num_ranks, None


def _handle_of(update: WeightUpdate, placement: TensorPlacement) -> CudaIpcHandle:
    location = placement.location
    if not isinstance(location, CudaIpcLocation):
        raise ValueError(f"push {update.push_id}: tensor {placement.name!r} travels by "
                         f"{placement.transport!r}; a 'cuda_ipc' push to SGLang lies in "
                         "CUDA IPC handles only")
    handle = location.handle or update.cuda_ipc_buffer
    if handle is None:
        raise ValueError(f"push {update.push_id}: tensor {placement.name!r} has no handle "
                         "and the push no staging buffer (cuda_ipc_buffer)")
    return handle


def _as_bytes(handle: CudaIpcHandle) -> CudaIpcHandle:
    """The export as the flattened bucket SGLang slices: a byte buffer as it is, a
    tensor's own export as the bytes it holds (same memory, same counter and event)."""
    if handle.is_byte_buffer:
        return handle
    return ByteBufferHandle.model_validate({
        **handle.model_dump(), "dtype": "uint8", "shape": [handle.nbytes], "stride": [1],
        "storage_offset": handle.storage_offset * DTYPE_BYTES[handle.dtype]})


