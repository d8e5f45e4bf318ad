"""HTTP messages of the rollout service (pydantic); this package holds nothing else.

Shared by the server (``api``) and by clients (``client``, the trainer client, tools,
tests), so both sides validate the same shapes. Requests reject unknown fields and take
JSON types as they are (strict: ``"1"`` is not ``1``; an integer may be written ``3.0``,
as JSON Schema reads it); every constraint JSON Schema can state is on a field or the
model, so the OpenAPI document states it. One module per topic, each name defined in
exactly one of them:

- ``common``: the field types every message shares, and the error body;
- ``generation``: ``/generate`` and ``/generate_batch``;
- ``health``: ``/health``, with each Ray Serve replica's report;
- ``pushes``: the push protocol (``/weights/begin`` ... ``/weights/status``);
- ``groups``: the ``nccl`` transport's group (``/weights/group``) and its buckets.

This module only re-exports them, so ``messages.GenerateRequest`` and
``from rollout_service.protocol.messages import WeightStatus`` name the one definition.
OpenAI-shaped messages are in ``protocol/openai.py``.
"""

from __future__ import annotations

from rollout_service.protocol.messages.common import (
    CATEGORY_PATTERN,
    MAX_BATCH,
    MAX_N,
    MAX_SEED,
    MAX_STOP,
    MAX_TOP_K,
    RESERVED_CATEGORIES,
    STRICT,
    Category,
    Count,
    ErrorBody,
    ErrorResponse,
    Int,
    Seed,
    StopString,
    TokenId,
    integral,
    unreserved,
)
from rollout_service.protocol.messages.generation import (
    AcceptanceSummary,
    BatchGenerateRequest,
    BatchGenerateResponse,
    GenerateRequest,
    GenerateResponse,
    SamplingFields,
    SequenceOutput,
    SpecDecodeInfo,
    WeightVersionSpan,
)
from rollout_service.protocol.messages.groups import (
    CHECKSUM_PATTERN,
    GROUP_ID_PATTERN,
    MAX_BUCKETS_IN_FLIGHT,
    MAX_GROUP_TIMEOUT_S,
    BucketInfo,
    GroupBackend,
    GroupMember,
    WeightGroupRelease,
    WeightGroupRequest,
    WeightGroupResponse,
    WeightGroupState,
)
from rollout_service.protocol.messages.health import (
    HealthResponse,
    ReplicaHealth,
    ReplicaStatus,
    SpeculationInfo,
)
from rollout_service.protocol.messages.pushes import (
    MAX_MTP_DEPTHS,
    MAX_PUSH_TIMEOUT_S,
    Accuracy,
    ActivePushState,
    LastPush,
    ParamSpec,
    PauseMode,
    PushAbortRequest,
    PushBeginRequest,
    PushBeginResponse,
    PushClient,
    PushFinishRequest,
    PushFinishResponse,
    PushTarget,
    PushTimings,
    PushUpdateRequest,
    PushUpdateResponse,
    TrainingStats,
    WeightStatus,
    push_roles,
)

__all__ = [
    "AcceptanceSummary",
    "Accuracy",
    "ActivePushState",
    "BatchGenerateRequest",
    "BatchGenerateResponse",
    "BucketInfo",
    "CATEGORY_PATTERN",
    "CHECKSUM_PATTERN",
    "Category",
    "Count",
    "ErrorBody",
    "ErrorResponse",
    "GROUP_ID_PATTERN",
    "GenerateRequest",
    "GenerateResponse",
    "GroupBackend",
    "GroupMember",
    "HealthResponse",
    "Int",
    "LastPush",
    "MAX_BATCH",
    "MAX_BUCKETS_IN_FLIGHT",
    "MAX_GROUP_TIMEOUT_S",
    "MAX_MTP_DEPTHS",
    "MAX_N",
    "MAX_PUSH_TIMEOUT_S",
    "MAX_SEED",
    "MAX_STOP",
    "MAX_TOP_K",
    "ParamSpec",
    "PauseMode",
    "PushAbortRequest",
    "PushBeginRequest",
    "PushBeginResponse",
    "PushClient",
    "PushFinishRequest",
    "PushFinishResponse",
    "PushTarget",
    "push_roles",
    "PushTimings",
    "PushUpdateRequest",
    "PushUpdateResponse",
    "RESERVED_CATEGORIES",
    "ReplicaHealth",
    "ReplicaStatus",
    "STRICT",
    "SamplingFields",
    "Seed",
    "SequenceOutput",
    "SpecDecodeInfo",
    "SpeculationInfo",
    "StopString",
    "TokenId",
    "TrainingStats",
    "WeightGroupRelease",
    "WeightGroupRequest",
    "WeightGroupResponse",
    "WeightGroupState",
    "WeightStatus",
    "WeightVersionSpan",
    "integral",
    "unreserved",
]
