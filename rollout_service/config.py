"""The service configuration: one pydantic model, loadable from YAML or JSON.

Read by the ``rollout-service`` CLI (and, extended, by the Ray Serve app builder) in
the service process before the engine starts; every field is validated there, so
a bad config fails at startup with the field's name, not at the first request.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from rollout_service.engines.base import DrafterAtK0, FullGraphPolicy, WeightsLoad
from rollout_service.engines.speculative import MTPSettings
from rollout_service.telemetry.config import TelemetryConfig

EMBEDDED_PREFIX = "embedded:"
API_KEY_ENV = "ROLLOUT_API_KEY"
WEIGHTS_TOKEN_ENV = "ROLLOUT_WEIGHTS_TOKEN"

# What the embedded default needs on a small CPU machine: eager mode skips minutes
# of torch.compile at startup; an explicit KV-cache size stops vLLM's CPU backend
# from reserving a fraction of the node's memory (its default 0.92 fails whenever
# anything else is running) and skips the warm-up pass; float32 runs about 2x
# faster than bf16 on CPUs without AVX-512 bf16 (the checkpoint, and so weight
# pushes, stay bf16: vLLM converts on load).
EMBEDDED_ENGINE_KWARGS: dict[str, Any] = {
    "max_model_len": 1024,
    "enforce_eager": True,
    "kv_cache_memory_bytes": 512 * 1024**2,
    "dtype": "float32",
}
# The same for an SGLang server (GPU only): its context length alone. vLLM's keys above are
# not SGLang server arguments (its argparse refuses --max-model-len and the others), and
# float32 would not run on SGLang's FA3 attention; the checkpoint is bf16, which SGLang's
# dtype "auto" keeps.
EMBEDDED_SGLANG_ENGINE_KWARGS: dict[str, Any] = {"context_length": 1024}


class CalibrationSettings(BaseModel):
    """The start-up measurement of the step cost c(K, B) (docs/speculation-control.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description=(
        "Measure c(K, B) before serving; off, every bucket runs K = 0 ('no cost data') "
        "until live steps have measured K = 0 and another K at some batch size, which K = 0 "
        "alone never does: leave it on unless a benchmark pins the schedule."))
    max_batch_size: int = Field(32, ge=1, description=(
        "Largest batch size measured; the grid is 1, 2, 4, ... up to it. Buckets above it "
        "run K = 0 ('no cost data') until live steps at K = 0 reach them; then a K > 0 is "
        "priced from its measured ratio to K = 0 at the nearest batch size measured for "
        "both, in the bucket below at the farthest ('step cost extrapolated'), until its "
        "own steps there measure it."))
    prompt_tokens: int = Field(64, ge=1, description=(
        "Prompt length of the synthetic requests (a step's cost grows with context)."))
    num_steps: int = Field(16, ge=4, description=(
        "Decode steps measured per (K, B) point at its full batch size; the point's cost is "
        "their median."))


class SpeculationControlSettings(BaseModel):
    """The speculation controller: K per batch-size bucket from live acceptance and
    measured step costs, applied to the running vLLM engine (docs/speculation-control.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description=(
        "Run the controller (vLLM 0.32.0 with MTP only). Off, vLLM runs "
        "num_speculative_tokens at every batch size."))
    batch_size_buckets: list[int] = Field(
        [1, 2, 4, 8, 16, 32, 64, 128, 256], min_length=1, description=(
            "Upper edges of the batch-size buckets, strictly increasing: a bucket covers the "
            "batch sizes above the previous edge up to its own, the last one everything "
            "above too. K is decided per bucket, at its edge."))
    calibration: CalibrationSettings = Field(default_factory=CalibrationSettings,
                                             description="The start-up cost measurement.")
    num_steps_per_cost_sample: int = Field(16, ge=1, description=(
        "Live refresh: clean decode steps of one K and batch-size band (four per "
        "doubling of B) folded into one cost sample (their median cost at their median "
        "B), which blends into the table."))
    margin: float = Field(0.05, ge=0, description=(
        "Relative throughput a better K must win by before it replaces the K in force."))
    num_confirmations: int = Field(4, ge=1, description=(
        "Consecutive decisions (one per finished sequence) the win must last."))
    collapse_window_drafts: int = Field(128, ge=1, description=(
        "Drafts pooled by the collapse rule (the last drafted sequences that hold this "
        "many); also the bound, in drafts of a broken drafter, on reaching K = 0. Fewer "
        "misjudge a working drafter where sequences draft little (a rollout's tail)."))
    collapse_threshold_rate: float = Field(0.1, gt=0, lt=1, description=(
        "Pooled first-position acceptance below which the drafter counts as broken."))
    reprobe_after_s: float | None = Field(300.0, gt=0, description=(
        "Seconds in collapse after which the same drafter is probed again; null: only a "
        "drafter push ends a collapse."))
    probe_max_batch_size: int = Field(4, ge=1, description=(
        "Buckets up to this batch size run K >= 1 while a new drafter is probed (and, "
        "while nothing is known of its acceptance, after 8 sequences without a draft, "
        "those up to the load's batch size)."))
    probe_num_drafts: int = Field(256, ge=1, description=(
        "Drafts of a new drafter after which probing ends."))
    drafter_at_k0: DrafterAtK0 = Field("auto", description=(
        "The drafter on steps at K = 0. run: vLLM's own behaviour, the drafter runs every "
        "step and keeps its KV cache in step, so K = 0 costs about one drafter pass. skip: "
        "nothing of the drafter runs (vLLM 0.32.0's model runner V2 on CUDA only; refused "
        "elsewhere, naming this field); the positions generated at K = 0 leave the "
        "drafter's cache stale, which may lower its acceptance once K comes back. auto "
        "(the default): skip where the engine can, else run, logged; /health's "
        "speculation_control.drafter_at_k0 says which runs. On an H100 skip's K = 0 ran "
        "faster than run's at every level measured (docs/speculation-benchmark.md)."))
    full_cuda_graphs: FullGraphPolicy = Field("align", description=(
        "The controller on a CUDA engine whose CUDA graphs include FULL ones (vLLM's "
        "default FULL_AND_PIECEWISE). With its default capture sizes vLLM 0.32.0 died of an "
        "illegal memory access when K changed under load, by our reading at batch sizes "
        "where the MTP drafter replays a FULL graph captured for more requests than the "
        "target ran (docs/speculation-control.md, the crash on the H200). align (the "
        "default): the capture sizes are rounded to "
        "multiples of every query length K + 1, with which the drafter always replays the "
        "target's graph, and checked at start-up (H200: 1000 random K changes under 256 "
        "requests, no error). refuse: that start is refused, naming this field. as_is: "
        "vLLM's sizes, accepting the risk (the benches that reproduce the crash), with a "
        "warning naming the batch sizes at risk. Also read with the controller off, for a "
        "K schedule of the user's own (engine_kwargs.speculative_config."
        "num_speculative_tokens_per_batch_size): align aligns it (small batches pad to the "
        "multiple) and refuses one whose multiple passes 60; refuse and as_is warn."))

    @field_validator("batch_size_buckets")
    @classmethod
    def _increasing(cls, buckets: list[int]) -> list[int]:
        if buckets[0] < 1 or any(b <= a for a, b in zip(buckets, buckets[1:])):
            raise ValueError(f"must be >= 1 and strictly increasing, got {buckets}")
        return buckets

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "collapse_window_observations" in data:
            raise ValueError("collapse_window_observations (sequences) was replaced by "
                             "collapse_window_drafts (drafts, 128 by default): a window of "
                             "sequences that draft a few times each misread a working "
                             "drafter as collapsed")
        return data

    @model_validator(mode="after")
    def _skip_needs_the_controller(self) -> SpeculationControlSettings:
        if self.drafter_at_k0 == "skip" and not self.enabled:  # auto there: run, as it must
            raise ValueError("drafter_at_k0: 'skip' acts on the steps the controller puts at "
                             "K = 0; it needs enabled: true")
        return self


class ServiceConfig(BaseModel):
    """Everything one rollout service replica needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        f"{EMBEDDED_PREFIX}tiny",
        description=("A local checkpoint directory, or 'embedded:<size>' (tiny, small, 1b, 7b) "
                     "for the generated MiMo checkpoints (built and cached on first use)."))
    served_model_name: str | None = Field(
        None, description="Name in responses and metrics labels; defaults to the model field.")
    engine: Literal["vllm", "sglang"] = Field("vllm", description=(
        "Inference engine behind the service: vLLM in this process (AsyncLLM), or an SGLang "
        "server driven over HTTP."))
    engine_url: str | None = Field(None, description=(
        "SGLang only: URL of a running SGLang server to drive; None launches one from the "
        "built server arguments."))
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=("Passed to the engine as is (vLLM: AsyncEngineArgs fields), except "
                     "'speculative_config', which is merged with 'mtp'; SGLang: server "
                     "arguments, as launch_server's flags with underscores. For the embedded "
                     f"model, {EMBEDDED_ENGINE_KWARGS} (vLLM) or "
                     f"{EMBEDDED_SGLANG_ENGINE_KWARGS} (SGLang) are the defaults."))
    mtp: MTPSettings = Field(default_factory=MTPSettings,
                             description="MTP speculative decoding settings.")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description=(
        "Request categories on the acceptance series, the start-up measurement of a "
        "verify step's cost, trainer-side accuracy kept (docs/telemetry.md)."))
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port; 0 picks a free one.")
    http_keep_alive_s: int = Field(90, ge=1, description=(
        "Seconds an idle HTTP connection is kept open. Longer than the 5 s idle expiry of "
        "common clients (httpx, aiohttp), so a client never reuses a connection the server "
        "has just closed (a request lost to a ReadError); Ray Serve's default too."))
    http_access_log: bool = Field(True, description=(
        "One log line per request: uvicorn's access log on the standalone service (as "
        "`vllm serve` and SGLang's server log by default), Ray Serve's access log of the "
        "ingress and engine replicas under Ray Serve. False drops that line's formatting "
        "and write from every request; the Prometheus counters still count each one."))
    engine_start_timeout_s: float | None = Field(1800.0, gt=0, description=(
        "The engine must be serving this many seconds after its start began, or its "
        "processes are stopped and the service exits with an error naming this field "
        "(vLLM waits for its engine process without a deadline). None: wait forever."))
    api_key: SecretStr | None = Field(
        None, description=(f"Bearer token required on generation endpoints; falls back to "
                           f"${API_KEY_ENV}; none means open."))

    weights_token: SecretStr | None = Field(
        None, description=(f"Bearer token required on /weights/*; falls back to "
                           f"weights_token_file, then ${WEIGHTS_TOKEN_ENV}. Without any, weight "
                           "pushes are refused (403)."))
    weights_token_file: Path | None = Field(
        None, description="File holding the weights token (first line), e.g. a mounted secret.")
    dialect_weights_auth: Literal["weights_token", "none"] = Field(
        "weights_token", description=(
            "Who may call the dialects' weight routes (SGLang's /init_weights_update_group, "
            "/update_weights_from_distributed...; vLLM's /init_weight_transfer_engine, "
            "/update_weights...): 'weights_token', the weights token as a bearer token or "
            "as the password of the server URL (http://weights:<token>@host:port); "
            "'none', anyone who reaches the port, for clients that can send nothing "
            "(slime), behind the engine's own network boundary."))
    push_timeout_s: float = Field(
        60.0, gt=0, description=("A weight push with no call from the trainer for this long is "
                                 "aborted; the old weights stay served."))
    weights_transport: Literal["shm", "cuda_ipc", "nccl"] = Field("shm", description=(
        "Data path of weight pushes, and the vLLM weight-transfer backend the engine starts "
        "with: 'shm' (a shared-memory segment on this host; CPU or GPU), 'cuda_ipc' (CUDA "
        "IPC handles; trainer and engine on the same GPU: vLLM's CUDA build or SGLang, "
        "standalone) or 'nccl' (the trainer broadcasts each bucket to every engine worker in "
        "a collective group it owns and this service joins through POST /weights/group: "
        "NCCL on CUDA, gloo on the CPU; a trainer on any host; standalone or under Ray "
        "Serve; vLLM's workers join the group, and for SGLang this service process joins it "
        "and SGLang loads from the copy it received). A push announcing another transport is "
        "refused (400)."))
    weights_group_timeout_s: float = Field(60.0, gt=0, description=(
        "nccl only: how long the group's join and each bucket's broadcast wait for the "
        "other ranks, unless the trainer's group asks for another (timeout_s). A trainer "
        "silent for longer fails its push (nothing loaded) and ends the group; the "
        "trainer's next push makes a new one."))
    weights_group_lease_s: float = Field(3600.0, gt=0, description=(
        "nccl only: a group with no call naming it for this long is released (its trainer "
        "died without releasing it), unless the group asks for another lease (lease_s); "
        "until then a second trainer's group is refused (409)."))
    weights_bucket_bytes: int = Field(256 * 1024**2, ge=64, description=(
        "nccl only: the largest bucket a trainer may broadcast, unless its group asks for "
        "another (bucket_bytes): the size of each worker's receive slots."))
    weights_num_buckets: int = Field(2, ge=1, le=8, description=(
        "nccl only: receive slots per engine worker (a ring: with 2, the next bucket "
        "arrives while the last one is written to the stored copy), unless the group asks "
        "for another number (num_buckets). A worker's receive memory is at most this many "
        "buckets."))
    weights_store_dir: Path | None = Field(None, description=(
        "nccl only: the folder where each push's received copy is stored on this host (the "
        "push loads from it; the served version's copy stays until the next push, for "
        "replicas that restart). Not under /dev/shm. Default: a new temporary folder."))
    weights_load: WeightsLoad = Field("auto", description=(
        "How vLLM loads a push. 'reload': vLLM's layerwise reload (re-initialises each layer "
        "and re-runs its post-load processing: needed where vLLM transforms weights after "
        "loading, as its CPU build and quantized checkpoints do). 'auto': the same, except "
        "on CUDA with an unquantized model, where the pushed tensors are copied into the "
        "served parameters in place (weights used as loaded; several times faster). The "
        "SGLang engine ignores it."))

    speculation_control: SpeculationControlSettings = Field(
        default_factory=SpeculationControlSettings, description=(
            "Choose the number of draft tokens per batch size at run time "
            "(docs/speculation-control.md); off by default."))

    @model_validator(mode="after")
    def _speculation_control_engine(self) -> ServiceConfig:
        if not self.speculation_control.enabled:
            return self
        if self.engine != "vllm":
            raise ValueError(f"speculation_control.enabled: needs engine 'vllm' (its "
                             f"run-time K schedule), not {self.engine!r}")
        if not self.mtp.enabled and not self.engine_kwargs.get("speculative_config"):
            raise ValueError("speculation_control.enabled: needs speculative decoding "
                             "(mtp.enabled or engine_kwargs.speculative_config)")
        return self

    @property
    def model_name(self) -> str:
        """The name clients and metrics see."""
        return self.served_model_name or self.model

    def resolved_api_key(self) -> str | None:
        """The generation API key from the config or the environment."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(API_KEY_ENV) or None

    def resolved_weights_token(self) -> str | None:
        """The weight-push token from the config, its file, or the environment.

        Raises:
            ValueError: the token file cannot be read or is empty.
        """
        if self.weights_token is not None:
            return self.weights_token.get_secret_value()
        if self.weights_token_file is not None:
            try:
                token = self.weights_token_file.read_text().strip()
            except OSError as exc:
                raise ValueError(f"weights_token_file: {exc}") from exc
            if not token:
                raise ValueError(f"weights_token_file: {self.weights_token_file} is empty")
            return token
        return os.environ.get(WEIGHTS_TOKEN_ENV) or None

    def resolve_model(self) -> tuple[str, dict[str, Any]]:
        """The checkpoint path and engine kwargs with the embedded defaults applied.

        Raises:
            ValueError: an unknown embedded size or a missing checkpoint directory.
        """
        if not self.model.startswith(EMBEDDED_PREFIX):
            if not Path(self.model).is_dir():
                raise ValueError(f"model: {self.model!r} is not a local checkpoint directory")
            return self.model, dict(self.engine_kwargs)
        from rollout_service.embedded import ensure_model

        size = self.model.removeprefix(EMBEDDED_PREFIX)
        path = ensure_model(size)
        defaults = (EMBEDDED_SGLANG_ENGINE_KWARGS if self.engine == "sglang"
                    else EMBEDDED_ENGINE_KWARGS)
        return str(path), {**defaults, **self.engine_kwargs}


def load_config(path: str | Path | None = None, **overrides: Any) -> ServiceConfig:
    """Load a config file (YAML or JSON) and apply non-None overrides.

    Raises:
        ValueError: unreadable file or invalid fields (pydantic names each field).
    """
    data = read_config_file(path) if path is not None else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ServiceConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"invalid service config: {exc}") from exc


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML (``.yaml``/``.yml``) or JSON config file.

    Raises:
        ValueError: the file does not hold a mapping.
    """
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a mapping of fields")
    return data
