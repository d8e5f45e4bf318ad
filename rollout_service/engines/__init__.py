"""Engines behind the service: one protocol (``base``), one package per engine.

``speculative`` turns the user's engine kwargs and the service's MTP settings
into each engine's speculative-decoding config. Engine packages import their
engine (vLLM, SGLang) at import time, so they are imported only on demand
(``rollout_service.local.start_engine``), keeping ``import rollout_service`` light.
"""
