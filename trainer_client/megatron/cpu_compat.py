"""Run megatron-core 0.16 without CUDA: the project's one runtime patch for megatron-core.

Runs in a CPU process that builds Megatron modules (the tests, the local demo's
trainer), never on a GPU machine: with CUDA present :func:`megatron_on_cpu` patches
nothing. No communication of its own.

A small ``GPTModel`` with an MTP block (local spec, ``use_cpu_initialization=True``,
gloo) reaches CUDA in three ways on CPU, and so do ``roll_tensor`` under CP and
``MTPLossLoggingHelper``:

1. ``torch.cuda.current_device()`` is used as the device of buffers
   (``RotaryEmbedding.get_emb``, attention buffers, ``roll_tensor``'s CP receive
   buffers, the MTP logging tracker). Inside the context it returns ``"cpu"``. Megatron
   looks it up on the ``torch.cuda`` module at call time, so the patch is on that
   module: process-wide, for the duration of the context.
2. Attention dropout forks the CUDA RNG tracker (``CudaRNGStatesTracker.fork``). Inside
   the context the fork is a no-op: dropout draws from the CPU generator.
3. Activation recompute (``tensor_parallel.checkpoint``, ``recompute_granularity``)
   saves and restores the RNG states around the recomputed forward with
   ``_get_all_rng_states`` / ``_set_all_rng_states``, which read the CUDA generator.
   Inside the context they save and restore the CPU generator and the tracker's states
   (the ``cuda_rng_state`` slot holds None), so a recomputed dropout draws what the
   first forward drew. ``CheckpointFunction`` and ``_fork_rng`` look both up in their
   module at call time, so the replacement is on ``tensor_parallel.random``.

Supported: megatron-core :data:`SUPPORTED_MEGATRON_CORE_VERSIONS`. Any other version,
or a patched function whose signature changed, raises RuntimeError before anything is
patched.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from importlib import metadata

import torch

__all__ = ["SUPPORTED_MEGATRON_CORE_VERSIONS", "megatron_on_cpu"]

SUPPORTED_MEGATRON_CORE_VERSIONS = ("0.16.0", "0.16.1")
"""Versions whose three CUDA call sites above were read and tested on CPU."""


def _check_signature(fn: Callable[..., object], expected: list[str], what: str) -> None:
    names = list(inspect.signature(fn).parameters)
    if names != expected:
        raise RuntimeError(f"cpu_compat: {what} has parameters {names}, expected {expected}; "
                           "this patch does not support it")


def _cpu_current_device() -> str:
    return "cpu"


@contextlib.contextmanager
def _no_fork(self: object, name: str = "") -> Iterator[None]:
    del self, name
    yield


def _cpu_get_all_rng_states() -> tuple[torch.Tensor, None, dict]:
    from megatron.core.tensor_parallel import random as megatron_random

    return torch.get_rng_state(), None, megatron_random.get_cuda_rng_tracker().get_states()


def _cpu_set_all_rng_states(cpu_rng_state: torch.Tensor, cuda_rng_state: None,
                            cuda_rng_state_tracker: dict) -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    del cuda_rng_state
    torch.set_rng_state(cpu_rng_state)
    megatron_random.get_cuda_rng_tracker().set_states(cuda_rng_state_tracker)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Inside the context, megatron-core's CUDA-only calls above work on CPU.

    Does nothing when CUDA is available. Restores the originals on exit.

    Raises:
        RuntimeError: megatron-core is missing or not a supported version, or a patched
            function's signature is not the one this patch was written against.
    """
    if torch.cuda.is_available():
        yield
        return
    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError as exc:
        raise RuntimeError("cpu_compat needs megatron-core installed") from exc
    if version not in SUPPORTED_MEGATRON_CORE_VERSIONS:
        raise RuntimeError(f"cpu_compat supports megatron-core {SUPPORTED_MEGATRON_CORE_VERSIONS}, "
                           f"found {version}")
    from megatron.core.tensor_parallel import random as megatron_random

    tracker_cls = megatron_random.CudaRNGStatesTracker
    _check_signature(torch.cuda.current_device, [], "torch.cuda.current_device")
    _check_signature(tracker_cls.fork, ["self", "name"], "CudaRNGStatesTracker.fork")
    _check_signature(megatron_random._get_all_rng_states, [], "_get_all_rng_states")
    _check_signature(megatron_random._set_all_rng_states,
                     ["cpu_rng_state", "cuda_rng_state", "cuda_rng_state_tracker"],
                     "_set_all_rng_states")
    original_device, original_fork = torch.cuda.current_device, tracker_cls.fork
    original_get = megatron_random._get_all_rng_states
    original_set = megatron_random._set_all_rng_states
    torch.cuda.current_device = _cpu_current_device
    tracker_cls.fork = _no_fork
    megatron_random._get_all_rng_states = _cpu_get_all_rng_states
    megatron_random._set_all_rng_states = _cpu_set_all_rng_states
    try:
        yield
    finally:
        torch.cuda.current_device = original_device
        tracker_cls.fork = original_fork
        megatron_random._get_all_rng_states = original_get
        megatron_random._set_all_rng_states = original_set
