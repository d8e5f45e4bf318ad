"""A weight push as SGLang ``/update_weights_from_tensor`` payloads: the requests of one
model's load (:func:`load_buckets`) and each request's payloads (:func:`build_payloads`).

Runs in the rollout service process (in a worker thread), once per push (both models'
loads take the same payloads). ``cuda_ipc`` is ``cuda_ipc_payload.py``'s, one request per
CUDA IPC export. ``shm`` and ``nccl`` are this module's: the trainer's segment (``shm``),
or the copy of the push this process received as a rank of the trainer's group
(``nccl``, ``group_receiver.py``), becomes one ``flattened_bucket`` (a uint8 tensor over
all of it and one ``FlattenedTensorMetadata`` per tensor at its byte offset), pickled by
SGLang's ``MultiprocessingSerializer`` under torch's ``file_system`` sharing strategy:
torch copies the bytes once into a shared-memory file whose name
travels in the pickle, and SGLang's TP workers map that file. (The default
``file_descriptor`` strategy hands fds over multiprocessing's resource sharer, which
rejects a process outside this one's multiprocessing family.) Every TP rank gets the
same payload (SGLang indexes the list by rank) and its loader takes its own shard. This
process pickles and never unpickles.

SGLang itself is imported only here and in ``cuda_ipc_payload.py``, and only when a push
is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout_service.engines.base import WeightUpdate
from rollout_service.engines.sglang.bucket_metadata import flattened_metadata
from rollout_service.engines.sglang.cuda_ipc_payload import build_cuda_ipc_payloads, export_buckets
from rollout_service.protocol.placement import ShmLocation
from rollout_service.protocol.shm import Segment
from rollout_service.protocol.store import map_store

PayloadBuilder = Callable[[WeightUpdate, int], tuple[list[str], Any]]
"""``(update, num_tp_ranks) -> (one serialized payload per rank, object to keep alive)``,
for one request: ``update`` is one of :func:`load_buckets`."""


def load_buckets(update: WeightUpdate) -> list[WeightUpdate]:
    """The requests of one model's load: the whole push for ``shm`` (one segment), one per
    export for ``cuda_ipc`` (see ``cuda_ipc_payload.export_buckets``)."""
    return export_buckets(update) if update.transport == "cuda_ipc" else [update]


def build_payloads(update: WeightUpdate, num_ranks: int) -> tuple[list[str], Any]:
    """The :data:`PayloadBuilder` of every transport, by the push's transport."""
    if update.transport == "cuda_ipc":
        return build_cuda_ipc_payloads(update, num_ranks)
    return build_flattened_bucket_payloads(update, num_ranks)


def open_push_bytes(update: WeightUpdate) -> Segment:
    """The bytes every tensor of ``update`` lies in, at its ``location.offset``: the
    trainer's segment (``shm``), or the copy this process received (``nccl``: the store
    file ``group_receiver.py``'s rank wrote, read-only).

    Raises:
        ValueError: the push has no tensors, a tensor outside them, tensors in more than
            one segment, or an ``nccl`` push without its stored copy.
    """
    if update.transport == "nccl":
        if update.store is None:
            raise ValueError(f"push {update.push_id}: no stored copy to load from")
        return map_store(update.store.path)
    return Segment.attach(push_segment(update))


def push_segment(update: WeightUpdate) -> str:
    """The one shared-memory segment every tensor of ``update`` lies in.

    Raises:
        ValueError: the push has no tensors, a tensor outside shared memory, or tensors
            in more than one segment.
    """
    if not update.tensors:
        raise ValueError(f"push {update.push_id}: no tensors to load")
    outside = next((p for p in update.tensors if not isinstance(p.location, ShmLocation)), None)
    if outside is not None:
        raise ValueError(f"push {update.push_id}: tensor {outside.name!r} travels by "
                         f"{outside.transport!r}; a 'shm' push to SGLang lies in shared memory "
                         "only")
    segments = sorted({p.location.segment for p in update.tensors})
    if len(segments) > 1:
        raise ValueError(f"push {update.push_id}: tensors lie in segments {segments}; a push "
                         "to SGLang uses one segment")
    return segments[0]


def build_flattened_bucket_payloads(update: WeightUpdate, num_ranks: int) -> tuple[list[str], Any]:
    """One base64 ``flattened_bucket`` pickle of all the push's bytes per TP rank.

    Returns:
        The payloads and the shared tensor, which must stay referenced until SGLang has
        loaded (its shared-memory file goes with the last reference).

    Raises:
        ValueError: the push's bytes cannot be opened (see :func:`open_push_bytes`).
        RuntimeError: sglang is not installed in this process's environment.
    """
    segment = open_push_bytes(update)
    import torch
    import torch.multiprocessing

    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as exc:
        segment.close()
        raise RuntimeError(
            "pushing weights to SGLang needs the sglang package in the rollout service's "
            f"environment (its MultiprocessingSerializer builds the payload): {exc}") from exc
    try:
        flat = segment.tensor(0, torch.uint8, (segment.nbytes,))
        metadata = flattened_metadata(update)
        strategy = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            payload = MultiprocessingSerializer.serialize(
                {"flattened_tensor": flat, "metadata": metadata}, output_str=True)
        finally:
            torch.multiprocessing.set_sharing_strategy(strategy)
    finally:
        segment.close()  # the pickled tensor now lives in torch's own shared memory
    return [payload] * num_ranks, flat
