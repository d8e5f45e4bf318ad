"""Trainer side of a weight push: one call after each optimizer step.

Runs in the trainer process. Tensors (already under their Hugging Face names)
are copied once into a shared-memory segment that the pusher keeps for the
whole run (``shm``), or shared as CUDA IPC handles (``cuda_ipc``, same GPU as the
engine): by default copied into a staging buffer on the GPU that the pusher keeps
for the run and exported as one handle, or each tensor exported in place; they are
announced bucket by bucket over HTTP (JSON control messages only) and loaded by
the service into the main model and the MTP drafter in one paused window. The
drafter reads the same bytes: nothing is sent twice.

    pusher = WeightPusher("http://127.0.0.1:8000", token=os.environ["ROLLOUT_WEIGHTS_TOKEN"])
    report = pusher.push(export_hf_weights(model), version=step)
"""

from __future__ import annotations

import ctypes
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import httpx
import torch

from rollout_service.client import ServiceError, bearer, raise_for_error
from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import ByteBufferHandle, export_byte_buffer, export_handle
from rollout_service.protocol.placement import (
    BroadcastLocation,
    CudaIpcLocation,
    ShmLocation,
    TensorPlacement,
    Transport,
)
from rollout_service.protocol.shm import PinnedSegment, Segment, align
from rollout_service.protocol.tensors import TensorMeta, contiguous_stride, view_in
from trainer_client.group import TrainerGroup

DEFAULT_BUCKET_BYTES = 512 * 1024**2


@dataclass(frozen=True, kw_only=True, slots=True)
class PushReport:
    """What one push cost, for the trainer's logs."""

    version: int
    num_bytes: int
    num_tensors: int
    num_buckets: int
    fill_s: float
    """Copying tensors into the segment (device-to-host included); ``cuda_ipc``:
    copying them into the staging buffer and exporting its handle (or exporting each
    tensor's handle)."""
    control_s: float
    """Begin and update calls."""
    begin_s: float
    """Of ``control_s``, the begin call (the announcement of every tensor)."""
    server: messages.PushFinishResponse
    """The service's own timings (pause, load per model, resume)."""
    total_s: float

    @property
    def gb_per_s(self) -> float:
        """Model bytes per second, end to end."""
        return self.num_bytes / self.total_s / 1e9


def param_spec(name: str, tensor: torch.Tensor) -> messages.ParamSpec:
    return messages.ParamSpec(name=name, shape=list(tensor.shape),
                              dtype=str(tensor.dtype).removeprefix("torch."))


def spec_nbytes(spec: messages.ParamSpec) -> int:
    return TensorMeta(shape=tuple(spec.shape), dtype=spec.dtype).nbytes


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Aligned offsets of tensors of these byte sizes, in order, and the segment size.

    Every offset is a multiple of 64, so tensors of different dtypes never sit at
    an offset their element size does not divide.
    """
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end = align(end + size)
    return offsets, max(end, 1)


def shareable(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` with contiguous strides on its CUDA device, copied only if needed.

    Raises:
        ValueError: naming the tensor, when it is not on a CUDA device.
    """
    if tensor.device.type != "cuda":
        raise ValueError(f"tensors: {name!r} is on {tensor.device}; transport 'cuda_ipc' "
                         "shares CUDA tensors only (use transport 'shm')")
    tensor = tensor.detach()
    if list(tensor.stride()) != contiguous_stride(tensor.shape):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def copy_into(segment: Segment, offset: int, tensor: torch.Tensor, nbytes: int) -> None:
    """Copy ``tensor`` into the segment at ``offset``.

    A contiguous CPU tensor goes through one ``memmove`` on this thread: torch's
    ``copy_`` splits large copies over its intra-op threads, which on a busy host
    (the trainer's own threads, the engine's) ran 14x slower than one plain
    copy (211 MB: 1.0 s vs 0.07 s). Other tensors (GPU, strided) use ``copy_``,
    which also does the device-to-host transfer: asynchronous, into the segment
    pinned by :class:`PinnedSegment` (the caller synchronizes before announcing).
    """
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        ctypes.memmove(segment.address(offset), tensor.data_ptr(), nbytes)
    else:
        segment.tensor(offset, tensor.dtype, tuple(tensor.shape)).copy_(
            tensor, non_blocking=tensor.device.type == "cuda")


def _synchronize() -> float:
    """Wait for the asynchronous device-to-host copies; returns the seconds waited."""
    start = time.perf_counter()
    torch.cuda.synchronize()
    return time.perf_counter() - start


@dataclass(kw_only=True)
class _PushMemory:
    """Where one push's bytes go (``WeightPusher._memory_for``)."""

    transport: Transport
    segment: Segment | None = None
    """``shm``: the pusher's segment."""
    pin: Callable[[Segment], None] | None = None
    """``shm``: pins the segment for asynchronous copies from a GPU."""
    staging: torch.Tensor | None = None
    """``nccl``: the broadcast buffer; ``cuda_ipc``: the staging buffer (None: each
    tensor exported in place)."""
    staging_handle: ByteBufferHandle | None = None
    """``cuda_ipc``: the staging buffer's export, named in begin."""
    setup_s: float = 0.0
    """Allocating and exporting the staging buffer (part of the push's fill time)."""


class _PushRun:
    """One push's placing of tensors: copies them where ``memory`` says and sends their
    placements, bucket by bucket (``send``: one ``/weights/update``).

    A bucket is sent once it holds ``bucket_bytes``; placements in memory the engine reads
    only after a synchronize (asynchronous copies into the segment, the staging buffer)
    are sent after it.
    """

    def __init__(self, memory: _PushMemory, send: Callable[[list[TensorPlacement]], object],
                 bucket_bytes: int) -> None:
        self._memory = memory
        self._send = send
        self._bucket_bytes = bucket_bytes
        self._bucket: list[TensorPlacement] = []
        self._bucket_size = 0
        self._async_copies = False
        self._staged: list[TensorPlacement] = []
        self._exported: list[torch.Tensor] = []
        """``cuda_ipc`` in place: the engine maps these tensors' memory until finish
        returns; a handle does not keep its tensor alive, so this list does."""
        self.num_buckets = 0
        self.fill_s = memory.setup_s

    def place(self, tensor: torch.Tensor, spec: messages.ParamSpec, offset: int) -> None:
        """Put ``tensor`` (announced as ``spec``) in place at ``offset`` and announce it."""
        start = time.perf_counter()
        memory, name = self._memory, spec.name
        location: ShmLocation | CudaIpcLocation | BroadcastLocation
        if memory.transport == "nccl":
            assert memory.staging is not None
            view_in(memory.staging, offset, spec.shape, spec.dtype).copy_(tensor.detach())
            location = BroadcastLocation(offset=offset)
        elif memory.segment is not None:
            if tensor.device.type == "cuda":
                assert memory.pin is not None
                memory.pin(memory.segment)
                self._async_copies = True
            copy_into(memory.segment, offset, tensor, spec_nbytes(spec))
            location = ShmLocation(segment=memory.segment.name, offset=offset)
        elif memory.staging is not None:
            view_in(memory.staging, offset, spec.shape, spec.dtype).copy_(
                shareable(tensor, name))
            location = CudaIpcLocation(offset=offset)
        else:
            self._exported.append(shareable(tensor, name))
            location = CudaIpcLocation(handle=export_handle(self._exported[-1], name))
        self.fill_s += time.perf_counter() - start
        placement = TensorPlacement(name=name, dtype=spec.dtype, shape=tuple(spec.shape),
                                    location=location)
        if memory.staging_handle is not None:
            self._staged.append(placement)  # announced once every copy is done
        else:
            self._announce(placement)

    def finish_placing(self) -> None:
        """Announce what is left: the staged tensors, once their copies are done (the
        export's event was recorded before them, and a receiver that still maps the
        buffer from the last push reuses that mapping without waiting on any event:
        torch's ``rebuild_cuda_tensor``, storage cache hit), and the last bucket."""
        if self._staged:
            assert self._memory.staging is not None
            start = time.perf_counter()
            torch.cuda.synchronize(self._memory.staging.device)
            self.fill_s += time.perf_counter() - start
            for placement in self._staged:
                self._announce(placement)
        self._flush()

    def release(self) -> None:
        """Let go of the tensors exported in place (``cuda_ipc``, unstaged)."""
        if self._exported:
            self._exported.clear()
            torch.cuda.ipc_collect()  # frees copies the engine has let go of

    def _announce(self, placement: TensorPlacement) -> None:
        self._bucket.append(placement)
        self._bucket_size += placement.nbytes
        if self._bucket_size >= self._bucket_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._bucket:
            return
        if self._async_copies:  # the bytes must be in the segment when announced
            self.fill_s += _synchronize()
        self._send(self._bucket)
        self.num_buckets += 1
        self._bucket, self._bucket_size = [], 0


class WeightPusher:
    """Pushes weights to one rollout service on the same host.

    Args:
        url: the service, e.g. ``http://127.0.0.1:8000``.
        token: the service's weights token.
        transport: ``shm`` (a shared-memory segment; any device) or ``cuda_ipc``
            (CUDA tensors shared in place; the engine on the same GPU). Must be the
            service's ``weights_transport``.
        bucket_bytes: bytes announced per update call; a larger tensor goes alone.
            Default: 512 MiB for ``shm``; for ``cuda_ipc`` every tensor in one call
            (the bytes do not travel, only an offset per tensor when staged, a ~600-byte
            handle per tensor when not, and each call costs HTTP and validation).
        cuda_ipc_staging: ``cuda_ipc`` only. True (default): copy the tensors into a
            staging buffer on the current CUDA device (kept for the next push) and export
            it as one handle, named once in begin (``cuda_ipc_buffer``), so the engine
            opens one export per push instead of one per tensor and the updates carry
            offsets only; costs one copy of the pushed weights in GPU memory. False: export
            each tensor in place (no extra memory; an export and an open per tensor).
        timeout_s: HTTP timeout; loading a large model can take a while.
        push_timeout_s: how long the service waits for this trainer's next call of a
            push before aborting it (``PushBeginRequest.timeout_s``); None: the service's
            ``push_timeout_s``. Ask for more when the trainer gathers a large model
            between buckets (a pipeline-parallel export), or sits on a busy host.
    """

    def __init__(self, url: str, token: str, *, transport: Transport = "shm",
                 bucket_bytes: int | None = None, cuda_ipc_staging: bool = True,
                 timeout_s: float = 600.0, push_timeout_s: float | None = None) -> None:
        if transport not in ("shm", "cuda_ipc", "nccl"):
            raise ValueError(f"transport: {transport!r} is not supported (accepted: 'shm', "
                             "'cuda_ipc', 'nccl')")
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES if transport == "shm" else sys.maxsize
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
        if push_timeout_s is not None and not 0 < push_timeout_s <= messages.MAX_PUSH_TIMEOUT_S:
            raise ValueError(f"push_timeout_s: must be in (0, {messages.MAX_PUSH_TIMEOUT_S:g}] "
                             f"seconds, got {push_timeout_s}")
        self._http = httpx.Client(base_url=url, timeout=timeout_s, headers=bearer(token))
        self._push_timeout_s = push_timeout_s
        self._bucket_bytes = bucket_bytes
        self._transport = transport
        self._segment: Segment | None = None
        self._pinned: PinnedSegment | None = None
        self._staging_enabled = cuda_ipc_staging and transport == "cuda_ipc"
        self._staging: torch.Tensor | None = None
        self._group = TrainerGroup(self._create_group) if transport == "nccl" else None
        self._segment_name = f"mtp-rollout-push-{uuid.uuid4().hex[:12]}"

    def close(self) -> None:
        """Remove the segment and close the HTTP client."""
        self._unpin()
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._staging = None
        if self._group is not None:
            self._group.close()
        self._http.close()

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _segment_for(self, nbytes: int) -> Segment:
        # Kept across pushes: its pages are faulted in once, not every step.
        if self._segment is None or self._segment.nbytes < nbytes:
            self._unpin()
            if self._segment is not None:
                self._segment.close()
            self._segment = Segment.create(self._segment_name, nbytes)
        return self._segment

    def _staging_for(self, nbytes: int, device: torch.device) -> torch.Tensor:
        # Kept across pushes like the segment: no allocation per step.
        if (self._staging is None or self._staging.numel() < nbytes
                or self._staging.device != device):
            self._staging = None
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._staging

    def _pin(self, segment: Segment) -> None:
        if self._pinned is None:
            self._pinned = PinnedSegment(segment)

    def _unpin(self) -> None:
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None

    def _create_group(self) -> messages.WeightGroupResponse:
        response = self._http.post("/weights/group")
        raise_for_error(response)
        return messages.WeightGroupResponse.model_validate(response.json())

    def _begin(self, request: messages.PushBeginRequest) -> messages.PushBeginResponse:
        """``begin``; for ``nccl``, once more in a new group when the service has let the
        old one go (a failed broadcast, a restarted service)."""
        try:
            return messages.PushBeginResponse.model_validate(
                self._call("/weights/begin", request))
        except ServiceError as exc:
            if self._group is None or exc.status != 409 or "group_id" not in exc.message:
                raise
            self._group.close()
            request = request.model_copy(update={"group_id": self._group.group_id})
            return messages.PushBeginResponse.model_validate(
                self._call("/weights/begin", request))

    def _call(self, path: str, body: messages.BaseModel) -> dict:
        response = self._http.post(path, content=body.model_dump_json(),
                                   headers={"content-type": "application/json"})
        raise_for_error(response)
        return response.json()

    def push(self, tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
             target: messages.PushTarget = "both", pause_mode: messages.PauseMode = "wait",
             specs: Sequence[messages.ParamSpec] | None = None,
             training_stats: messages.TrainingStats | None = None) -> PushReport:
        """Push a full set of weights and wait until the service serves them.

        Args:
            tensors: ``(hf_name, tensor)`` pairs, any device; consumed once.
            version: the new weight version (greater than the served one).
            target: ``main``, ``draft`` or ``both`` (one paused window).
            pause_mode: how the service pauses generation while it loads.
            specs: the tensors' names, shapes and dtypes in iteration order; lets a
                streaming exporter (Megatron gather) avoid holding the whole model.
                Without it, ``tensors`` is materialized first to learn them.
            training_stats: the MTP head's accuracy on the last training batch; the
                service exports it once the push loads (beside the rollout acceptance of
                the version it was measured with).

        Raises:
            ServiceError: the service refused it; the served weights are unchanged.
        """
        start = time.perf_counter()
        if specs is None:
            tensors = list(tensors)
            specs = [param_spec(name, t) for name, t in tensors]
        sizes = [spec_nbytes(spec) for spec in specs]
        offsets, buffer_bytes = layout(sizes)
        memory = self._memory_for(buffer_bytes)
        begin_start = time.perf_counter()
        begin = self._begin(messages.PushBeginRequest(
            version=version, target=target, transport=self._transport,
            segment=memory.segment.name if memory.segment else None,
            segment_bytes=memory.segment.nbytes if memory.segment else None,
            group_id=self._group.group_id if self._group else None,
            broadcast_bytes=buffer_bytes if self._group else None,
            cuda_ipc_buffer=memory.staging_handle,
            total_bytes=sum(sizes), params=list(specs), pause_mode=pause_mode,
            training_stats=training_stats, timeout_s=self._push_timeout_s))
        begin_s = time.perf_counter() - begin_start
        run = _PushRun(memory, lambda bucket: self._call("/weights/update", (
            messages.PushUpdateRequest(push_id=begin.push_id, tensors=bucket))),
            self._bucket_bytes)
        try:
            for (name, tensor), spec, offset in zip(tensors, specs, offsets, strict=True):
                if (name, list(tensor.shape), str(tensor.dtype)) != (
                        spec.name, spec.shape, f"torch.{spec.dtype}"):
                    raise ValueError(f"tensors: got {name!r} {list(tensor.shape)} {tensor.dtype} "
                                     f"where specs announced {spec.name!r} {spec.shape} "
                                     f"{spec.dtype}")
                run.place(tensor, spec, offset)
            run.finish_placing()
            control_s = time.perf_counter() - start - run.fill_s

            def finish() -> messages.PushFinishResponse:
                return messages.PushFinishResponse.model_validate(self._call(
                    "/weights/finish", messages.PushFinishRequest(push_id=begin.push_id)))

            if self._group is not None:
                assert memory.staging is not None
                finished = self._group.during_broadcast(
                    begin.push_id, memory.staging[:buffer_bytes], finish)
            else:
                finished = finish()
        except BaseException as exc:
            if not isinstance(exc, ServiceError):  # a refusal already ended the push
                self._abort(begin.push_id, f"trainer error: {exc!r}")
            raise
        finally:
            run.release()
        return PushReport(version=version, num_bytes=sum(sizes), num_tensors=len(specs),
                          num_buckets=run.num_buckets, fill_s=run.fill_s, control_s=control_s,
                          begin_s=begin_s, server=finished,
                          total_s=time.perf_counter() - start)

    def _memory_for(self, nbytes: int) -> _PushMemory:
        """Where this push's bytes go, ready before ``begin`` names it: the segment
        (``shm``), the broadcast buffer (``nccl``), or the staging buffer and its export
        (``cuda_ipc``, staged; exported once, named in begin, the placements then give
        offsets only)."""
        if self._transport == "shm":
            return _PushMemory(transport="shm", segment=self._segment_for(nbytes),
                               pin=self._pin)
        if self._group is not None:
            return _PushMemory(transport="nccl",
                               staging=self._staging_for(nbytes, self._group.device))
        if not self._staging_enabled or not torch.cuda.is_available():
            # Without CUDA nothing can be staged; the service's refusal of a begin it
            # cannot take, or the first tensor's (``shareable``), says why.
            return _PushMemory(transport="cuda_ipc")
        start = time.perf_counter()
        staging = self._staging_for(nbytes, torch.device("cuda", torch.cuda.current_device()))
        return _PushMemory(transport="cuda_ipc", staging=staging,
                           staging_handle=export_byte_buffer(staging, "the staging buffer"),
                           setup_s=time.perf_counter() - start)

    def _abort(self, push_id: str, reason: str) -> None:
        try:
            self._call("/weights/abort", messages.PushAbortRequest(push_id=push_id, reason=reason))
        except (ServiceError, httpx.HTTPError):
            pass  # the service times the push out by itself

