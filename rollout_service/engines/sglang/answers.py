"""SGLang's ``/generate`` answers as the engine protocol's types: results, the events of
a stream merged into one sequence, error messages.

Runs in the rollout service process, on the answers the SGLang engine (``engine``)
receives. A non-streamed answer is ``{"text", "output_ids", "meta_info"}`` (plus
``prompt_token_ids`` when asked for); acceptance counts come from its ``meta_info``
(``stats``). With ``"stream": true`` SGLang answers with server-sent events, ``data:
<answer>`` per decode step, then ``data: [DONE]``, where each answer has that shape,
``meta_info.finish_reason`` is null until the last event, ``completion_tokens`` counts
every token so far, and the spec-decode keys are there at least on the last event. What
each event carries differs:

=====================================  ==========  ==========  ======================
server arguments                       text        output_ids  meta_info logprobs
=====================================  ==========  ==========  ======================
default                                cumulative  cumulative  cumulative
``stream_output`` (older SGLang)       cumulative  delta       cumulative
``incremental_streaming_output``       delta       delta       delta
=====================================  ==========  ==========  ======================

Text is told apart by the server argument (``/server_info``), ids and logprobs by their
count against ``completion_tokens`` (both readings agree on the first event). A refusal
after the stream began is one event ``{"error": {"message"}}`` (the HTTP status is
already 200); one before it is a 400, as without streaming.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pydantic_core

from rollout_service.engines.base import (
    EngineUnavailableError,
    GenerationResult,
    InvalidRequestError,
)
from rollout_service.engines.sequences import PositionLogprobs, TokenLogprob
from rollout_service.engines.sglang.http_client import Reply, Streamed
from rollout_service.engines.sglang.stats import spec_stats_from_meta_info
from rollout_service.protocol.messages import WeightVersionSpan
from rollout_service.protocol.sse import read_events


def to_result(prompt_ids: Sequence[int], out: Mapping[str, Any], num_draft_tokens: int,
              num_positions: int | None = None) -> GenerationResult:
    """One finished sequence: a non-streamed answer, or a merged stream (``StreamedOutput``);
    ``num_draft_tokens`` and ``num_positions`` as :func:`stats.spec_stats_from_meta_info`
    takes them."""
    meta = out["meta_info"]
    token_ids = tuple(out["output_ids"])
    if meta.get("weight_versions"):
        spans = tuple(WeightVersionSpan(version=s["version"], start=s["start"], end=s["end"])
                      for s in meta["weight_versions"])
    elif meta.get("weight_version") is not None:
        # Older servers report only the version at finish time.
        spans = (WeightVersionSpan(version=meta["weight_version"], start=0, end=len(token_ids)),)
    else:
        spans = ()
    finish = meta.get("finish_reason") or {"type": "abort"}
    is_stop = finish["type"] == "stop"
    return GenerationResult(
        prompt_token_ids=tuple(prompt_ids), token_ids=token_ids, text=out.get("text", ""),
        finish_reason=finish["type"] if finish["type"] in ("stop", "length") else "abort",
        logprobs=logprobs_of(meta.get("output_token_logprobs"), meta.get("output_top_logprobs")),
        weight_versions=spans,
        spec_decode=spec_stats_from_meta_info(meta, num_draft_tokens, num_positions),
        # SGLang's "matched" is the stop string or token; an EOS token is matched too.
        stop_reason=finish.get("matched") if is_stop else None,
        prompt_logprobs=prompt_logprobs_of(meta.get("input_token_logprobs"),
                                           meta.get("input_top_logprobs")),
        num_cached_tokens=meta.get("cached_tokens"))


def logprobs_of(tokens: Sequence[Sequence[Any]] | None,
                top: Sequence[Sequence[Sequence[Any]] | None] | None
                ) -> tuple[PositionLogprobs, ...] | None:
    """SGLang's ``[logprob, token id, text]`` per position (and ``output_top_logprobs``, a
    list of those per position, most likely first) as positions; None when not asked."""
    if tokens is None:
        return None
    tops = list(top or ())
    return tuple(PositionLogprobs(
        TokenLogprob(int(entry[1]), float(entry[0])),
        _ranked(tops[i] if i < len(tops) else None)) for i, entry in enumerate(tokens))


def prompt_logprobs_of(tokens: Sequence[Sequence[Any]] | None,
                       top: Sequence[Sequence[Sequence[Any]] | None] | None
                       ) -> tuple[PositionLogprobs | None, ...] | None:
    """``input_token_logprobs``: the first position's logprob is null (nothing predicts it)."""
    if not tokens:
        return None
    tops = list(top or ())
    return tuple(None if entry[0] is None else PositionLogprobs(
        TokenLogprob(int(entry[1]), float(entry[0])),
        _ranked(tops[i] if i < len(tops) else None)) for i, entry in enumerate(tokens))


def _ranked(candidates: Sequence[Sequence[Any]] | None) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(int(c[1]), float(c[0]), rank)
                 for rank, c in enumerate(candidates or (), start=1))


class StreamedOutput:
    """The sequence so far, from one stream's answers.

    Args:
        is_text_delta: the server sends each step's text alone
            (``incremental_streaming_output``), not the text so far.
    """

    def __init__(self, *, is_text_delta: bool) -> None:
        self._is_text_delta = is_text_delta
        self._text = ""
        self._output_ids: list[int] = []
        self._logprobs: list[Any] = []
        self._top_logprobs: list[Any] = []
        self._meta_info: dict[str, Any] = {}

    def add(self, out: Mapping[str, Any]
            ) -> tuple[str, tuple[int, ...], tuple[PositionLogprobs, ...]]:
        """Merge one answer; returns its new text, token ids and their logprobs."""
        meta = out["meta_info"]
        ids = out.get("output_ids") or []
        num_tokens = meta.get("completion_tokens", len(self._output_ids) + len(ids))
        num_before = len(self._output_ids)
        self._output_ids = merged(self._output_ids, ids, num_tokens)
        if "output_token_logprobs" in meta:
            self._logprobs = merged(self._logprobs, meta["output_token_logprobs"], num_tokens)
        if meta.get("output_top_logprobs") is not None:
            self._top_logprobs = merged(self._top_logprobs, meta["output_top_logprobs"],
                                        num_tokens)
        text = out.get("text") or ""
        if self._is_text_delta:
            new_text = text
            self._text += text
        else:
            # A stop string trimmed at the end can shorten what was sent: nothing new then.
            new_text = text[len(self._text):] if text.startswith(self._text) else ""
            self._text = text
        self._meta_info = dict(meta)
        new_logprobs = logprobs_of(self._logprobs[num_before:],
                                   self._top_logprobs[num_before:]) or ()
        return new_text, tuple(self._output_ids[num_before:]), new_logprobs

    def final(self) -> dict[str, Any]:
        """The merged sequence, shaped as a non-streamed answer."""
        meta = dict(self._meta_info)
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"] = self._logprobs
        if self._top_logprobs:
            meta["output_top_logprobs"] = self._top_logprobs
        return {"text": self._text, "output_ids": self._output_ids, "meta_info": meta}


def merged(so_far: list[Any], items: Sequence[Any], num_total: int) -> list[Any]:
    """``items`` when they are the whole sequence (``num_total`` long), else ``so_far``
    followed by them (a delta)."""
    return list(items) if len(items) == num_total else [*so_far, *items]


async def streamed_answers(streamed: Streamed) -> AsyncIterator[dict[str, Any]]:
    """The answers of a streamed ``/generate``, one per event.

    Raises:
        InvalidRequestError: SGLang refused the request (a 4xx, or an error event).
        EngineUnavailableError: a 5xx, or an event that is not JSON.
    """
    if streamed.status != 200:
        reply = await streamed.read()
        if reply.status >= 500:
            raise EngineUnavailableError(f"SGLang /generate answered {reply.status}: "
                                         f"{error_message(reply)}")
        raise InvalidRequestError(error_message(reply))
    async for event in read_events(streamed.lines):
        try:  # pydantic's Rust parser, as for every whole answer (Reply.json)
            out = pydantic_core.from_json(event)
        except ValueError as exc:
            raise EngineUnavailableError(
                f"SGLang /generate streamed an event that is not JSON: {event[:200]!r}"
            ) from exc
        if "error" in out:
            raise InvalidRequestError(error_message_of(out))
        yield out


def error_message(reply: Reply) -> str:
    """SGLang's ``{"error": {"message"}}``, ``{"success", "message"}`` or plain text."""
    try:
        body = reply.json()
    except ValueError:
        return reply.text
    if not isinstance(body, dict):
        return reply.text
    return error_message_of(body) or reply.text


def error_message_of(body: Mapping[str, Any]) -> str:
    """The message of an SGLang error body ("" when it has none)."""
    error = body.get("error") or body.get("message") or body.get("detail") or ""
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)
