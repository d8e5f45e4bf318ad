"""Trainer side of a weight push: one call after each optimizer step.

Runs in the trainer process. Tensors (already under their Hugging Face names)
are copied once into a shared-memory segment that the pusher keeps for the
whole run (``shm``), shared as CUDA IPC handles (``cuda_ipc``, same GPU as the
engine: by default copied into a staging buffer on the GPU that the pusher keeps
for the run and exported as one handle, or each tensor exported in place;
``placing.py``), or broadcast bucket by bucket in a collective group the pusher owns
(``nccl``, engines on any host: ``bucket_stream.py``, ``group.py``); they are announced
bucket by bucket over HTTP (JSON control messages only) and loaded by the service into
the main model and the MTP drafter in one paused window. The drafter reads the same
bytes: nothing is sent twice.

    pusher = WeightPusher("http://127.0.0.1:8000", token=os.environ["ROLLOUT_WEIGHTS_TOKEN"])
    report = pusher.push(export_hf_weights(model), version=step)
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import httpx
import torch
from pydantic import BaseModel

from rollout_service.client import ServiceError, bearer, raise_for_error
from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import export_byte_buffer
from rollout_service.protocol.placement import Transport
from rollout_service.protocol.shm import PinnedSegment, Segment, align
from trainer_client.bucket_stream import BucketStream
from trainer_client.group import TrainerGroup, local_address_towards
from trainer_client.placing import (  # re-exported: tests and tools place tensors too
    PushMemory,
    PushRun,
    copy_into,
    shareable,
    spec_nbytes,
)

__all__ = ["PushReport", "WeightPusher", "copy_into", "layout", "param_spec", "shareable",
           "spec_nbytes"]

DEFAULT_BUCKET_BYTES = 512 * 1024**2
DEFAULT_NCCL_BUCKET_BYTES = 256 * 1024**2


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


class WeightPusher:
    """Pushes weights to one rollout service on the same host.

    Args:
        url: the service, e.g. ``http://127.0.0.1:8000``.
        token: the service's weights token.
        transport: ``shm`` (a shared-memory segment; any device), ``cuda_ipc``
            (CUDA tensors shared in place; the engine on the same GPU) or ``nccl`` (a
            broadcast per bucket in a group this pusher owns; the service on any host
            that reaches this one). Must be the service's ``weights_transport``.
        bucket_bytes: bytes announced per update call; a larger tensor goes alone
            (``nccl``: the bytes broadcast per update, a tensor spanning buckets as
            needed). Default: 512 MiB for ``shm``, 256 MiB for ``nccl``; for
            ``cuda_ipc`` every tensor in one call (the bytes do not travel, only an
            offset per tensor when staged, a ~600-byte handle per tensor when not, and
            each call costs HTTP and validation).
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
        group_address: ``nccl``: where the service's hosts reach this process's
            rendezvous (default: this host's address on the route to ``url``).
        group_timeout_s: ``nccl``: the group's collective timeout (None: the service's
            ``weights_group_timeout_s``).
        num_buckets: ``nccl``: receive slots per engine worker (None: the service's).
    """

    def __init__(self, url: str, token: str, *, transport: Transport = "shm",
                 bucket_bytes: int | None = None, cuda_ipc_staging: bool = True,
                 timeout_s: float = 600.0, push_timeout_s: float | None = None,
                 group_address: str | None = None, group_timeout_s: float | None = None,
                 num_buckets: int | None = None) -> None:
        if transport not in ("shm", "cuda_ipc", "nccl"):
            raise ValueError(f"transport: {transport!r} is not supported (accepted: 'shm', "
                             "'cuda_ipc', 'nccl')")
        if bucket_bytes is None:
            bucket_bytes = {"shm": DEFAULT_BUCKET_BYTES, "nccl": DEFAULT_NCCL_BUCKET_BYTES
                            }.get(transport, sys.maxsize)
        if transport == "nccl" and bucket_bytes % 64:
            raise ValueError(f"bucket_bytes: {bucket_bytes} is not a multiple of 64 (the "
                             "stream's alignment)")
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
        self._group = None if transport != "nccl" else TrainerGroup(
            state=lambda: messages.WeightGroupState.model_validate(
                self._get("/weights/group/state")),
            create=lambda req: messages.WeightGroupResponse.model_validate(
                self._call("/weights/group", req)),
            release=lambda req: self._call("/weights/group/release", req),
            address=group_address or local_address_towards(url), bucket_bytes=bucket_bytes,
            num_buckets=num_buckets, timeout_s=group_timeout_s)
        self._segment_name = f"mtp-rollout-push-{uuid.uuid4().hex[:12]}"

    def close(self) -> None:
        """Remove the segment and close the HTTP client."""
        self._unpin()
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._staging = None
        if self._group is not None:
            self._group.release()
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

    def _get(self, path: str) -> dict:
        response = self._http.get(path)
        raise_for_error(response)
        return response.json()

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

    def _call(self, path: str, body: BaseModel) -> dict:
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
        memory = None if self._group is not None else self._memory_for(buffer_bytes)
        begin_start = time.perf_counter()
        begin = self._begin(messages.PushBeginRequest(
            version=version, target=target, transport=self._transport,
            segment=memory.segment.name if memory and memory.segment else None,
            segment_bytes=memory.segment.nbytes if memory and memory.segment else None,
            group_id=self._group.group_id if self._group else None,
            cuda_ipc_buffer=memory.staging_handle if memory else None,
            total_bytes=sum(sizes), params=list(specs), pause_mode=pause_mode,
            training_stats=training_stats, timeout_s=self._push_timeout_s))
        begin_s = time.perf_counter() - begin_start
        run: PushRun | BucketStream
        if memory is None:
            assert self._group is not None
            run = BucketStream(self._group, begin.push_id, buffer_bytes,
                               lambda request: self._call("/weights/update", request))
        else:
            run = PushRun(memory, lambda bucket: self._call("/weights/update", (
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
            finished = messages.PushFinishResponse.model_validate(self._call(
                "/weights/finish", messages.PushFinishRequest(push_id=begin.push_id)))
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

    def _memory_for(self, nbytes: int) -> PushMemory:
        """Where this push's bytes go, ready before ``begin`` names it: the segment
        (``shm``), or the staging buffer and its export (``cuda_ipc``, staged; exported
        once, named in begin, the placements then give offsets only). ``nccl`` needs
        none: its bucket buffer is :class:`BucketStream`'s."""
        if self._transport == "shm":
            return PushMemory(transport="shm", segment=self._segment_for(nbytes),
                               pin=self._pin)
        if not self._staging_enabled or not torch.cuda.is_available():
            # Without CUDA nothing can be staged; the service's refusal of a begin it
            # cannot take, or the first tensor's (``shareable``), says why.
            return PushMemory(transport="cuda_ipc")
        start = time.perf_counter()
        staging = self._staging_for(nbytes, torch.device("cuda", torch.cuda.current_device()))
        return PushMemory(transport="cuda_ipc", staging=staging,
                           staging_handle=export_byte_buffer(staging, "the staging buffer"),
                           setup_s=time.perf_counter() - start)

    def _abort(self, push_id: str, reason: str) -> None:
        try:
            self._call("/weights/abort", messages.PushAbortRequest(push_id=push_id, reason=reason))
        except (ServiceError, httpx.HTTPError):
            pass  # the service times the push out by itself

