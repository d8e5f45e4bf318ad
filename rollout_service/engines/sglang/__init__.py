"""SGLang behind the service: a server driven over its HTTP API.

- ``engine``: the :class:`~rollout_service.engines.base.Engine` over HTTP, and ``start``.
- ``launch``: the server's command line from the engine kwargs; start and stop it.
- ``features``: what the running server's ``/openapi.json`` says it accepts.
- ``stats``: ``meta_info`` of the three SGLang generations -> spec-decode counts.
- ``payload``: pushed tensors as ``/update_weights_from_tensor`` payloads.
"""
