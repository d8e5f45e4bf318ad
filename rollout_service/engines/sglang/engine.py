"""SGLang engine: an SGLang HTTP server behind the engine protocol.

Runs inside the rollout service process and talks HTTP (``http_client``) to one SGLang server,
either one given by ``engine_url`` or one launched here as a subprocess (``launch``).
The server owns its scheduler and TP worker processes; this process never imports
SGLang except to build weight payloads (``payload``). What it is (model, lengths,
speculation, TP size) is read when connecting (``server_facts``), what it accepts from its
schema (``features``); its answers become results in ``answers``, with the
acceptance counts of each answer's ``meta_info`` (``stats``).

Weight pushes go to ``/update_weights_from_tensor`` (``weight_methods``); for ``nccl``
pushes this process is the server's rank of the trainer's group (``group_receiver``).

Streaming (``stream``) sends ``"stream": true`` to ``/generate`` and merges SGLang's
server-sent events into deltas (``answers``); closing the stream closes the
connection, and SGLang aborts the request. Chat prompts use the checkpoint's chat
template through a ``transformers`` tokenizer of the checkpoint, loaded on the first
chat request (``engines/chat.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from rollout_service.engines.base import (
    ChatTurn,
    EngineSpec,
    EngineUnavailableError,
    GenerationDelta,
    GenerationResult,
    InvalidRequestError,
    SamplingOptions,
    check_prompt,
)
from rollout_service.engines.chat import chat_prompt_ids, load_tokenizer
from rollout_service.engines.sglang.answers import (
    StreamedOutput,
    error_message,
    streamed_answers,
    to_result,
)
from rollout_service.engines.sglang.features import INFO_TIMEOUT_S
from rollout_service.engines.sglang.group_receiver import ServiceRank
from rollout_service.engines.sglang.http_client import AiohttpServer, Reply, ServerHTTP
from rollout_service.engines.sglang.launch import (
    free_port_below_ephemeral,
    service_launch_command,
    start_server,
    stop_process,
)
from rollout_service.engines.sglang.payload import PayloadBuilder, build_payloads
from rollout_service.engines.sglang.request import generate_body
from rollout_service.engines.sglang.server_facts import ServerFacts, read_server
from rollout_service.engines.sglang.weight_methods import SGLangWeights
from rollout_service.engines.speculative import MTPSettings
from rollout_service.protocol.messages import PauseMode

logger = logging.getLogger(__name__)

# Ours -> SGLang's. SGLang has no drain mode: "wait" drains this engine's own requests
# first. "keep" retracts rather than freezes ("in_place"): /flush_cache refuses to run
# while requests sit in place, and retracted ones recompute their KV with the new weights.
_PAUSE_MODES: dict[PauseMode, str] = {"wait": "retract", "abort": "abort", "keep": "retract"}


async def start(spec: EngineSpec) -> SGLangEngine:
    """The :data:`~rollout_service.engines.base.EngineStarter` of SGLang: connect to
    ``spec.engine_url``, or launch a server when it is None.

    Raises:
        ValueError: bad engine kwargs.
        EngineUnavailableError: the server cannot be reached or did not start.
    """
    if spec.engine_url is not None:
        return await SGLangEngine.connect(spec.engine_url, served_model_name=spec.served_model_name,
                                          model_path=spec.model_path)
    return await SGLangEngine.launch(spec.model_path, spec.engine_kwargs, spec.mtp,
                                     served_model_name=spec.served_model_name)


class SGLangEngine(SGLangWeights, ServiceRank):
    """:class:`~rollout_service.engines.base.Engine` over an SGLang server's HTTP API.

    Create it with :meth:`connect` (existing server) or :meth:`launch` (subprocess)
    inside the event loop that will serve it.
    """

    def __init__(self, http: ServerHTTP, facts: ServerFacts, *,
                 payload_builder: PayloadBuilder | None = None,
                 process: asyncio.subprocess.Process | None = None) -> None:
        self.info = facts.info
        self.features = facts.features
        self._http = http
        self._is_text_streamed_as_delta = facts.is_text_streamed_as_delta
        self._tokenizer: Any = None
        self._is_tokenizer_loaded = False
        self._tokenizer_loaded = asyncio.Lock()
        self._num_draft_tokens = facts.num_draft_tokens
        self._num_tp_ranks = facts.num_tp_ranks
        self._rank_gpu = facts.base_gpu_id
        self._build_payloads = payload_builder or build_payloads
        self._process = process
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._num_in_flight = 0

    @classmethod
    async def connect(cls, base_url: str, *, served_model_name: str, model_path: str | None = None,
                      http: ServerHTTP | None = None,
                      payload_builder: PayloadBuilder | None = None) -> SGLangEngine:
        """Attach to a running server.

        Args:
            base_url: the server, e.g. ``http://127.0.0.1:30000``.
            served_model_name: the name in responses and metrics.
            model_path: the local checkpoint directory (vocabulary size, push validation);
                None: the server's ``model_path``, which must then be a local directory.
            http: the server's HTTP (None: :class:`AiohttpServer` on ``base_url``; tests
                pass an :class:`HttpxServer` on the fake's ASGI app).
            payload_builder: builds tensor payloads; None: SGLang's serializer.

        Raises:
            EngineUnavailableError: the server cannot be reached.
            ValueError: the checkpoint's config.json cannot be read.
        """
        http = http or AiohttpServer(base_url)
        try:
            facts = await read_server(http, served_model_name=served_model_name,
                                      model_path=model_path)
        except BaseException:
            await http.aclose()
            raise
        return cls(http, facts, payload_builder=payload_builder)

    @classmethod
    async def launch(cls, model_path: str, engine_kwargs: Mapping[str, Any], mtp: MTPSettings, *,
                     served_model_name: str, host: str = "127.0.0.1", port: int | None = None,
                     startup_timeout_s: float = 900.0) -> SGLangEngine:
        """Start ``sglang.launch_server`` in its own session and connect once healthy.

        ``port`` None picks a free one (two services, or a service and a test's own server,
        share a machine).

        Raises:
            ValueError: bad engine kwargs (see :func:`service_launch_command`).
            EngineUnavailableError: the server exited or was not healthy in time.
        """
        port = port or free_port_below_ephemeral(host)
        command = service_launch_command(model_path, engine_kwargs, mtp, host=host, port=port)
        base_url = f"http://{host}:{port}"
        http = AiohttpServer(base_url)  # one pool: the health polls', then the engine's
        try:
            process = await start_server(command, http, startup_timeout_s=startup_timeout_s)
        except BaseException:
            await http.aclose()
            raise
        try:
            engine = await cls.connect(base_url, served_model_name=served_model_name,
                                       model_path=model_path, http=http)
        except BaseException:  # connect closed http
            await stop_process(process)
            raise
        engine._process = process
        return engine

    # --- generation ---

    @asynccontextmanager
    async def _in_flight(self) -> AsyncIterator[None]:
        """One request of ours at the server: held while paused, counted for pause('wait')."""
        await self._resumed.wait()  # pause holds new requests here
        self._num_in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._num_in_flight -= 1
            if self._num_in_flight == 0:
                self._idle.set()

    async def generate(self, prompt: str | list[int], sampling: SamplingOptions,
                       request_id: str) -> GenerationResult:
        async with self._in_flight():
            return await self._generate(prompt, sampling, request_id)

    async def _prompt_ids(self, prompt: str | list[int], sampling: SamplingOptions) -> list[int]:
        ids = await self._tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(self.info, ids, sampling.max_tokens)
        return ids

    async def _generate(self, prompt: str | list[int], sampling: SamplingOptions,
                        request_id: str) -> GenerationResult:
        body = generate_body(sampling, request_id)
        # Text goes to SGLang when it can return the prompt's ids; else we tokenize with
        # its /v1/tokenize so that prompt_token_ids are exactly what it generated from.
        is_text = isinstance(prompt, str) and self.features.accepts(
            "/generate", "return_prompt_token_ids")
        if is_text:
            body |= {"text": prompt, "return_prompt_token_ids": True}
        else:
            body["input_ids"] = await self._prompt_ids(prompt, sampling)
        reply = await self._request("POST", "/generate", body)
        if reply.status != 200:
            raise InvalidRequestError(error_message(reply))
        out = reply.json()
        prompt_ids = out["prompt_token_ids"] if is_text else body["input_ids"]
        return to_result(prompt_ids, out, self._num_draft_tokens,
                         self.info.num_speculative_tokens)

    async def stream(self, prompt: str | list[int], sampling: SamplingOptions,
                     request_id: str) -> AsyncIterator[GenerationDelta]:
        async with self._in_flight():
            # Token ids, so that the prompt's are known without return_prompt_token_ids.
            prompt_ids = await self._prompt_ids(prompt, sampling)
            body = generate_body(sampling, request_id) | {"input_ids": prompt_ids, "stream": True}
            merged = StreamedOutput(is_text_delta=self._is_text_streamed_as_delta)
            first_prompt: tuple[int, ...] | None = tuple(prompt_ids)
            # Leaving this block (the consumer closed us) closes the connection; SGLang
            # aborts the request when its client goes away.
            async with self._http.stream("/generate", body) as streamed:
                async for out in streamed_answers(streamed):
                    text, token_ids, logprobs = merged.add(out)
                    is_finished = out["meta_info"].get("finish_reason") is not None
                    result = (to_result(prompt_ids, merged.final(), self._num_draft_tokens,
                                        self.info.num_speculative_tokens)
                              if is_finished else None)
                    yield GenerationDelta(text=text, token_ids=token_ids,
                                          logprobs=logprobs, result=result,
                                          prompt_token_ids=first_prompt)
                    first_prompt = None
                    if is_finished:
                        return
        raise EngineUnavailableError("SGLang's /generate stream ended before the sequence "
                                     "finished")

    async def chat_prompt(self, turns: Sequence[ChatTurn]) -> list[int]:
        return chat_prompt_ids(await self._local_tokenizer(), turns)

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        tokenizer = await self._local_tokenizer()
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: Sequence[int]) -> str:
        return (await self._local_tokenizer()).decode(list(token_ids))

    async def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        tokenizer = await self._local_tokenizer()
        return [tokenizer.decode([token]) for token in token_ids]

    async def _local_tokenizer(self) -> Any:
        """The checkpoint's tokenizer in this process, loaded on first use."""
        async with self._tokenizer_loaded:
            if not self._is_tokenizer_loaded:
                self._tokenizer = await asyncio.to_thread(load_tokenizer, self.info.model_path)
                self._is_tokenizer_loaded = True
        return self._tokenizer

    async def abort(self, request_ids: Sequence[str]) -> None:
        """SGLang's ``/abort_request`` per request: its caller's answer comes back with
        finish reason ``abort`` and the tokens so far."""
        await asyncio.gather(*(self._control("/abort_request", {"rid": rid})
                               for rid in request_ids))

    async def _tokenize(self, text: str) -> list[int]:
        reply = await self._request("POST", "/v1/tokenize", {"prompt": text})
        if reply.status != 200:
            raise InvalidRequestError(error_message(reply))
        return list(reply.json()["tokens"])

    async def pause(self, mode: PauseMode = "wait") -> int:
        if mode not in _PAUSE_MODES:
            raise ValueError(f"pause mode: {mode!r} (accepted: {sorted(_PAUSE_MODES)})")
        self._resumed.clear()
        body = ({"mode": _PAUSE_MODES[mode]}
                if self.features.accepts("/pause_generation", "mode") else {})
        try:
            if mode == "wait":
                await self._idle.wait()
            await self._control("/pause_generation", body)
        except BaseException:
            self._resumed.set()  # the caller resumes only after a successful pause
            raise
        return self._num_in_flight  # generate calls not yet answered

    async def resume(self) -> None:
        await self._control("/continue_generation", {})
        self._resumed.set()

    # --- lifecycle ---

    async def health(self) -> None:
        reply = await self._request("GET", "/health", None, timeout=INFO_TIMEOUT_S)
        if reply.status != 200:
            raise EngineUnavailableError(f"SGLang /health answered {reply.status}")

    async def shutdown(self) -> None:
        await self.leave_group()
        await self._http.aclose()
        if self._process is not None:
            await stop_process(self._process)

    # --- HTTP ---

    async def _request(self, method: str, path: str, body: Any, *,
                       timeout: float | None = None) -> Reply:
        """Send; unreachable or a 5xx is EngineUnavailableError."""
        reply = await self._http.send(method, path, body, timeout=timeout)
        if reply.status >= 500:
            raise EngineUnavailableError(f"SGLang {path} answered {reply.status}: "
                                         f"{error_message(reply)}")
        return reply

    async def _control(self, path: str, body: Any) -> Any:
        """POST a control call; a refusal (non-200 or ``success: false``) is RuntimeError."""
        reply = await self._request("POST", path, body)
        if reply.status != 200:
            raise RuntimeError(f"SGLang {path} failed ({reply.status}): {error_message(reply)}")
        if "json" not in reply.content_type:
            return None
        result = reply.json()
        if isinstance(result, dict) and result.get("success") is False:
            raise RuntimeError(f"SGLang {path} failed: {result.get('message')}")
        return result

