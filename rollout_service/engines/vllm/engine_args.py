"""What the service asks of vLLM at start: the engine args, and two facts about the engine
it got (whether pushes load in place, whether its drafter can load a push).

Runs in the service process (and in benchmarks that start the service's engine config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs

from rollout_service.engines.base import WeightsLoad
from rollout_service.engines.speculative import (
    MTPSettings,
    build_vllm_speculative_config,
    is_mtp_method,
)
from rollout_service.engines.vllm.plugin import BACKEND_OF_TRANSPORT

# Weight pushes go through vLLM's weight-transfer API with this project's `shm`
# or `cuda_ipc` backend (registered by the `vllm.general_plugins` entry point,
# chosen by `weights_transport`); the worker extension adds a checksum RPC used
# to prove rejected pushes change nothing.
_SERVICE_ENGINE_DEFAULTS: dict[str, Any] = {
    "worker_extension_cls": "rollout_service.engines.vllm.worker_ext.RolloutWorkerExtension",
}
# Per-request stats are what this service is for; "summary" has everything the
# telemetry needs without per-step arrays. Only with a speculative config: vLLM
# refuses them without one.
_SPECULATIVE_ENGINE_DEFAULTS: dict[str, Any] = {"per_request_spec_decode_metrics": "summary"}
_METRICS_FIELD = "per_request_spec_decode_metrics"


def build_engine_args(model: str, engine_kwargs: Mapping[str, Any], mtp: MTPSettings,
                      checkpoint_config: Mapping[str, Any] | None,
                      served_model_name: str | None = None,
                      weights_transport: str = "shm") -> AsyncEngineArgs:
    """Merge the user's engine kwargs with the service's MTP settings.

    The user's kwargs win except ``speculative_config``, which is merged key by
    key (see :mod:`rollout_service.engines.speculative`). ``weights_transport`` picks the
    vLLM weight-transfer backend (``plugin.BACKEND_OF_TRANSPORT``).

    Raises:
        ValueError: a bad speculative config or an engine kwarg vLLM does not know.
    """
    speculative_config = build_vllm_speculative_config(mtp, engine_kwargs, checkpoint_config)
    speculative_defaults = _SPECULATIVE_ENGINE_DEFAULTS if speculative_config else {}
    kwargs = {**_SERVICE_ENGINE_DEFAULTS, **speculative_defaults,
              "weight_transfer_config": {"backend": BACKEND_OF_TRANSPORT[weights_transport]},
              **engine_kwargs, "model": model, "speculative_config": speculative_config}
    if served_model_name is not None:
        # vLLM's own series then carry the same model name as this service's.
        kwargs.setdefault("served_model_name", served_model_name)
    metrics = kwargs.get(_METRICS_FIELD)
    if metrics == "none" and speculative_config:
        raise ValueError(f"engine_kwargs.{_METRICS_FIELD}: 'none' disables the "
                         "per-request acceptance this service exports; use 'summary' or "
                         "'detailed'")
    if metrics not in (None, "none") and not speculative_config:
        raise ValueError(f"engine_kwargs.{_METRICS_FIELD}: {metrics!r} needs speculative "
                         "decoding, which is off (mtp.enabled: false and no "
                         "engine_kwargs.speculative_config); leave it out")
    try:
        return AsyncEngineArgs(**kwargs)
    except TypeError as exc:
        raise ValueError(f"engine_kwargs: {exc} (accepted: the fields of vLLM's "
                         "AsyncEngineArgs)") from exc


def loads_in_place(weights_load: WeightsLoad, model_config: Any) -> bool:
    """Whether a push can be copied into the served parameters as they are.

    Only where vLLM uses weights as loaded: on CUDA, unquantized. vLLM's CPU build
    repacks every linear weight after loading and quantized methods transform theirs,
    so there the layerwise reload (which re-runs that processing) is the only correct
    load. ``tests/gpu`` checks that both loads leave identical parameters and outputs.
    """
    from vllm.platforms import current_platform

    return (weights_load == "auto" and current_platform.is_cuda()
            and getattr(model_config, "quantization", None) is None)


def has_pushable_drafter(speculative_config: Any, model_config: Any) -> bool:
    """Whether vLLM built a drafter that a push of the served checkpoint can load.

    That is an MTP drafter (method ``mtp``, to which vLLM maps the model-specific
    ``*_mtp`` names) read from the served checkpoint itself. vLLM can also draft with
    n-grams, suffix trees, a separate EAGLE or draft model...: none of them holds the
    checkpoint's tensors, so a drafter push has nothing to load.

    Args:
        speculative_config: vLLM's resolved ``SpeculativeConfig``, or None.
        model_config: vLLM's ``ModelConfig`` of the main model.
    """
    if speculative_config is None or not is_mtp_method(speculative_config.method):
        return False
    served = {model_config.model, getattr(model_config, "model_weights", None)} - {None, ""}
    return speculative_config.model in served
