"""HTTP messages of the rollout service (pydantic); this module holds nothing else.

Shared by the server (``api``) and by clients (``client``, the trainer client,
tools, tests), so both sides validate the same shapes. Requests reject unknown
fields and take JSON types as they are (strict: ``"1"`` is not ``1``; an integer may be
written ``3.0``, as JSON Schema reads it); every constraint JSON Schema can state is on a
field or the model, so the OpenAPI document states it. OpenAI-shaped messages are in
``protocol/openai.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from rollout_service.protocol.acceptance import BatchSummary, SpecDecodeStats
from rollout_service.protocol.cuda_ipc import ByteBufferHandle
from rollout_service.protocol.placement import TensorPlacement, Transport
from rollout_service.protocol.shm import SEGMENT_NAME_PATTERN
from rollout_service.protocol.speculation import SpeculationControlStatus
from rollout_service.protocol.tensors import Dtype

_STRICT = ConfigDict(extra="forbid", strict=True)

MAX_N = 64
"""Sequences per prompt."""
MAX_BATCH = 4096
"""Requests per batch, prompts per completion call."""
MAX_STOP = 16
"""Stop strings per request."""
MAX_TOP_K = 2**31 - 1
"""Far past any vocabulary (top-k past it keeps all); integers past 64 bits fail inside
vLLM, whose processes exchange requests as msgpack."""
CATEGORY_PATTERN = r"^[A-Za-z0-9_.:/-]{1,64}$"
"""A request's ``category``: a short name, safe as a Prometheus label value."""
MAX_SEED = 2**53 - 1
"""The largest integer a JSON number holds exactly (an IEEE double: the OpenAPI document's
bounds are doubles, and so are many clients' numbers)."""


def integral(value: Any) -> Any:
    """``3.0`` as 3; anything else as it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(integral)]
"""An integer of a request: JSON has one number type, and ``3.0`` is the integer 3 (as
JSON Schema reads it); strings, booleans and fractions are refused. Constrained integers
carry their bounds before the validator (after it, in a union, pydantic would document
them under names JSON Schema does not know)."""
Count = Annotated[int, Field(ge=1), BeforeValidator(integral)]
"""An integer of at least 1."""
TokenId = Annotated[int, Field(ge=0), BeforeValidator(integral)]
"""A token id (the vocabulary's size is the engine's to check)."""
Seed = Annotated[int, Field(ge=0, le=MAX_SEED), BeforeValidator(integral)]
"""A sampling seed."""
StopString = Annotated[str, Field(min_length=1)]
"""A string that ends a sequence; the engines refuse an empty one."""
RESERVED_CATEGORIES = ("none", "other")
"""The labels the service itself gives: requests without a category, and past its list."""


def unreserved(category: str) -> str:
    """Refuse a category named like one of :data:`RESERVED_CATEGORIES`: its sequences would
    be counted with the uncategorized ones, or with those past the allow-list."""
    if category in RESERVED_CATEGORIES:
        raise ValueError(f"{category!r} is reserved: the service labels requests without a "
                         "category 'none' and those past its categories 'other'")
    return category


Category = Annotated[str, Field(pattern=CATEGORY_PATTERN, json_schema_extra={
    "not": {"enum": list(RESERVED_CATEGORIES)}}, description=(
    "Where the prompt comes from (task, data source: 'code', 'math', ...): the acceptance "
    "series get it as their 'category' label (the service's allow-list or its first "
    "categories; the rest as 'other'), and a batch's acceptance is summarized per "
    "category. 1-64 characters of letters, digits and _.:/-; not 'none' or 'other', the "
    "labels the service gives requests without one and past its list.")),
    AfterValidator(unreserved)]
"""A request's category (``telemetry.categories`` bounds the labels it becomes)."""


class SamplingFields(BaseModel):
    """Sampling parameters shared by ``/generate`` requests."""

    model_config = _STRICT

    max_tokens: Int = Field(16, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0,
                               description="Sampling temperature; 0 is greedy (OpenAI's range).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus probability mass kept.")
    top_k: Int = Field(0, ge=0, le=MAX_TOP_K, description=(
        "Tokens kept by rank; 0 keeps all (and so does any k past the vocabulary)."))
    seed: Seed | None = Field(None, description=(
        "Seed for reproducible sampling; sequence i of a request with n > 1 uses seed + i."))
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP,
                                   description="Strings that end a sequence (non-empty).")
    ignore_eos: bool = Field(False, description="Generate past end-of-sequence (benchmarks).")
    logprobs: bool = Field(False, description="Return each sampled token's log-probability.")


_ONE_PROMPT = {"oneOf": [
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    {"required": ["prompt_token_ids"], "properties": {"prompt_token_ids": {"type": "array"}}},
]}
"""Exactly one of the two prompt fields is given and not null, in JSON Schema."""


class GenerateRequest(SamplingFields):
    """One prompt, ``n`` sequences; give exactly one of ``prompt`` and ``prompt_token_ids``."""

    model_config = ConfigDict(json_schema_extra=_ONE_PROMPT)

    prompt: Annotated[str, Field(min_length=1)] | None = Field(None, description=(
        "Prompt text (tokenized by the server)."))
    prompt_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None \
        = Field(None, description="Prompt as token ids (each below the vocabulary size).")
    n: Int = Field(1, ge=1, le=MAX_N, description=(
        "Sequences to sample; each runs as its own engine request so each has exact stats."))
    category: Category | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' and 'prompt_token_ids'")
        return self


class WeightVersionSpan(BaseModel):
    """Output tokens ``[start, end)`` were produced by weights labelled ``version``."""

    model_config = ConfigDict(frozen=True)

    version: str
    start: int
    end: int


class SpecDecodeInfo(BaseModel):
    """One sequence's speculative-decoding counts and ratios (see ``protocol.acceptance``)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    accepted_per_position: list[int]
    accept_rate: float | None = Field(description="None when nothing was drafted.")
    accept_length: float = Field(description="1 + accepted / drafts; 1.0 without drafts.")
    num_rejected_tokens: int = Field(0, description=(
        "Drafted tokens the target rejected: work computed and thrown away."))
    verify_cost_ratio: float | None = Field(None, description=(
        "Time of this sequence's verify steps over plain decode steps: with the speculation "
        "control, the measured cost at the K each step ran (c(K, B) / c(0, B)), else the "
        "engine's start-up figure at the largest K (docs/telemetry.md); None when not "
        "measured."))
    net_speedup: float | None = Field(None, description=(
        "accept_length / verify_cost_ratio: below 1, speculation slowed this sequence down; "
        "None without drafts or without a measured cost ratio."))

    def to_stats(self) -> SpecDecodeStats:
        """The counts, for ``protocol.acceptance.summarize`` on the client side."""
        return SpecDecodeStats(
            num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens, num_verify_steps=self.num_verify_steps,
            accepted_per_position=tuple(self.accepted_per_position),
            verify_cost_ratio=self.verify_cost_ratio)


AcceptanceSummary = BatchSummary
"""Acceptance over a response's sequences: ``protocol.acceptance.BatchSummary`` itself, so
the wire carries exactly the figures (and definitions) Prometheus exports."""


class SequenceOutput(BaseModel):
    """One generated sequence."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    weight_versions: list[WeightVersionSpan]
    spec_decode: SpecDecodeInfo | None


class GenerateResponse(BaseModel):
    """The ``n`` sequences of one prompt and their acceptance summary."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[SequenceOutput]
    acceptance: AcceptanceSummary
    replica: str | None = Field(None, description=(
        "Ray Serve: the replica that generated this response; None when standalone."))


class BatchGenerateRequest(BaseModel):
    """Many prompts in one call; the answer summarizes acceptance over all of them."""

    model_config = _STRICT

    requests: list[GenerateRequest] = Field(min_length=1, max_length=MAX_BATCH)


class BatchGenerateResponse(BaseModel):
    """One response per request, in order, and the batch's acceptance summary."""

    responses: list[GenerateResponse]
    acceptance: AcceptanceSummary
    acceptance_by_category: dict[str, AcceptanceSummary] = Field(default_factory=dict, description=(
        "The same summary over the sequences of each category the requests named (as named: "
        "not bounded like the metric labels); requests without one are left out here."))


ReplicaStatus = Literal["starting", "ok", "lagging", "unavailable", "gone"]


class SpeculationInfo(BaseModel):
    """The engine's speculative decoding, as ``/health`` reports it."""

    is_enabled: bool = Field(description=(
        "False: no drafter; sequences carry no acceptance stats and only target 'main' "
        "pushes are accepted."))
    method: str | None = Field(description=(
        "vLLM's speculative method ('mtp', 'ngram', 'suffix', 'eagle', ...) or SGLang's "
        "algorithm; None when off."))
    num_speculative_tokens: int = Field(description="Draft tokens per step; 0 when off.")
    has_pushable_drafter: bool = Field(description=(
        "Whether pushes with target 'draft' or 'both' are accepted: only an MTP drafter read "
        "from the served checkpoint can load a push (docs/weight-pushes.md)."))
    verify_cost_ratio: float | None = Field(None, description=(
        "A verify step's time over a plain decode step's, measured when the engine started "
        "(docs/telemetry.md); None when off or not measured."))


class ReplicaHealth(BaseModel):
    """One Ray Serve replica as it reports itself to the weights coordinator on every
    poll, and as ``/health`` lists it."""

    replica: str
    status: ReplicaStatus = Field(description=(
        "'starting' (engine loading), 'ok', 'lagging' (serves an older weight version than "
        "the deployment: refuses generation until the next push), 'unavailable' (engine dead; "
        "Ray Serve replaces it), 'gone' (stopped polling the coordinator)."))
    main_version: int | None = None
    draft_version: int | None = None
    detail: str | None = None
    pid: int | None = None
    metrics_address: str | None = Field(None, description="host:port of its /metrics.")
    group_ranks: int | None = Field(None, description=(
        "nccl: the ranks its engine's workers take in a weight group; None otherwise."))
    group_backend: Literal["nccl", "gloo"] | None = Field(None, description=(
        "nccl: its workers' collective backend."))
    store_address: str | None = Field(None, description=(
        "nccl: host:port where it serves its stored copy of the last push to replicas that "
        "(re)start (weights token required)."))
    speculation: SpeculationInfo | None = Field(None, description=(
        "Its engine's speculative decoding; None while the engine starts."))
    speculation_control: SpeculationControlStatus | None = Field(None, description=(
        "Its own speculation controller (each replica decides K from its own batches and "
        "acceptance); None when the control is off or the engine starts."))


class HealthResponse(BaseModel):
    """Service and engine state."""

    status: Literal["ok", "degraded", "unavailable"] = Field(description=(
        "'degraded' (Ray Serve only): some replicas serve, others do not (see replicas)."))
    model: str
    engine: str
    weights: WeightStatus
    speculation: SpeculationInfo | None = Field(None, description=(
        "The engine's speculative decoding (Ray Serve: the first serving replica's; "
        "every replica's is in replicas)."))
    speculation_control: SpeculationControlStatus | None = Field(None, description=(
        "The speculation controller's K per batch-size bucket and why; null when it is off "
        "(speculation_control.enabled). Ray Serve: the first serving replica's; every "
        "replica's is in replicas."))
    detail: str | None = None
    replicas: list[ReplicaHealth] | None = Field(None, description="Ray Serve only.")


class ErrorBody(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer: OpenAI's error shape, so OpenAI clients show the message."""

    error: ErrorBody


# --- Weight pushes (/weights/*): JSON control messages only --------------------
# Tensor bytes never travel in these messages: they go through the transport
# (a shared-memory segment on one host, or CUDA memory shared by IPC handles,
# described field by field in `CudaIpcHandle`). Nothing here is ever unpickled.

PushTarget = Literal["main", "draft", "both"]
PauseMode = Literal["wait", "abort", "keep"]
PushClient = Literal["rollout", "sglang", "vllm"]


class ParamSpec(BaseModel):
    """One tensor the push will carry, by its checkpoint (Hugging Face) name."""

    model_config = _STRICT

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

    model_config = _STRICT

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

    model_config = ConfigDict(**_STRICT, json_schema_extra=_TRANSPORT_FIELDS)

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
    total_bytes: Int | None = Field(None, gt=0, description=(
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


GROUP_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"
"""A group's name: a prefix of keys in the trainer's store."""
MAX_GROUP_TIMEOUT_S = 3600.0
MAX_BUCKETS_IN_FLIGHT = 8
"""Ring slots a group may ask each worker to hold: memory, not speed, is what they buy."""
GroupBackend = Literal["nccl", "gloo"]


class WeightGroupRequest(BaseModel):
    """The trainer's collective group for the ``nccl`` transport (``POST /weights/group``):
    the trainer hosts the rendezvous (a torch ``TCPStore``) and is rank 0; this service's
    engine workers (under Ray Serve, every replica's, one replica after the other) join
    at ``rank_offset``, ``rank_offset + 1``, ... A group has one owner: while it lives, a
    request for another group is refused (409) until the first is released
    (``POST /weights/group/release``) or goes ``lease_s`` without a call."""

    model_config = _STRICT

    group_id: str = Field(pattern=GROUP_ID_PATTERN, description=(
        "The group's name; pushes name it in begin, and it is the owner's key."))
    master_address: str = Field(min_length=1, max_length=253, description=(
        "Host of the trainer's rendezvous store, as this service's hosts reach it."))
    master_port: Int = Field(ge=1, le=65535, description="Port of the rendezvous store.")
    world_size: Int = Field(ge=2, le=1 << 20, description=(
        "Ranks in the group: the trainer and every receiver of every server it pushes to."))
    rank_offset: Int = Field(1, ge=1, le=1 << 20, description=(
        "The rank of this service's first worker (the trainer is 0); its workers take "
        "num_ranks consecutive ranks from here (GET /weights/group/state says how many)."))
    backend: GroupBackend | None = Field(None, description=(
        "torch.distributed backend: nccl for engines on CUDA, gloo on the CPU (how CI tests "
        "the same protocol); default: the engine's."))
    timeout_s: float | None = Field(None, gt=0, le=MAX_GROUP_TIMEOUT_S, description=(
        "How long a rank waits for the others in the join and in each bucket's broadcast; "
        "default: the service's weights_group_timeout_s."))
    lease_s: float | None = Field(None, gt=0, le=7 * 86400, description=(
        "The group is released after this long without a call naming it (a trainer that "
        "died without releasing it); default: the service's weights_group_lease_s."))
    bucket_bytes: Annotated[int, Field(ge=64, le=1 << 40), BeforeValidator(integral)] | None \
        = Field(None, description=(
        "The largest bucket the trainer broadcasts (each worker's ring slot size); "
        "default: the service's weights_bucket_bytes."))
    rendezvous: Literal["rollout", "torch", "vllm"] = Field("rollout", description=(
        "How the ranks meet in the trainer's store: 'rollout', this service's own trainer "
        "(WeightPusher: keys under group_id, a probe broadcast when all have joined); "
        "'torch', a trainer's torch.distributed group made as SGLang's "
        "init_custom_process_group makes it (slime, AReaL: torch's own key prefixes, no "
        "probe); 'vllm', vLLM's StatelessProcessGroup and PyNccl communicator "
        "(NCCLTrainerWeightTransferEngine: SkyRL, vLLM's examples; on the CPU a gloo "
        "stand-in over the same store). The last two are the dialects' weight routes'."))
    num_buckets: Annotated[int, Field(ge=1, le=MAX_BUCKETS_IN_FLIGHT),
                           BeforeValidator(integral)] | None = Field(None, description=(
        "Ring slots per worker: buckets received and not yet written to the server's "
        "stored copy; default: the service's weights_num_buckets."))


class GroupMember(BaseModel):
    """Ray Serve: one replica's ranks in the trainer's group."""

    replica: str
    rank_offset: int
    num_ranks: int


class WeightGroupResponse(BaseModel):
    """The group this service's workers are joining (``POST /weights/group``)."""

    group_id: str
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = Field(description="This service's first rank.")
    num_ranks: int = Field(description=(
        "Ranks this service's workers take from rank_offset (Ray Serve: every replica's)."))
    backend: GroupBackend
    timeout_s: float = Field(description=(
        "How long a rank waits for the others in the join and in each broadcast; a "
        "trainer gone longer than this fails its push and ends the group."))
    lease_s: float
    bucket_bytes: int
    num_buckets: int
    members: list[GroupMember] | None = Field(None, description=(
        "Ray Serve: each replica's ranks, in rank order."))


class WeightGroupState(BaseModel):
    """``GET /weights/group/state``: how many ranks this service needs in a group, and its
    current group (None when it has none)."""

    num_ranks: int = Field(description=(
        "Receiver ranks of this service (standalone: its engine's workers; Ray Serve: "
        "every serving replica's): a trainer's world_size counts them."))
    backend: GroupBackend
    current: WeightGroupResponse | None = None
    max_tensor_bytes: int | None = Field(None, description=(
        "The served checkpoint's largest tensor: the smallest bucket_bytes that takes a "
        "trainer's broadcast of one whole tensor (the frameworks' framing)."))


class WeightGroupRelease(BaseModel):
    """``POST /weights/group/release``: the owner lets its group go."""

    model_config = _STRICT

    group_id: str = Field(pattern=GROUP_ID_PATTERN)


class PushBeginResponse(BaseModel):
    push_id: str
    timeout_s: float = Field(description=(
        "The push is aborted after this long without a call (the begin's timeout_s, or the "
        "service's push_timeout_s)."))


CHECKSUM_PATTERN = r"^[0-9a-f]{16}$"
_WHOLE_WORDS_WITH_A_CHECKSUM = {
    "if": {"properties": {"checksum": {"type": "string"}}, "required": ["checksum"]},
    "then": {"properties": {"nbytes": {"multipleOf": 8}}}}
"""A bucket with a checksum is whole 64-bit words, in JSON Schema."""


class BucketInfo(BaseModel):
    """One bucket of a ``nccl`` push, as its ``/weights/update`` announces it and as the
    trainer's in-band header repeats it: a piece of the push's byte stream (the buckets of
    a push follow one another in the stream, from offset 0), its length and its checksum
    (``protocol.store.bucket_checksum``)."""

    model_config = ConfigDict(**_STRICT, frozen=True,
                              json_schema_extra=_WHOLE_WORDS_WITH_A_CHECKSUM)

    index: Int = Field(ge=0, description=(
        "The bucket's position in the push: 0 for the first update, then 1, 2, ..."))
    offset: Int = Field(ge=0, description=(
        "Where the bucket starts in the push's byte stream: at or past the previous "
        "bucket's end (this service's trainers send them back to back from 0)."))
    nbytes: Int = Field(gt=0, description=(
        "Bytes the trainer broadcasts for this bucket (at most the group's bucket_bytes; a "
        "multiple of 8 with a checksum)."))
    checksum: str | None = Field(pattern=CHECKSUM_PATTERN, description=(
        "The payload's checksum, 16 hex digits (docs/weight-pushes.md says how to compute "
        "it), sent again in the bucket's in-band header; checked by every receiver before "
        "anything of the push loads. null: the frameworks' framing, one collective of "
        "exactly nbytes with no header, whose length nothing can check (the dialects' "
        "weight routes; a trainer of this protocol sends a checksum)."))

    @model_validator(mode="after")
    def _whole_words(self) -> BucketInfo:
        if self.checksum is not None and self.nbytes % 8:
            raise ValueError(f"nbytes: {self.nbytes} is not a multiple of 8 (the checksum "
                             "runs over 64-bit words)")
        return self

    @property
    def checksum_value(self) -> int:
        assert self.checksum is not None
        return int(self.checksum, 16)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class PushUpdateRequest(BaseModel):
    """One bucket: these tensors are now in place (written in the segment, or exported
    as CUDA IPC handles), or, for ``nccl``, broadcast by the trainer while this call runs
    (``bucket`` says its length and checksum; ``buckets``, several collectives of the
    frameworks' framing in order)."""

    model_config = ConfigDict(**_STRICT, json_schema_extra={"not": {
        "required": ["bucket", "buckets"]}})

    push_id: str
    tensors: list[TensorPlacement] = Field(default_factory=list, description=(
        "The tensors now in place (nccl: those whose last byte is in this bucket; none "
        "when the bucket ends inside a tensor)."))
    bucket: BucketInfo | None = Field(None, description=(
        "nccl only (required there, or buckets): the bucket the trainer broadcasts during "
        "this call; every placement lies in it."))
    buckets: list[BucketInfo] | None = Field(None, min_length=1, max_length=1 << 16,
                                             description=(
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
    model_config = _STRICT

    push_id: str
    version: Int | None = Field(None, ge=0, description=(
        "The version to serve instead of begin's (the frameworks name it at the end: "
        "vLLM's finish_weight_update); newer than the served one of every target."))


class PushAbortRequest(BaseModel):
    model_config = _STRICT

    push_id: str
    reason: str = "aborted by the client"


class PushTimings(BaseModel):
    """Where a completed push spent its time (seconds)."""

    pause_s: float = Field(description="Pausing generation (mode 'wait' drains requests).")
    load_main_s: float = Field(description="Main model: segment -> parameters.")
    finalize_main_s: float = Field(description="Main model: engine post-processing.")
    load_draft_s: float = Field(description="Drafter: segment -> parameters.")
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


HealthResponse.model_rebuild()
