"""Weight pushes' messages (``/weights/begin``, ``update``, ``finish``, ``abort``,
``status``): JSON control messages only.

Part of :mod:`rollout_service.protocol.messages`. Tensor bytes never travel in these
messages: they go through the transport (a shared-memory segment on one host, CUDA memory
shared by IPC handles, described field by field in ``CudaIpcHandle``, or the trainer's
collective group, ``groups.py``). Nothing here is ever unpickled.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from rollout_service.protocol.cuda_ipc import ByteBufferHandle
from rollout_service.protocol.messages.common import STRICT, Count, Int, integral
from rollout_service.protocol.messages.groups import BucketInfo
from rollout_service.protocol.placement import TensorPlacement, Transport
from rollout_service.protocol.shm import SEGMENT_NAME_PATTERN
from rollout_service.protocol.tensors import Dtype

PushTarget = Literal["main", "draft", "both"]
"""Which models a push loads: the main model, the drafter, or both from one stream."""


def push_roles(target: PushTarget) -> tuple[str, ...]:
    """The models a push target names (``main``, ``draft``), main first."""
    return {"main": ("main",), "draft": ("draft",), "both": ("main", "draft")}[target]


PauseMode = Literal["wait", "abort", "keep"]
"""How generation pauses (for a push's load, or a dialect's pause route): running
requests drain, are aborted, or are frozen until the resume."""
PushClient = Literal["rollout", "sglang", "vllm"]
"""Which protocol drives a push: this service's own, or a framework dialect's weight
routes (each commits only its own pushes)."""


class ParamSpec(BaseModel):
    """One tensor the push will carry, by its checkpoint (Hugging Face) name."""

    model_config = STRICT

    name: str = Field(min_length=1, max_length=512)
    shape: list[Annotated[int, Field(ge=0), BeforeValidator(integral)]] = Field(max_length=8)
    dtype: Dtype = Field(description="torch dtype name without the prefix, e.g. 'bfloat16'.")


_TRANSPORT_FIELDS = {"oneOf": [
    {"properties": {"transport": {"const": "shm"}, "segment": {"type": "string"},
                    "segment_bytes": {"type": "integer"}, "group_id": {"type": "null"},
                    "cuda_ipc_buffer": {"type": "null"}},
     "required": ["segment", "segment_bytes"]},
    {"properties": {"transport": {"const": "cuda_ipc"}, "segment": {"type": "null"},
                    "segment_bytes": {"type": "null"}, "group_id": {"type": "null"}},
     "required": ["transport"]},
    {"properties": {"transport": {"const": "nccl"}, "segment": {"type": "null"},
                    "segment_bytes": {"type": "null"}, "group_id": {"type": "string"},
                    "cuda_ipc_buffer": {"type": "null"}},
     "required": ["transport", "group_id"]},
]}
"""Which fields each transport needs and leaves out, in JSON Schema: 'shm' (the
default) the segment, 'nccl' the group, 'cuda_ipc' none (its staging buffer is
optional)."""
_PARAMS_FIELDS = {"anyOf": [
    {"properties": {"params": {"type": "array"}, "total_bytes": {"type": "integer"}},
     "required": ["params", "total_bytes"]},
    {"properties": {"transport": {"const": "nccl"}, "params": {"type": "null"},
                    "total_bytes": {"type": "null"}},
     "required": ["transport"]},
]}
"""The announcement, in JSON Schema: params with their total_bytes, or (nccl only)
neither, the tensors then named by the updates."""
_FIELDS_BY_TRANSPORT = {"shm": ("segment", "segment_bytes"), "cuda_ipc": (),
                        "nccl": ("group_id",)}
_OPTIONAL_FIELDS_BY_TRANSPORT = {"cuda_ipc": ("cuda_ipc_buffer",)}


MAX_MTP_DEPTHS = 16
"""MTP depths a push's training stats may report."""
Accuracy = Annotated[float, Field(ge=0.0, le=1.0)]


class TrainingStats(BaseModel):
    """What the trainer measured of the MTP head on its training batch, sent with a push;
    the service exports it beside the rollout acceptance of the same weight version
    (docs/telemetry.md)."""

    model_config = STRICT

    version: Int = Field(ge=0, description=(
        "The weight version the stats were measured with: the version that generated the "
        "batch (the trainer's forward before its optimizer step), at most the pushed one."))
    mtp_accuracy: list[Accuracy] = Field(min_length=1, max_length=MAX_MTP_DEPTHS, description=(
        "Per MTP depth (depth 1 first): the share of response tokens where the head's top-1 "
        "token is the token depth + 1 ahead (what the engine's acceptance at draft position "
        "depth - 1 estimates on the same samples)."))
    num_tokens: Int = Field(ge=0, description="Response tokens the depth-1 accuracy counts.")


MAX_PUSH_TIMEOUT_S = 3600.0
"""The longest a trainer may ask the service to wait between two calls of one push: a
push holds the only push slot, and a trainer that died with a day-long timeout would
block every other trainer (an operator can still abort it: ``/weights/abort``)."""


class PushBeginRequest(BaseModel):
    """Announce a push: everything is validated before any byte is loaded."""

    model_config = ConfigDict(**STRICT, json_schema_extra={**_TRANSPORT_FIELDS,
                                                               **_PARAMS_FIELDS})

    version: Int = Field(ge=0, description=(
        "New weight version; must be greater than the current version of every target."))
    target: PushTarget = Field("both", description="Which model(s) load the stream.")
    transport: Transport = Field("shm", description=(
        "Data path; must be the service's configured weights_transport. 'shm': a POSIX "
        "shared-memory segment on this host (CPU and same-host GPU trainers). 'cuda_ipc': "
        "CUDA IPC handles of the trainer's tensors (trainer and engine on the same GPU). "
        "'nccl': one broadcast per bucket from the trainer to every engine worker in the "
        "trainer's collective group (POST /weights/group), each sent while its "
        "/weights/update runs."))
    segment: str | None = Field(None, pattern=SEGMENT_NAME_PATTERN, description=(
        "shm only (required there): name of the trainer's segment under /dev/shm."))
    segment_bytes: Count | None = Field(None, description=(
        "shm only (required there): size of the segment in bytes."))
    group_id: str | None = Field(None, min_length=1, max_length=64, description=(
        "nccl only (required there): the trainer's group the service joined "
        "(POST /weights/group)."))
    cuda_ipc_buffer: ByteBufferHandle | None = Field(None, description=(
        "cuda_ipc only (optional there): the trainer's staging buffer, a byte buffer (1-D "
        "uint8) exported once; a placement without a handle lies in it at its offset. "
        "The trainer writes it before the first update that names a tensor in it."))
    total_bytes: Annotated[int, Field(gt=0), BeforeValidator(integral)] | None = Field(
        None, description=(
        "Sum of the announced tensors' sizes (required with params)."))
    params: list[ParamSpec] | None = Field(None, min_length=1, description=(
        "Every tensor of the push, checked against the served checkpoint before anything "
        "moves. null (nccl only): the served checkpoint's tensors, each named by the "
        "update that carries it and checked there before its bucket is received: the "
        "frameworks' dialects, whose trainers announce tensors call by call; by finish "
        "every tensor must have arrived (target 'draft': any of them)."))
    client: PushClient = Field("rollout", description=(
        "Which protocol drives the push: 'rollout' (this one), or a framework dialect's "
        "weight routes ('sglang', 'vllm'), which commit only their own pushes."))
    pause_mode: PauseMode = Field("wait", description=(
        "How generation is paused while the engine loads: 'wait' lets running requests "
        "finish, 'abort' aborts them, 'keep' freezes them until the load is done."))
    training_stats: TrainingStats | None = Field(None, description=(
        "The trainer's MTP accuracy on its last batch; exported once the push loads."))
    timeout_s: float | None = Field(None, gt=0, le=MAX_PUSH_TIMEOUT_S, description=(
        "Abort the push after this long without a call from the trainer (nothing loads, "
        "the old weights stay served). Default: the service's push_timeout_s. A trainer "
        "that gathers a large model between buckets asks for more; a test of a vanished "
        "trainer, for less."))


    @model_validator(mode="after")
    def _transport_fields(self) -> PushBeginRequest:
        if self.params is None:
            if self.transport != "nccl":
                raise ValueError(f"params: required by transport {self.transport!r} (only "
                                 "'nccl' pushes may name their tensors update by update)")
            if self.total_bytes is not None:
                raise ValueError("total_bytes: leave it out without params (the tensors are "
                                 "named by the updates)")
        elif self.total_bytes is None:
            raise ValueError("total_bytes: required with params")
        needed = _FIELDS_BY_TRANSPORT[self.transport]
        missing = [f for f in needed if getattr(self, f) is None]
        if missing:
            raise ValueError(f"{missing[0]}: required by transport {self.transport!r}")
        allowed = needed + _OPTIONAL_FIELDS_BY_TRANSPORT.get(self.transport, ())
        every = [*_FIELDS_BY_TRANSPORT.values(), *_OPTIONAL_FIELDS_BY_TRANSPORT.values()]
        given = [f for fields in every for f in fields
                 if f not in allowed and getattr(self, f) is not None]
        if given:
            raise ValueError(f"{given[0]}: not used by transport {self.transport!r}; "
                             "leave it out")
        return self


class PushBeginResponse(BaseModel):
    push_id: str
    timeout_s: float = Field(description=(
        "The push is aborted after this long without a call (the begin's timeout_s, or the "
        "service's push_timeout_s)."))


def _raw_buckets(schema: dict[str, Any]) -> None:
    """``buckets``' items in JSON Schema: buckets of the frameworks' framing (checksum
    null)."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "array":
            branch["items"] = {"allOf": [branch["items"], {
                "properties": {"checksum": {"type": "null"}}}]}


class PushUpdateRequest(BaseModel):
    """One bucket: these tensors are now in place (written in the segment, or exported
    as CUDA IPC handles), or, for ``nccl``, broadcast by the trainer while this call runs
    (``bucket`` says its length and checksum; ``buckets``, several collectives of the
    frameworks' framing in order)."""

    model_config = ConfigDict(**STRICT, json_schema_extra={"not": {
        "required": ["bucket", "buckets"]}})

    push_id: str
    tensors: list[TensorPlacement] = Field(default_factory=list, description=(
        "The tensors now in place (nccl: those whose last byte is in this bucket; none "
        "when the bucket ends inside a tensor)."))
    bucket: BucketInfo | None = Field(None, description=(
        "nccl only (required there, or buckets): the bucket the trainer broadcasts during "
        "this call; every placement lies in it."))
    buckets: list[BucketInfo] | None = Field(None, min_length=1, max_length=1 << 16,
                                             json_schema_extra=_raw_buckets, description=(
        "nccl, the frameworks' framing only (each checksum null): the collectives the "
        "trainer broadcasts during this call, in order (one per tensor, or vLLM's packed "
        "chunks); every placement lies in them. Give bucket or buckets, not both."))

    @model_validator(mode="after")
    def _one_bucket_field(self) -> PushUpdateRequest:
        if self.bucket is not None and self.buckets is not None:
            raise ValueError("buckets: give bucket or buckets, not both")
        if self.buckets is not None and any(b.checksum is not None for b in self.buckets):
            raise ValueError("buckets: only buckets of the frameworks' framing (checksum "
                             "null) travel several to an update; send a checksummed bucket "
                             "alone in bucket")
        return self

    @property
    def all_buckets(self) -> list[BucketInfo]:
        """``bucket`` or ``buckets`` as one list (empty for the other transports)."""
        if self.buckets is not None:
            return list(self.buckets)
        return [] if self.bucket is None else [self.bucket]


class PushUpdateResponse(BaseModel):
    num_received: int
    num_expected: int


class PushFinishRequest(BaseModel):
    model_config = STRICT

    push_id: str
    version: Annotated[int, Field(ge=0), BeforeValidator(integral)] | None = Field(
        None, description=(
        "The version to serve instead of begin's (the frameworks name it at the end: "
        "vLLM's finish_weight_update); newer than the served one of every target."))


class PushAbortRequest(BaseModel):
    model_config = STRICT

    push_id: str
    reason: str = "aborted by the client"


class PushTimings(BaseModel):
    """Where a completed push spent its time (seconds)."""

    pause_s: float = Field(description="Pausing generation (mode 'wait' drains requests).")
    load_main_s: float = Field(description=(
        "Main model: segment -> parameters (an SGLang push of both: both models, loaded "
        "in one pass)."))
    finalize_main_s: float = Field(description="Main model: engine post-processing.")
    load_draft_s: float = Field(description=(
        "Drafter: segment -> parameters (0 where the main model's load took it too)."))
    finalize_draft_s: float = Field(description="Drafter: engine post-processing.")
    resume_s: float = Field(description="Prefix-cache reset and resume.")
    total_s: float = Field(description="Pause to resume.")
    receive_s: float = Field(0.0, description=(
        "nccl: the buckets' broadcasts into the workers' ring and the server's stored "
        "copy, during the updates (generation goes on meanwhile); 0 for the other "
        "transports."))


class PushFinishResponse(BaseModel):
    version: int
    target: PushTarget
    num_bytes: int
    timings: PushTimings = Field(description="Ray Serve: the slowest replica's.")
    num_requests_held: int = Field(0, ge=0, description=(
        "Requests unfinished when generation paused, which finish on the pushed weights: "
        "with pause_mode 'keep' the ones frozen across the load (their version spans "
        "switch at the push), with 'wait' the ones that queued during the drain. Ray "
        "Serve: summed over the replicas."))
    replicas: list[str] | None = Field(None, description="Ray Serve: the replicas that loaded it.")
    receive_peak_bytes: list[int] | None = Field(None, description=(
        "nccl: per engine worker (Ray Serve: of every replica, in rank order), the most "
        "bytes it held in receive buffers at once during the push (its ring slots)."))


class LastPush(BaseModel):
    version: int
    target: PushTarget
    outcome: Literal["loaded", "aborted", "rejected", "failed"]
    detail: str


class ActivePushState(BaseModel):
    """The push between its begin and its end, as far as it has come: what a dialect's
    weight route needs to go on with the push its framework's earlier calls began."""

    push_id: str
    client: PushClient
    target: PushTarget
    version: int
    group_id: str | None
    num_buckets: int = Field(description="nccl: buckets received so far.")
    stream_bytes: int = Field(description="nccl: where the last bucket ends in the stream.")
    num_tensors: int = Field(description="Tensors placed so far.")


class WeightStatus(BaseModel):
    """``GET /weights/status`` and the ``weights`` part of ``/health``."""

    main_version: int | None
    draft_version: int | None
    active_push_id: str | None
    active_push: ActivePushState | None = Field(None, description=(
        "The push in progress, if any (its id is active_push_id)."))
    consistent: bool = Field(description=(
        "False only after an engine failure in the middle of a load: the service then "
        "refuses generation until a complete push arrives."))
    last_push: LastPush | None

    @property
    def newest_version(self) -> int:
        """The newest version served by either model; 0 before any push."""
        return max((v for v in (self.main_version, self.draft_version) if v is not None),
                   default=0)
