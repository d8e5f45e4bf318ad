"""The engine protocol: what the service needs from vLLM, SGLang or anything else.

Runs inside the rollout service process. An engine owns one inference engine
(which may spawn its own worker processes) and answers one sequence per
``generate`` or ``stream`` call, so every sequence carries exact per-request
spec-decode stats. The HTTP layer never sees engine types: only the types below and
the sequence values of ``engines.sequences`` (re-exported here).

Each engine package (``engines/vllm``, ``engines/sglang``) exposes
``async def start(spec: EngineSpec) -> Engine`` (:data:`EngineStarter`), called
inside the event loop that will serve the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from rollout_service.engines.sequences import (
    ChatTurn,
    GenerationDelta,
    GenerationResult,
    SamplingOptions,
)
from rollout_service.engines.speculative import MTPSettings
from rollout_service.protocol.cuda_ipc import CudaIpcHandle
from rollout_service.protocol.messages import PauseMode, PushTarget, push_roles
from rollout_service.protocol.placement import TensorPlacement, Transport
from rollout_service.protocol.store import StoreRef
from rollout_service.speculation.cost import StepCostSample

WeightsLoad = Literal["auto", "reload"]
"""How an engine loads a push: ``ServiceConfig.weights_load`` documents both."""

DrafterAtK0 = Literal["auto", "run", "skip"]
"""The drafter on steps at K = 0: ``SpeculationControlSettings.drafter_at_k0`` documents
each value."""

FullGraphPolicy = Literal["refuse", "align", "as_is"]
"""A run-time K schedule and FULL CUDA graphs: ``SpeculationControlSettings.full_cuda_graphs``
documents each value."""


class InvalidRequestError(ValueError):
    """The request cannot be served as given (the HTTP layer answers 400)."""


class EngineUnavailableError(RuntimeError):
    """The engine is dead or shutting down (the HTTP layer answers 503)."""


class ScheduleRefusedError(InvalidRequestError):
    """The engine refused a K schedule (malformed, or a K above its maximum) and runs the one
    it had (the HTTP layer answers 400)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineInfo:
    """Static facts the HTTP layer validates against."""

    model: str
    """Served model name."""
    engine: str
    """``vllm`` or ``sglang``."""
    model_path: str
    """The served checkpoint directory (weight pushes are validated against it)."""
    max_model_len: int
    """Prompt plus output tokens must fit in this."""
    vocab_size: int
    """Token ids must be below this."""
    num_speculative_tokens: int
    """Draft tokens per step; 0 when speculative decoding is off."""
    speculative_method: str | None
    """The speculative method the engine built (vLLM's ``mtp``, ``ngram``, ``suffix``,
    ``eagle``...; SGLang's algorithm); None when speculative decoding is off."""
    has_pushable_drafter: bool
    """Whether a weight push can load the drafter (targets ``draft`` and ``both``): an
    MTP drafter read from the served checkpoint, so the pushed checkpoint tensors are
    its tensors. Another drafter (n-gram, suffix, a separate EAGLE model) has nothing a
    push of the checkpoint could load."""
    world_size: int = 1
    """GPUs (processes) one engine instance runs on: tensor x pipeline parallel sizes
    (vLLM's ``/get_world_size``, SGLang's ``tp_size``)."""
    verify_cost_ratio: float | None = None
    """Time of a verify step with ``num_speculative_tokens`` drafts over a plain decode
    step, measured by the engine when it started (vLLM: ``engines/vllm/verify_cost.py``);
    None when speculation is off or the engine does not measure it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightUpdate:
    """A complete, validated push: every tensor's placement, loaded into the main model,
    the drafter, or both (one ``load_weights`` call for all of them)."""

    push_id: str
    """The push, as the engine's logs and the transports name it."""
    target: PushTarget
    """The models to load: ``main``, ``draft`` or ``both``."""
    transport: Transport
    """The transport of every placement (checked by the intake)."""
    tensors: tuple[TensorPlacement, ...]
    """Every tensor of the checkpoint, in announcement order."""
    cuda_ipc_buffer: CudaIpcHandle | None = None
    """``cuda_ipc``: the push's staging buffer, where the placements without a handle
    lie (begin's ``cuda_ipc_buffer``)."""
    store: StoreRef | None = None
    """``nccl``: the server's received copy of the push, where every placement's bucket
    lies (``protocol/store.py``)."""

    @property
    def loads_main(self) -> bool:
        return "main" in push_roles(self.target)

    @property
    def loads_draft(self) -> bool:
        return "draft" in push_roles(self.target)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadTimings:
    """Where one model's load went (seconds)."""

    load_s: float
    """Reading the transport and copying into the model's (staged) parameters."""
    finalize_s: float
    """The engine's post-processing: placing and repacking the loaded layers."""


NO_LOAD = LoadTimings(load_s=0.0, finalize_s=0.0)
"""A model the push did not load, or loaded inside the other model's load."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PushLoads:
    """Where one push's load went, per model."""

    main: LoadTimings = NO_LOAD
    draft: LoadTimings = NO_LOAD


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """Everything an engine needs to start, resolved from the service config."""

    model_path: str
    """The checkpoint directory to serve."""
    served_model_name: str
    """The name in responses and metric labels."""
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The user's engine arguments, passed through (``speculative_config`` is merged
    with :attr:`mtp`)."""
    mtp: MTPSettings = field(default_factory=MTPSettings)
    """MTP speculative decoding settings."""
    checkpoint_config: Mapping[str, Any] | None = None
    """The checkpoint's ``config.json`` (MTP layer count), when it has one."""
    weights_transport: Transport = "shm"
    """The data path of weight pushes the engine must be able to load."""
    weights_load: WeightsLoad = "auto"
    """How a push is loaded (``ServiceConfig.weights_load``)."""
    engine_url: str | None = None
    """SGLang: a running server to drive instead of launching one."""
    verify_cost_batch_size: int = 8
    """Sequences per dummy batch when the engine measures a verify step's cost; 0 skips
    the measurement (``TelemetryConfig.verify_cost_batch_size``)."""
    runtime_spec_schedule: bool = False
    """Start so that the number of draft tokens per batch size can change at run time
    (:class:`SpecScheduleEngine`), and measure step costs; the speculation control
    (``speculation_control.enabled``) needs it."""
    drafter_at_k0: DrafterAtK0 = "run"
    """vLLM with ``runtime_spec_schedule``: whether steps at K = 0 run the drafter
    (``speculation_control.drafter_at_k0``; ``engines/vllm/drafter_at_k0.py``)."""
    full_cuda_graphs: FullGraphPolicy = "align"
    """vLLM on CUDA: a run-time schedule's FULL CUDA graphs
    (``speculation_control.full_cuda_graphs``; ``engines/vllm/graph_policy.py``)."""


def check_prompt(info: EngineInfo, prompt_ids: Sequence[int], max_tokens: int) -> None:
    """Refuse a prompt the engine cannot serve, naming why (shared by every engine).

    Raises:
        InvalidRequestError: an empty prompt, a token outside the vocabulary, or a
            prompt plus ``max_tokens`` beyond the context.
    """
    if not prompt_ids:
        raise InvalidRequestError("prompt: empty (it must hold at least one token)")
    bad = next((t for t in prompt_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt_token_ids: token id {bad} is outside the "
                                  f"vocabulary [0, {info.vocab_size})")
    if len(prompt_ids) + max_tokens > info.max_model_len:
        raise InvalidRequestError(f"prompt: {len(prompt_ids)} prompt tokens + max_tokens "
                                  f"{max_tokens} exceed the model's context length "
                                  f"{info.max_model_len}")


class Engine(Protocol):
    """An inference engine behind the service."""

    info: EngineInfo

    async def generate(self, prompt: str | list[int], sampling: SamplingOptions,
                       request_id: str) -> GenerationResult:
        """Generate one sequence.

        Raises:
            InvalidRequestError: the prompt or options cannot be served.
            EngineUnavailableError: the engine is dead.
        """
        ...

    def stream(self, prompt: str | list[int], sampling: SamplingOptions,
               request_id: str) -> AsyncIterator[GenerationDelta]:
        """Generate one sequence as it is produced (an async generator).

        The last delta carries the finished :class:`GenerationResult`, the same one
        :meth:`generate` returns for the same prompt and options. Closing the iterator
        before then aborts the engine request.

        Raises (from the iteration):
            InvalidRequestError: the prompt or options cannot be served.
            EngineUnavailableError: the engine is dead.
        """
        ...

    async def chat_prompt(self, turns: Sequence[ChatTurn]) -> list[int]:
        """The prompt of a conversation: the served checkpoint's chat template applied
        (with the generation prompt), as token ids.

        Raises:
            InvalidRequestError: the checkpoint has no chat template (naming
                ``messages``), or the template refuses these turns.
        """
        ...

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these engine requests (ids of :meth:`generate` / :meth:`stream` calls;
        unknown or finished ones are ignored). Each ends as a result with finish reason
        ``abort`` and the tokens it had generated; returns once the engine was told."""
        ...

    async def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text on its own (for log-probabilities shown by token)."""
        ...

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text`` as the served checkpoint's tokenizer splits it (vLLM's ``/tokenize``)."""
        ...

    async def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids as text (vLLM's ``/detokenize``)."""
        ...

    async def pause(self, mode: PauseMode = "wait") -> int:
        """Stop scheduling: ``wait`` drains running requests, ``abort`` aborts them,
        ``keep`` freezes them in place.

        Returns:
            The requests still unfinished once paused, which finish on the weights loaded
            next: with ``keep`` the frozen ones, with ``wait`` those queued meanwhile.
        """
        ...

    async def resume(self) -> None:
        """Resume scheduling after :meth:`pause`."""
        ...

    async def load_weights(self, update: WeightUpdate, *, version: str) -> PushLoads:
        """Load a full update into the models ``update.target`` names: the main model, the
        MTP drafter, or both, in one call, so that an engine able to load both in one
        pass (SGLang) keeps no state between two calls.

        ``version`` labels the main model's weights in later responses' version spans (a
        drafter-only push leaves them as they are: verification keeps the output
        distribution the main model's alone). Called only while generation is paused, and
        with a drafter target only when ``info.has_pushable_drafter``."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Drop cached KV computed with old weights.

        Returns:
            False when the engine refused because running requests hold cached blocks
            (vLLM; the caller may retry); True once dropped.
        """
        ...

    async def weight_checksums(self) -> dict[str, str]:
        """A digest of the main model's (``main``) and drafter's (``draft``) parameters."""
        ...

    async def health(self) -> None:
        """Return if the engine can serve; raise EngineUnavailableError if not."""
        ...

    async def shutdown(self) -> None:
        """Release the engine and its worker processes."""
        ...


StepCostSink = Callable[[StepCostSample], None]
"""Takes one engine step's measured cost; called often, so it must be quick."""


@runtime_checkable
class SpecScheduleEngine(Protocol):
    """An engine whose number of draft tokens K per batch size changes at run time (vLLM
    0.32.0 started with :attr:`EngineSpec.runtime_spec_schedule`), for the speculation
    control."""

    info: EngineInfo
    skips_drafter_at_k0: bool
    """Steps at K = 0 run nothing of the drafter (``drafter_at_k0`` as the engine resolved
    it at its start)."""

    async def apply_spec_schedule(self, schedule: Mapping[int, int]) -> dict[int, int]:
        """Run ``schedule`` (bucket upper edge -> K; past the last edge, the last K) from
        the engine's next step on.

        Returns:
            The schedule in force, as the engine reads it back (merged runs).

        Raises:
            ScheduleRefusedError: malformed, or a K above ``info.num_speculative_tokens``;
                the previous schedule stays in force.
            EngineUnavailableError: the engine is dead.
        """
        ...

    def subscribe_step_costs(self, sink: StepCostSink) -> None:
        """Send the measured cost of every clean decode step to ``sink`` from now on."""
        ...

    @property
    def batch_size(self) -> int:
        """Requests in the engine's last step with outputs (0 before any)."""
        ...

    async def generate(self, prompt: str | list[int], sampling: SamplingOptions,
                       request_id: str) -> GenerationResult:
        """As :meth:`Engine.generate` (the start-up calibration runs synthetic batches)."""
        ...


EngineStarter = Callable[[EngineSpec], Awaitable[Engine]]
"""``start`` of an engine package: the engine, running, inside the caller's event loop."""
