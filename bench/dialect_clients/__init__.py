"""The RL frameworks' own rollout clients against the service: does each one work unmodified?

Runs in the caller's terminal process (``python -m bench.dialect_clients``). Against a
running service (``--url``) or one it starts itself (default: ``rollout-service serve`` on
the embedded tiny model, MTP with k = 2, as a child process), it sends each framework's
HTTP calls in the exact shapes of its published source, reads back the response fields
that source reads, and prints one row per client: ``client | dialect | calls | result``
(``ok``, or each failing call with its status and message). The exit status is 1 when any
call failed.

Each client runs in one of two ways (``--mode``):

- ``real``: the framework's own code, imported as published, drives the calls: vLLM's
  benchmark client (:mod:`.vllm_bench`), SkyRL's ``RemoteInferenceClient``
  (:mod:`.skyrl`), AReaL's ``SGLangBackend`` / ``VLLMBackend`` request builders and parsers
  with its own ``ModelRequest`` (:mod:`.areal`), slime's ``sglang_rollout.generate`` /
  ``generate_streaming`` / ``server_control`` / ``SGLangEngine`` / ``external`` calls
  (:mod:`.slime_real`), NeMo-RL's ``SGLangGeneration`` request path (:mod:`.nemo`). None of
  them is vendored here: install them beside this package to use them.
- ``data``: the same calls as payloads written out in each module, citing the upstream
  repository, file and function they mirror (the frameworks' packages need Python 3.12 and
  heavy dependencies; vLLM's benchmark client imports in the project's environment).

``auto`` (the default) takes ``real`` where the framework imports and ``data`` elsewhere.
Mid-generation steps (pause, abort, partial rollouts) start a ``--long-tokens`` request,
wait until the service runs it (SGLang's ``GET /v1/loads``, which the service serves in
every dialect), then act; a request that ends before the act is reported as a failure
(raise ``--long-tokens``). The frameworks send no API key (``--api-key`` is added to the
``data`` calls only): point them at a service without ``api_key``.

    python -m bench.dialect_clients
    python -m bench.dialect_clients --url http://127.0.0.1:8000 --tokenizer CHECKPOINT_DIR
"""
