"""The engine protocol: what the service needs from vLLM, SGLang or anything else.

Runs inside the rollout service process. An engine owns one inference engine
(which may spawn its own worker processes) and answers one sequence per
``generate`` call, so every sequence carries exact per-request spec-decode stats.
The HTTP layer never sees engine types: only the dataclasses below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rollout_service.telemetry import SpecDecodeStats
from rollout_service.weights.cuda_ipc import CudaIpcHandle


class InvalidRequestError(ValueError):
    """The request cannot be served as given (the HTTP layer answers 400)."""


class EngineUnavailableError(RuntimeError):
    """The engine is dead or shutting down (the HTTP layer answers 503)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingOptions:
    """Sampling for one sequence; engines translate it to their own type."""

    max_tokens: int
    """Tokens to generate at most."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept."""
    top_k: int = 0
    """Tokens kept by rank; 0 keeps all."""
    seed: int | None = None
    """Per-sequence seed for reproducible sampling."""
    stop: tuple[str, ...] = ()
    """Strings that end the sequence (not included in the text)."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence (benchmarks)."""
    logprobs: bool = False
    """Return the log-probability of each sampled token."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were produced by weights labelled ``version``."""

    version: str
    start: int
    end: int


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationResult:
    """One finished sequence."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    """``stop`` (end-of-sequence or a stop string), ``length``, or ``abort``."""
    logprobs: tuple[float, ...] | None
    """Log-probability of each sampled token, when asked for."""
    weight_versions: tuple[WeightVersionSpan, ...]
    """Which weight version produced which output tokens."""
    spec_decode: SpecDecodeStats | None
    """This sequence's acceptance counts; None when the engine gave none."""


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


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightUpdate:
    """A complete, validated set of checkpoint-named tensors: in a shared segment
    (``shm``) or behind CUDA IPC handles (``cuda_ipc``)."""

    segment: str | None
    """Shared-memory segment name (``shm``); None for ``cuda_ipc``."""
    tensors: tuple[tuple[str, str, tuple[int, ...], int | None], ...]
    """``(name, dtype name, shape, byte offset in the segment)`` per tensor; the offset is
    None for ``cuda_ipc``."""
    cuda_ipc_handles: tuple[CudaIpcHandle, ...] = ()
    """``cuda_ipc``: each tensor's handle, in ``tensors`` order; empty for ``shm``."""
    push_id: str = ""
    """The push this stream belongs to: an engine may open ``cuda_ipc`` handles once for
    the main model and keep them for the drafter's load of the same push."""
    target: str = "both"
    """``main``, ``draft`` or ``both``: which loads follow, so an engine knows the last
    one and releases what it opened after it."""

    @property
    def transport(self) -> str:
        return "cuda_ipc" if self.cuda_ipc_handles else "shm"

    def is_last_load(self, *, draft: bool) -> bool:
        """Whether the load of this model is the last of the push (drafter after main)."""
        return draft or self.target == "main"


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadTimings:
    """Where one model's load went (seconds)."""

    load_s: float
    """Reading the transport and copying into the model's (staged) parameters."""
    finalize_s: float
    """The engine's post-processing: placing and repacking the loaded layers."""


@runtime_checkable
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

    async def pause(self, mode: str = "wait") -> None:
        """Stop scheduling: ``wait`` drains running requests, ``abort`` aborts them,
        ``keep`` freezes them in place."""
        ...

    async def resume(self) -> None:
        """Resume scheduling after :meth:`pause`."""
        ...

    async def load_weights(self, update: WeightUpdate, *, draft: bool,
                           version: str | None) -> LoadTimings:
        """Load a full update into the main model (``draft=False``) or the MTP drafter.

        ``version`` (None: unchanged) labels the weights in later responses' version
        spans. Called only while generation is paused."""
        ...

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV computed with old weights."""
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
