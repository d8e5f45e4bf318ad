"""SGLang engine: an SGLang HTTP server behind the engine protocol.

Runs inside the rollout service process and talks HTTP (httpx) to one SGLang server,
either launched here as a subprocess (``python -m sglang.launch_server``, its
speculative arguments built by :func:`rollout_service.speculative.build_sglang_server_args`)
or an existing one given by URL. The server owns its scheduler and TP worker processes.
SGLang itself is imported only to build weight-push payloads.

Versions are told apart by feature, not by version string: :func:`detect_features`
reads the server's ``/openapi.json`` (which routes exist, which fields each request
model has; SGLang ignores unknown fields, so sending one blindly does nothing) and
probes routes when the schema is disabled.

Per-request acceptance comes from ``meta_info`` of each ``/generate`` response:

==========  =======================  ========================  =============================
SGLang      accepted                 proposed                  per-step histogram
==========  =======================  ========================  =============================
<= 0.5.10   spec_accept_token_num    spec_draft_token_num      spec_accept_histogram
0.5.11      spec_accepted_drafts     spec_proposed_drafts      spec_accept_histogram
>= 0.5.12   spec_num_correct_drafts  spec_num_proposed_drafts  spec_correct_drafts_histogram
==========  =======================  ========================  =============================

``spec_verify_ct`` (verify steps) is stable; 0.5.12 also repeats the 0.5.11 names. SGLang
sets these keys only for a request with at least one verify step. They map onto
:class:`~rollout_service.telemetry.SpecDecodeStats` with vLLM's definitions:
``num_verify_steps = num_drafts = spec_verify_ct`` (SGLang drafts in every verify step),
``num_draft_tokens`` = SGLang's proposed count (``verify_ct * (speculative_num_draft_tokens
- 1)``, derived that way when the key is absent), ``num_accepted_tokens`` = SGLang's
accepted drafts, ``accepted_per_position`` from the histogram (``h[j]``: steps accepting j).

SGLang's "proposed" equals vLLM's "draft tokens" only for a chain (``speculative_eagle_topk``
1: k tokens per step). With topk > 1 SGLang verifies a tree and counts every non-root node
it verified (``speculative_num_draft_tokens - 1`` per step), although at most
``speculative_num_steps`` can be accepted: the exported accept rate is accepted / tree
tokens (lower than a chain's at the same accept length); accept length compares across
both. SGLang's own ``spec_accept_length`` (completion tokens / verify steps, prefill token
included) is not used. A request without the keys gets None (counted as missing), except
that with speculation on a request of <= 1 completion token never reached a verify step
and gets zero counts (accept length 1.0).

Weight pushes are colocated: the trainer's shared-memory segment goes to SGLang's
``/update_weights_from_tensor`` as one ``flattened_bucket`` (a uint8 tensor over the segment
and one ``FlattenedTensorMetadata`` per tensor at its byte offset), pickled by SGLang's
``MultiprocessingSerializer`` under torch's ``file_system`` sharing strategy: torch copies the
bytes once into a shared-memory file whose name travels in the pickle. (The default
``file_descriptor`` strategy hands fds over multiprocessing's resource sharer, which
rejects a process outside this one's multiprocessing family.) Every TP rank gets the
same payload (SGLang indexes the list by rank) and its loader takes its own shard. This
process pickles and never unpickles. Targeting:
``selector`` (0.5.23), else ``disable_draft_model`` (0.5.10-0.5.12, whose draft path loads
the drafter and then the target from the same tensors); ``/begin_weight_update`` ...
``/end_weight_update`` wrap the load where they exist. The distributed path
(``/init_weights_update_group``, ``/update_weights_from_distributed``) is implemented as
control calls only: the trainer's NCCL broadcast is not here and has not run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rollout_service.engines.base import (
    EngineInfo,
    EngineUnavailableError,
    GenerationResult,
    InvalidRequestError,
    LoadTimings,
    SamplingOptions,
    WeightUpdate,
    WeightVersionSpan,
)
from rollout_service.speculative import (
    MTPSettings,
    build_sglang_server_args,
    load_checkpoint_config,
)
from rollout_service.telemetry import SpecDecodeStats

logger = logging.getLogger(__name__)

# (accepted, proposed, histogram) meta_info keys, newest first.
SPEC_KEY_GENERATIONS = (
    ("spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_correct_drafts_histogram"),
    ("spec_accepted_drafts", "spec_proposed_drafts", "spec_accept_histogram"),
    ("spec_accept_token_num", "spec_draft_token_num", "spec_accept_histogram"),
)
# Ours -> SGLang's. SGLang has no drain mode: "wait" drains this engine's own requests
# first. "keep" retracts rather than freezes ("in_place"): /flush_cache refuses to run
# while requests sit in place, and retracted ones recompute their KV with the new weights.
_PAUSE_MODES = {"wait": "retract", "abort": "abort", "keep": "retract"}
_LAUNCH_RESERVED = ("model_path", "host", "port")
_INFO_TIMEOUT_S = 30.0

PayloadBuilder = Callable[[WeightUpdate, int], tuple[list[str], Any]]
"""``(update, num_tp_ranks) -> (one serialized payload per rank, object to keep alive)``."""


def build_launch_command(model_path: str, engine_kwargs: Mapping[str, Any], mtp: MTPSettings, *,
                         host: str, port: int, python: str = sys.executable) -> list[str]:
    """``python -m sglang.launch_server`` with the MTP arguments and the user's kwargs.

    Each kwarg ``name`` becomes ``--name-with-dashes``: True is a bare flag, False and
    None are left out (SGLang's boolean flags are switches, off by default), a list gives
    several values, a mapping its JSON, anything else its ``str``.

    Raises:
        ValueError: a bad speculative setting, or ``engine_kwargs`` setting ``model_path``,
            ``host`` or ``port`` (the service sets those).
    """
    reserved = [key for key in _LAUNCH_RESERVED if key in engine_kwargs]
    if reserved:
        raise ValueError(f"engine_kwargs: {reserved} are set by the service (model, host, "
                         "port), not by engine_kwargs")
    speculative = build_sglang_server_args(mtp, engine_kwargs)
    user = {key: value for key, value in engine_kwargs.items() if key not in speculative}
    args = {"model_path": model_path, "host": host, "port": port, **user, **speculative}
    command = [python, "-m", "sglang.launch_server"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            command.append(flag)
        elif isinstance(value, (list, tuple)):
            command += [flag, *map(str, value)]
        elif isinstance(value, Mapping):
            command += [flag, json.dumps(value)]
        else:
            command += [flag, str(value)]
    return command


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerFeatures:
    """What the connected SGLang server supports (see :func:`detect_features`)."""

    routes: frozenset[str]
    """POST routes among those this engine uses."""
    fields: Mapping[str, frozenset[str]]
    """Request-model field names per route; a route missing here has unknown fields."""

    @property
    def has_weight_update_session(self) -> bool:
        """``/begin_weight_update`` ... ``/end_weight_update`` must wrap loads (0.5.23)."""
        return {"/begin_weight_update", "/end_weight_update"} <= self.routes

    def accepts(self, route: str, field: str) -> bool:
        """Whether ``route``'s request model has ``field`` (unknown schema: inferred)."""
        if route in self.fields:
            return field in self.fields[route]
        # No schema: infer from the routes, as SGLang's history goes (0.5.10-0.5.23):
        # selector arrived with the update sessions and replaced disable_draft_model
        # (tensor route only); every 0.5.x pause takes a mode.
        session = self.has_weight_update_session
        inferred = {"selector": session, "mode": True,
                    "disable_draft_model": route == "/update_weights_from_tensor" and not session}
        return inferred.get(field, False)


# POST-only routes: a GET probe answers 405 if the route exists and runs nothing.
_PROBED_ROUTES = ("/generate", "/pause_generation", "/continue_generation",
                  "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update",
                  "/init_weights_update_group", "/update_weights_from_distributed",
                  "/destroy_weights_update_group")
# These also answer GET by doing their work, so they are never probed.
_UNPROBED_ROUTES = ("/flush_cache", "/weights_checker")


async def detect_features(client: httpx.AsyncClient) -> ServerFeatures:
    """Read routes and request fields from ``/openapi.json``, or probe routes without it.

    Probing sends GET to each POST-only route: 405 (method not allowed) means it
    exists, 404 that it does not. Without the schema, ``/flush_cache`` is assumed
    (every 0.5.x has it) and ``/weights_checker`` is not.
    """
    response = await client.get("/openapi.json", timeout=_INFO_TIMEOUT_S)
    if response.status_code == 200:
        schema = response.json()
        paths = schema.get("paths", {})
        routes = frozenset(route for route in (*_PROBED_ROUTES, *_UNPROBED_ROUTES)
                           if "post" in paths.get(route, {}))
        fields = {route: frozenset(_request_fields(schema, paths[route]["post"]))
                  for route in routes}
        return ServerFeatures(routes=routes, fields={r: f for r, f in fields.items() if f})
    logger.info("SGLang's /openapi.json is unavailable (%d); probing routes",
                response.status_code)
    probes = await asyncio.gather(*(client.get(route, timeout=_INFO_TIMEOUT_S)
                                    for route in _PROBED_ROUTES))
    routes = {route for route, probe in zip(_PROBED_ROUTES, probes) if probe.status_code == 405}
    return ServerFeatures(routes=frozenset({*routes, "/flush_cache"}), fields={})


def _request_fields(schema: Mapping[str, Any], operation: Mapping[str, Any]) -> set[str]:
    """Property names of an operation's JSON body, following $ref / allOf / anyOf."""
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    names: set[str] = set()
    pending = [body.get("schema", {})]
    while pending:
        node = pending.pop()
        if "$ref" in node:
            node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
        names |= set(node.get("properties", {}))
        pending += [*node.get("allOf", ()), *node.get("anyOf", ())]
    return names


class SGLangEngine:
    """:class:`~rollout_service.engines.base.Engine` over an SGLang server's HTTP API.

    Create it with :meth:`connect` (existing server) or :meth:`launch` (subprocess)
    inside the event loop that will serve it.
    """

    def __init__(self, client: httpx.AsyncClient, info: EngineInfo, features: ServerFeatures, *,
                 num_draft_tokens: int, num_tp_ranks: int,
                 payload_builder: PayloadBuilder | None = None,
                 process: asyncio.subprocess.Process | None = None) -> None:
        self.info = info
        self.features = features
        self._client = client
        self._num_draft_tokens = num_draft_tokens
        self._num_tp_ranks = num_tp_ranks
        self._build_payloads = payload_builder or build_flattened_bucket_payloads
        self._process = process
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._num_in_flight = 0

    @classmethod
    async def connect(cls, base_url: str, *, served_model_name: str, model_path: str | None = None,
                      client: httpx.AsyncClient | None = None,
                      payload_builder: PayloadBuilder | None = None) -> SGLangEngine:
        """Attach to a running server.

        Args:
            base_url: the server, e.g. ``http://127.0.0.1:30000``.
            served_model_name: the name in responses and metrics.
            model_path: the local checkpoint directory (vocabulary size, push validation);
                None: the server's ``model_path``, which must then be a local directory.
            client: an httpx client for the server (tests pass one on the fake's ASGI app).
            payload_builder: builds tensor payloads; None: SGLang's serializer.

        Raises:
            EngineUnavailableError: the server cannot be reached.
            ValueError: the checkpoint's config.json cannot be read.
        """
        # Generation and weight loads take as long as they take; connecting does not.
        client = client or httpx.AsyncClient(base_url=base_url,
                                             timeout=httpx.Timeout(None, connect=10.0))
        try:
            model_info = await _get_json(client, "/model_info", "/get_model_info")
            server_info = await _get_json(client, "/server_info", "/get_server_info")
            models = await _get_json(client, "/v1/models")
            features = await detect_features(client)
        except httpx.TransportError as exc:
            await client.aclose()
            raise EngineUnavailableError(f"SGLang server at {base_url} unreachable: {exc}") from exc
        model_path = model_path or model_info["model_path"]
        checkpoint = load_checkpoint_config(model_path)
        vocab_size = checkpoint.get("vocab_size") or checkpoint["text_config"]["vocab_size"]
        max_model_len = models["data"][0].get("max_model_len") or server_info["context_length"]
        is_spec = server_info.get("speculative_algorithm") is not None
        info = EngineInfo(
            model=served_model_name, engine="sglang", model_path=model_path,
            max_model_len=max_model_len, vocab_size=vocab_size,
            # The longest acceptable chain: the accept-length and per-position range.
            num_speculative_tokens=server_info["speculative_num_steps"] if is_spec else 0)
        return cls(client, info, features,
                   num_draft_tokens=server_info["speculative_num_draft_tokens"] if is_spec else 0,
                   num_tp_ranks=server_info.get("tp_size") or 1, payload_builder=payload_builder)

    @classmethod
    async def launch(cls, model_path: str, engine_kwargs: Mapping[str, Any], mtp: MTPSettings, *,
                     served_model_name: str, host: str = "127.0.0.1", port: int = 30000,
                     startup_timeout_s: float = 900.0) -> SGLangEngine:
        """Start ``sglang.launch_server`` in its own session and connect once healthy.

        Raises:
            ValueError: bad engine kwargs (see :func:`build_launch_command`).
            EngineUnavailableError: the server exited or was not healthy in time.
        """
        command = build_launch_command(model_path, engine_kwargs, mtp, host=host, port=port)
        logger.info("launching SGLang: %s", " ".join(command))
        process = await asyncio.create_subprocess_exec(*command, start_new_session=True)
        base_url = f"http://{host}:{port}"
        try:
            await _wait_healthy(base_url, process, startup_timeout_s)
            engine = await cls.connect(base_url, served_model_name=served_model_name,
                                       model_path=model_path)
        except BaseException:
            await _stop_process(process)
            raise
        engine._process = process
        return engine

    async def generate(self, prompt: str | list[int], sampling: SamplingOptions,
                       request_id: str) -> GenerationResult:
        await self._resumed.wait()  # pause holds new requests here
        self._num_in_flight += 1
        self._idle.clear()
        try:
            return await self._generate(prompt, sampling, request_id)
        finally:
            self._num_in_flight -= 1
            if self._num_in_flight == 0:
                self._idle.set()

    async def _generate(self, prompt: str | list[int], sampling: SamplingOptions,
                        request_id: str) -> GenerationResult:
        body: dict[str, Any] = {"rid": request_id, "sampling_params": _sampling_params(sampling),
                                "return_logprob": sampling.logprobs}
        # Text goes to SGLang when it can return the prompt's ids; else we tokenize with
        # its /v1/tokenize so that prompt_token_ids are exactly what it generated from.
        is_text = isinstance(prompt, str) and self.features.accepts(
            "/generate", "return_prompt_token_ids")
        if is_text:
            body |= {"text": prompt, "return_prompt_token_ids": True}
        else:
            ids = await self._tokenize(prompt) if isinstance(prompt, str) else list(prompt)
            self._check_prompt(ids, sampling.max_tokens)
            body["input_ids"] = ids
        response = await self._request("POST", "/generate", body)
        if response.status_code != 200:
            raise InvalidRequestError(_error_message(response))
        out = response.json()
        prompt_ids = out["prompt_token_ids"] if is_text else body["input_ids"]
        return _to_result(prompt_ids, out, self._num_draft_tokens)

    async def _tokenize(self, text: str) -> list[int]:
        response = await self._request("POST", "/v1/tokenize", {"prompt": text})
        if response.status_code != 200:
            raise InvalidRequestError(_error_message(response))
        return list(response.json()["tokens"])

    def _check_prompt(self, prompt_ids: list[int], max_tokens: int) -> None:
        info = self.info
        if not prompt_ids:
            raise InvalidRequestError("prompt: empty (it must hold at least one token)")
        bad = next((t for t in prompt_ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt_token_ids: token id {bad} is outside the vocabulary "
                f"[0, {info.vocab_size})")
        if len(prompt_ids) + max_tokens > info.max_model_len:
            raise InvalidRequestError(
                f"prompt: {len(prompt_ids)} prompt tokens + max_tokens {max_tokens} exceed the "
                f"model's context length {info.max_model_len}")

    async def pause(self, mode: str = "wait") -> None:
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

    async def resume(self) -> None:
        await self._control("/continue_generation", {})
        self._resumed.set()

    async def load_weights(self, update: WeightUpdate, *, draft: bool,
                           version: str | None) -> LoadTimings:
        start = time.perf_counter()
        route = "/update_weights_from_tensor"
        payloads, keep_alive = await asyncio.to_thread(self._build_payloads, update,
                                                       self._num_tp_ranks)
        # One flush after both models load (reset_prefix_cache), not one per load.
        body = {"serialized_named_tensors": payloads, "load_format": "flattened_bucket",
                "flush_cache": False, "weight_version": version, **self._target(route, draft)}
        await self._begin_session(draft)
        try:
            await self._control(route, body)
            loaded = time.perf_counter()
        finally:
            del keep_alive  # SGLang has copied the tensors into its parameters
            await self._end_session()  # a failed load leaves no session open
        return LoadTimings(load_s=loaded - start, finalize_s=time.perf_counter() - loaded)

    async def _begin_session(self, draft: bool) -> None:
        if self.features.has_weight_update_session:
            await self._control("/begin_weight_update", self._target("/begin_weight_update", draft))

    async def _end_session(self) -> None:
        if self.features.has_weight_update_session:
            await self._control("/end_weight_update", {})

    def _target(self, route: str, draft: bool) -> dict[str, Any]:
        """The field that picks the main model or the drafter on ``route``."""
        if self.features.accepts(route, "selector"):
            return {"selector": "draft" if draft else "target"}
        if self.features.accepts(route, "disable_draft_model"):
            return {"disable_draft_model": not draft}
        if draft:
            raise NotImplementedError(f"this SGLang server's {route} cannot target the drafter "
                                      "(no 'selector' field); use SGLang 0.5.23 or later")
        return {}

    async def init_weights_update_group(self, *, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> None:
        """Join the trainer's process group (separate hosts; SGLang ranks start at
        ``rank_offset``). The trainer must join it at the same time."""
        await self._control("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend})

    async def update_weights_from_distributed(
            self, tensors: Sequence[tuple[str, str, tuple[int, ...]]], *, draft: bool,
            version: str | None, group_name: str = "weight_update_group") -> None:
        """Receive ``(name, dtype name, shape)`` tensors broadcast by the trainer's rank 0.

        Raises:
            NotImplementedError: ``draft`` on a server that updates only the target here.
        """
        route = "/update_weights_from_distributed"
        body = {"names": [name for name, _, _ in tensors], "dtypes": [d for _, d, _ in tensors],
                "shapes": [list(shape) for _, _, shape in tensors], "group_name": group_name,
                "flush_cache": False, "weight_version": version, **self._target(route, draft)}
        await self._begin_session(draft)
        try:
            await self._control(route, body)
        finally:
            await self._end_session()

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the process group joined by :meth:`init_weights_update_group`."""
        await self._control("/destroy_weights_update_group", {"group_name": group_name})

    async def reset_prefix_cache(self) -> None:
        await self._control("/flush_cache", None)

    async def weight_checksums(self) -> dict[str, str]:
        """SGLang's per-engine checksum per model where ``/weights_checker`` can target one
        (0.5.23: SHA-256 over each rank's digest of its own, post-load parameter layout, so
        it is comparable only with itself); {} on servers without it."""
        route = "/weights_checker"
        if route not in self.features.routes or not self.features.accepts(route, "selector"):
            return {}
        roles = {"main": "target", **({"draft": "draft"} if self._num_draft_tokens else {})}
        checksums = {}
        for role, selector in roles.items():
            result = await self._control(route, {"action": "checksum", "selector": selector})
            checksums[role] = result["per_engine_checksum"]
        return checksums

    async def health(self) -> None:
        response = await self._request("GET", "/health", None, timeout=_INFO_TIMEOUT_S)
        if response.status_code != 200:
            raise EngineUnavailableError(f"SGLang /health answered {response.status_code}")

    async def shutdown(self) -> None:
        await self._client.aclose()
        if self._process is not None:
            await _stop_process(self._process)

    async def _request(self, method: str, path: str, body: Any, *,
                       timeout: float | None = None) -> httpx.Response:
        """Send; unreachable or a 5xx is EngineUnavailableError."""
        try:
            response = await self._client.request(method, path, json=body,
                                                  timeout=timeout or httpx.USE_CLIENT_DEFAULT)
        except httpx.TransportError as exc:
            raise EngineUnavailableError(
                f"SGLang server at {self._client.base_url} unreachable: {exc!r}") from exc
        if response.status_code >= 500:
            raise EngineUnavailableError(f"SGLang {path} answered {response.status_code}: "
                                         f"{_error_message(response)}")
        return response

    async def _control(self, path: str, body: Any) -> Any:
        """POST a control call; a refusal (non-200 or ``success: false``) is RuntimeError."""
        response = await self._request("POST", path, body)
        if response.status_code != 200:
            raise RuntimeError(f"SGLang {path} failed ({response.status_code}): "
                               f"{_error_message(response)}")
        if "json" not in response.headers.get("content-type", ""):
            return None
        result = response.json()
        if isinstance(result, dict) and result.get("success") is False:
            raise RuntimeError(f"SGLang {path} failed: {result.get('message')}")
        return result


def build_flattened_bucket_payloads(update: WeightUpdate, num_ranks: int) -> tuple[list[str], Any]:
    """One base64 ``flattened_bucket`` pickle of the whole segment per TP rank.

    Returns the payloads and the shared tensor, which must stay referenced until SGLang
    has loaded (its shared-memory file goes with the last reference).

    Raises:
        RuntimeError: sglang is not installed in this process's environment.
    """
    import torch
    import torch.multiprocessing

    from rollout_service.weights.shm import Segment

    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError as exc:
        raise RuntimeError(
            "pushing weights to SGLang needs the sglang package in the rollout service's "
            f"environment (its MultiprocessingSerializer builds the payload): {exc}") from exc
    segment = Segment.attach(update.segment)
    try:
        flat = segment.tensor(0, torch.uint8, (segment.nbytes,))
        metadata = []
        for name, dtype_name, shape, offset in update.tensors:
            dtype = getattr(torch, dtype_name)
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            metadata.append(FlattenedTensorMetadata(
                name=name, shape=torch.Size(shape), dtype=dtype, start_idx=offset,
                end_idx=offset + nbytes, numel=nbytes))
        strategy = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            payload = MultiprocessingSerializer.serialize(
                {"flattened_tensor": flat, "metadata": metadata}, output_str=True)
        finally:
            torch.multiprocessing.set_sharing_strategy(strategy)
    finally:
        segment.close()  # the pickled tensor now lives in torch's own shared memory
    return [payload] * num_ranks, flat


def spec_stats_from_meta_info(meta_info: Mapping[str, Any], num_draft_tokens: int
                              ) -> SpecDecodeStats | None:
    """SGLang's per-request counts as :class:`SpecDecodeStats` (see module docstring).

    Args:
        meta_info: a ``/generate`` response's ``meta_info``.
        num_draft_tokens: the server's ``speculative_num_draft_tokens``; 0 when
            speculative decoding is off.
    """
    verify_ct = meta_info.get("spec_verify_ct")
    keys = next((k for k in SPEC_KEY_GENERATIONS if k[0] in meta_info), None)
    if verify_ct is None or keys is None:
        if num_draft_tokens and meta_info.get("completion_tokens", 2) <= 1:
            return SpecDecodeStats(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                                   num_verify_steps=0)
        return None
    accepted_key, proposed_key, histogram_key = keys
    accepted = meta_info[accepted_key]
    proposed = meta_info.get(proposed_key)
    if proposed is None:
        proposed = verify_ct * (num_draft_tokens - 1)
    histogram = meta_info.get(histogram_key) or []
    per_position: tuple[int, ...] = ()
    if sum(histogram) == verify_ct and sum(j * n for j, n in enumerate(histogram)) == accepted:
        per_position = tuple(sum(histogram[i + 1:]) for i in range(len(histogram) - 1))
    try:
        return SpecDecodeStats(num_drafts=verify_ct, num_draft_tokens=proposed,
                               num_accepted_tokens=accepted, num_verify_steps=verify_ct,
                               accepted_per_position=per_position)
    except ValueError:
        logger.warning("SGLang returned inconsistent spec-decode counts %s; dropped",
                       {k: meta_info.get(k) for k in ("spec_verify_ct", *keys)})
        return None


def _sampling_params(sampling: SamplingOptions) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k or -1,  # SGLang: -1 keeps all
        "ignore_eos": sampling.ignore_eos}
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params


def _to_result(prompt_ids: Sequence[int], out: Mapping[str, Any],
               num_draft_tokens: int) -> GenerationResult:
    meta = out["meta_info"]
    token_ids = tuple(out["output_ids"])
    logprobs = None
    if "output_token_logprobs" in meta:  # [logprob, token id, text] per token
        logprobs = tuple(float(entry[0]) for entry in meta["output_token_logprobs"])
    if meta.get("weight_versions"):
        spans = tuple(WeightVersionSpan(version=s["version"], start=s["start"], end=s["end"])
                      for s in meta["weight_versions"])
    elif meta.get("weight_version") is not None:
        # Older servers report only the version at finish time.
        spans = (WeightVersionSpan(version=meta["weight_version"], start=0, end=len(token_ids)),)
    else:
        spans = ()
    finish = meta.get("finish_reason") or {"type": "abort"}
    return GenerationResult(
        prompt_token_ids=tuple(prompt_ids), token_ids=token_ids, text=out.get("text", ""),
        finish_reason=finish["type"] if finish["type"] in ("stop", "length") else "abort",
        logprobs=logprobs, weight_versions=spans,
        spec_decode=spec_stats_from_meta_info(meta, num_draft_tokens))


async def _get_json(client: httpx.AsyncClient, path: str, fallback: str | None = None) -> Any:
    response = await client.get(path, timeout=_INFO_TIMEOUT_S)
    if response.status_code == 404 and fallback is not None:
        response = await client.get(fallback, timeout=_INFO_TIMEOUT_S)
    if response.status_code != 200:
        raise EngineUnavailableError(f"SGLang {path} answered {response.status_code}")
    return response.json()


def _error_message(response: httpx.Response) -> str:
    """SGLang's ``{"error": {"message"}}``, ``{"success", "message"}`` or plain text."""
    try:
        body = response.json()
    except ValueError:
        return response.text
    if not isinstance(body, dict):
        return response.text
    error = body.get("error") or body.get("message") or body.get("detail") or response.text
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


async def _wait_healthy(base_url: str, process: asyncio.subprocess.Process,
                        timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.returncode is not None:
                raise EngineUnavailableError(f"SGLang exited with code {process.returncode}")
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(2.0)
    raise EngineUnavailableError(f"SGLang was not healthy within {timeout_s} s")


async def _stop_process(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the server (it stops its own children), then kill its session."""
    if process.returncode is None:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 60)
        except TimeoutError:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
