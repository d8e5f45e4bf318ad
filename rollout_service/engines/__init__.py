"""Engines behind the service: one protocol (``base``), one module per engine.

Engine modules import their engine (vLLM, SGLang) at import time, so they are
imported only here, on demand, keeping ``import rollout_service`` light.
"""

from __future__ import annotations

from rollout_service.config import ServiceConfig
from rollout_service.engines.base import Engine


async def create_engine(config: ServiceConfig) -> Engine:
    """Start the engine the config names (inside the serving event loop).

    Raises:
        ValueError: a config the engine rejects (the message names the field).
    """
    from rollout_service.speculative import load_checkpoint_config

    model_path, engine_kwargs = config.resolve_model()
    checkpoint_config = load_checkpoint_config(model_path)
    if config.engine == "vllm":
        from rollout_service.engines.vllm import VLLMEngine, build_engine_args

        args = build_engine_args(model_path, engine_kwargs, config.mtp, checkpoint_config,
                                 served_model_name=config.model_name,
                                 weights_transport=config.weights_transport)
        return VLLMEngine.start(args, served_model_name=config.model_name)
    if config.engine == "sglang":
        from rollout_service.engines.sglang import SGLangEngine

        if config.engine_url is not None:
            return await SGLangEngine.connect(config.engine_url,
                                              served_model_name=config.model_name,
                                              model_path=model_path)
        return await SGLangEngine.launch(model_path, engine_kwargs, config.mtp,
                                         served_model_name=config.model_name)
    raise ValueError(f"engine: {config.engine!r} is not supported (accepted: 'vllm', 'sglang')")
