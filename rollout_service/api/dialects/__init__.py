"""The RL frameworks' wire dialects, each a thin layer over the one service object.

Runs in the service process (standalone, or the Ray Serve ingress). A dialect is a folder
of three modules, to be read side by side with the upstream router it mirrors:
``protocol.py`` (its request and response messages), ``serving.py`` (their translation to
the service's :class:`~rollout_service.choices.Choice` values and back) and ``router.py``
(the routes). Every dialect runs its requests through the same
:class:`~rollout_service.choices.Sequences` and the same generation control, so the same
validation, weight versions and acceptance telemetry hold whichever dialect a request came
through.

- ``vllm``: vLLM's RL server (SkyRL, AReaL's vLLM backend, vLLM's own tools): token-in/
  token-out ``/inference/v1/generate``, ``/pause``, ``/resume``, ``/abort_requests``...
  Its OpenAI routes with vLLM's extensions are ``api/openai.py`` over ``completions.py``.
- ``sglang``: SGLang's native server (slime, AReaL's SGLang backend, NeMo-RL):
  ``/generate``, ``/pause_generation``, ``/continue_generation``, ``/abort_request``...

Paths: only ``POST /generate`` is claimed twice, by the native API and by SGLang. Their
bodies never share a key (the native prompt is ``prompt`` / ``prompt_token_ids`` and it
refuses any other key; SGLang's is ``text`` / ``input_ids``), so the one handler picks the
dialect by the body's keys (``sglang.router.generate_dialect``): both frameworks point
their unmodified clients at the service's base URL, and no configuration is needed.
"""
