"""vLLM's weight-sync messages on the wire; this module holds only messages.

Mirrors vllm-project/vllm 0.32 ``vllm/entrypoints/rl/online/api_router.py``
(``/init_weight_transfer_engine {init_info}``, ``/update_weights {update_info}``,
``/finish_weight_update {weight_version}``) and the NCCL backend's infos
(``vllm/distributed/weight_transfer/nccl_common.py``, ``NCCLWeightTransferInitInfo``:
the rendezvous and, since 0.31, the packed framing; ``nccl_engine.py``,
``NCCLWeightTransferUpdateInfo``: names, dtype names, shapes, and in vLLM 0.30, which
SkyRL 0.4.0 pins, the packed framing too), as vLLM's ``NCCLTrainerWeightTransferEngine``
sends them through SkyRL 0.4.0's ``SkyrlWeightSyncClient`` or vLLM's own
``HTTPVLLMWeightSyncClient``. Fields outside these are ignored with a warning; pickled
IPC handles are refused, naming the field (nothing from the network is unpickled).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from rollout_service.api.dialects.weight_stream import DTYPE_PATTERN, WEIGHT_VERSION_PATTERN
from rollout_service.protocol.messages import Int, integral
from rollout_service.protocol.vllm_sampling import IgnoringExtras

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
"""vLLM's ``packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES``."""
DEFAULT_PACKED_NUM_BUFFERS = 2
PICKLED = ("ipc_handles_pickled", "ipc_handles")
"""update_info fields of vLLM's CUDA IPC backend: pickles (``ipc_handles_pickled``, which
vLLM unpickles with ``VLLM_ALLOW_INSECURE_SERIALIZATION``) or tuples of them."""
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(integral)]


def _null_only(description: str) -> Any:
    """A field the service refuses unless null: documented as null only, refused with a
    message that says what to use instead (its model's validator)."""
    return Field(None, json_schema_extra={"type": "null"}, description=description)


class NCCLInitInfo(IgnoringExtras):
    """``init_info`` of the NCCL backend: where the trainer's ``StatelessProcessGroup``
    is, this server's first rank, and the framing of its broadcasts. vLLM's
    ``master_address`` and ``master_port`` may be null beside a ``nccl_unique_id_b64``;
    that rendezvous is not taken here, so both are required."""

    master_address: str = Field(min_length=1, max_length=253)
    master_port: Int = Field(ge=1, le=65535)
    rank_offset: Int = Field(ge=1, le=1 << 20)
    world_size: Int = Field(ge=2, le=1 << 20)
    nccl_unique_id_b64: Any = _null_only(
        "vLLM's rendezvous for torch-free trainers; not taken here (null).")
    packed: bool = Field(False, description=(
        "Tensors back to back in chunks of more than packed_buffer_size_bytes, one "
        "broadcast each; false: one broadcast per tensor."))
    packed_buffer_size_bytes: Int = Field(DEFAULT_PACKED_BUFFER_SIZE_BYTES, ge=1,
                                          le=1 << 40)
    packed_num_buffers: Int = Field(DEFAULT_PACKED_NUM_BUFFERS, ge=1, le=8, description=(
        "Chunks in flight: the ring slots each worker receives into."))

    @model_validator(mode="after")
    def _rendezvous(self) -> NCCLInitInfo:
        if self.nccl_unique_id_b64 is not None:
            raise ValueError("nccl_unique_id_b64: not supported; give master_address and "
                             "master_port (vLLM's StatelessProcessGroup rendezvous)")
        return self


class InitWeightTransferEngineRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    init_info: NCCLInitInfo


class NCCLUpdateInfo(IgnoringExtras):
    """``update_info`` of the NCCL backend: the tensors broadcast during this call."""

    names: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(
        min_length=1, max_length=1 << 16)
    dtype_names: list[Annotated[str, Field(pattern=DTYPE_PATTERN)]] = Field(
        max_length=1 << 16)
    shapes: list[list[PositiveInt]] = Field(max_length=1 << 16, description=(
        "One per name; no dimension of 0 (the frameworks' framing cannot carry an empty "
        "collective)."))
    packed: bool | None = Field(None, description=(
        "vLLM 0.30's place for the framing; null: the init_info's."))
    packed_buffer_size_bytes: Annotated[int, Field(ge=1, le=1 << 40),
                                        BeforeValidator(integral)] | None = None
    packed_num_buffers: Annotated[int, Field(ge=1, le=8), BeforeValidator(integral)] | None \
        = None
    ipc_handles_pickled: Any = _null_only(
        "vLLM's CUDA IPC backend's pickled handles: refused (nothing from the network is "
        "unpickled); sync over the nccl group, or push through this service's cuda_ipc "
        "transport.")
    ipc_handles: Any = _null_only("As ipc_handles_pickled.")

    @model_validator(mode="after")
    def _no_pickles(self) -> NCCLUpdateInfo:
        for name in PICKLED:
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name}: pickled CUDA IPC handles are refused (this service unpickles "
                    "nothing from the network); sync over the nccl group "
                    "(init_weight_transfer_engine with master_address and master_port), or "
                    "push through this service's cuda_ipc transport (POST /weights/*, "
                    "trainer_client.push.WeightPusher(transport='cuda_ipc'))")
        return self


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    update_info: NCCLUpdateInfo | list[NCCLUpdateInfo]


class FinishWeightUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    weight_version: str | None = Field(None, pattern=WEIGHT_VERSION_PATTERN, description=(
        "The version the session makes: a decimal integer newer than the served one; "
        "null: the next one (a drafter session: the main model's)."))


class WeightsMessage(BaseModel):
    """vLLM's answer to its weight routes."""

    message: str


