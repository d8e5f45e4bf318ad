"""SGLang's weight-sync messages on the wire; this module holds only messages.

Mirrors sgl-project/sglang 0.5.23 ``python/sglang/srt/managers/io_struct.py``
(``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``DestroyWeightsUpdateGroupReqInput`` and their ``{success, message}`` outputs), as
slime (THUDM/slime ``slime/backends/sglang_utils/sglang_engine.py``) and AReaL 1.0.4
(``areal/engine/sglang_remote.py``) send them. SGLang parses these bodies with pydantic's
lax mode, and AReaL sends ``master_port`` as a string: the port takes a decimal string
as SGLang does (the schema says so). Fields outside these are ignored with a warning
(AReaL's ``pp_rank``), as for the dialect's other messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    WithJsonSchema,
)

from rollout_service.api.dialects.weight_stream import DTYPE_PATTERN, WEIGHT_VERSION_PATTERN
from rollout_service.protocol.messages import GROUP_ID_PATTERN, Int, integral
from rollout_service.protocol.vllm_sampling import IgnoringExtras


def _decimal(value: Any) -> Any:
    """``"29500"`` as 29500, as SGLang's lax parsing reads it; anything else as it is."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return integral(value)


_PORT_TEXT = (r"^([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]"
              r"|6553[0-5])$")
Port = Annotated[int, Field(ge=1, le=65535), BeforeValidator(_decimal), WithJsonSchema({
    "anyOf": [{"type": "integer", "minimum": 1, "maximum": 65535},
              {"type": "string", "pattern": _PORT_TEXT}]})]
"""A port, or its decimal string (AReaL's ``str(master_port)``)."""
GroupName = Annotated[str, Field(pattern=GROUP_ID_PATTERN, description=(
    "The group's name, the prefix of its keys in the trainer's store."))]


class InitWeightsUpdateGroupReqInput(IgnoringExtras):
    """``POST /init_weights_update_group``: join the trainer's group."""

    master_address: str = Field(min_length=1, max_length=253)
    master_port: Port
    rank_offset: Int = Field(ge=1, le=1 << 20)
    world_size: Int = Field(ge=2, le=1 << 20)
    group_name: GroupName = "weight_update_group"
    backend: Literal["nccl", "gloo"] = Field("nccl", description=(
        "nccl on GPUs; gloo where the engine runs on the CPU (how CI runs it)."))


class UpdateWeightsFromDistributedReqInput(IgnoringExtras):
    """``POST /update_weights_from_distributed``: these tensors, by the served
    checkpoint's names, are broadcast by the trainer while this call runs."""

    names: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(
        min_length=1, max_length=1 << 16)
    dtypes: list[Annotated[str, Field(pattern=DTYPE_PATTERN)]] = Field(max_length=1 << 16)
    shapes: list[list[Annotated[int, Field(ge=1), BeforeValidator(integral)]]] = Field(
        max_length=1 << 16, description=(
            "One per name; no dimension of 0 (the frameworks' framing cannot carry an "
            "empty collective)."))
    group_name: GroupName = "weight_update_group"
    flush_cache: bool = Field(True, description=(
        "Honoured at the commit: every load resets the prefix cache."))
    abort_all_requests: bool = Field(False, description=(
        "Abort every running request first (their tokens so far, finish reason abort)."))
    weight_version: str | None = Field(None, pattern=WEIGHT_VERSION_PATTERN, description=(
        "The version this update makes: a decimal integer, newer than the served one "
        "(None: the next one)."))
    load_format: Literal["flattened_bucket"] | None = Field(None, description=(
        "None: one broadcast per tensor; 'flattened_bucket': one broadcast of the tensors "
        "back to back (SGLang's FlattenedTensorBucket)."))
    selector: Literal["all"] = Field("all", description=(
        "Which runners load it: 'all' (main model and drafter from the one stream)."))
    torch_empty_cache: bool = False


class DestroyWeightsUpdateGroupReqInput(IgnoringExtras):
    """``POST /destroy_weights_update_group``."""

    group_name: GroupName = "weight_update_group"


class WeightsAnswer(BaseModel):
    """SGLang's answer to its weight routes: 200 with success true, else the error's
    status with success false and the reason."""

    success: bool
    message: str
