"""The ``nccl`` transport's messages: the trainer's collective group (``/weights/group``)
and the buckets it broadcasts in it.

Part of :mod:`rollout_service.protocol.messages`. The group is the trainer's: it hosts
the rendezvous and is rank 0; the service's workers join it (docs/weight-pushes.md). A
bucket is announced here as JSON; its bytes travel only in the group's collectives.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from rollout_service.protocol.messages.common import STRICT, Int, integral

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

    model_config = STRICT

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
        "the same protocol; an SGLang server's rank also takes gloo on CUDA, receiving on "
        "the CPU); default: the engine's (GET /weights/group/state)."))
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

    model_config = STRICT

    group_id: str = Field(pattern=GROUP_ID_PATTERN)


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

    model_config = ConfigDict(**STRICT, frozen=True,
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
