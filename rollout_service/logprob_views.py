"""Token log-probabilities in the shapes the dialects answer with.

Runs in the service process (standalone, or the Ray Serve ingress), on the results of
calls that asked for log-probabilities: the engine-neutral
:class:`~rollout_service.engines.sequences.PositionLogprobs` become OpenAI's legacy
completion logprobs, OpenAI's chat logprobs, and vLLM's prompt logprobs (vllm-project/vllm
``vllm/entrypoints/openai/completion/serving.py``, ``chat_completion/serving.py``). A
token is shown by its text (each token decoded alone, as vLLM does) or, with
``return_tokens_as_token_ids``, as ``token_id:N``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from rollout_service.engines.sequences import PositionLogprobs, TokenLogprob
from rollout_service.protocol import openai

Decode = Callable[[Sequence[int]], Awaitable[list[str]]]
"""Each token's text on its own (``Sequences.decode_tokens``)."""


class TokenNames:
    """How tokens are shown: decoded, or ``token_id:N``; decodes each id once per call."""

    def __init__(self, decode: Decode, *, as_token_ids: bool) -> None:
        self._decode = decode
        self._as_token_ids = as_token_ids
        self._names: dict[int, str] = {}

    async def learn(self, positions: Sequence[Sequence[PositionLogprobs | None] | None],
                    token_ids: Sequence[int] = ()) -> None:
        """Decode every token these positions name, and ``token_ids`` (one engine call)."""
        if self._as_token_ids:
            return
        ids = {c.token_id for lps in positions for p in lps or () if p is not None
               for c in (p.token, *p.top)} | set(token_ids)
        ids -= self._names.keys()
        if ids:
            ordered = sorted(ids)
            self._names.update(zip(ordered, await self._decode(ordered)))

    def __getitem__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_token_ids else self._names[token_id]


MIN_LOGPROB = -9999.0
"""What vLLM's OpenAI server sends for a ``-inf`` log-probability (JSON has no infinity)."""


def candidates(p: PositionLogprobs, num_top: int) -> list[TokenLogprob]:
    """A position's candidates in vLLM's order: the sampled token first, then the most
    likely ones (without the sampled token again), ``num_top + 1`` at most."""
    others = [c for c in p.top if c.token_id != p.token.token_id]
    return [p.token, *others][:num_top + 1]


def completion_logprobs(positions: Sequence[PositionLogprobs], names: TokenNames,
                        num_top: int, *, text_offset: int = 0,
                        echoed: tuple[Sequence[int], Sequence[PositionLogprobs | None]]
                        | None = None) -> openai.CompletionLogprobs:
    """OpenAI's legacy ``logprobs`` of a completion choice (or a chunk's new tokens, whose
    offsets start at ``text_offset``), as vLLM fills them (``_create_completion_logprobs``:
    ``top_logprobs`` holds the sampled token and the ``num_top`` most likely). With
    ``echo``, the prompt's ids and prompt logprobs come first (``echoed``; the first
    position has none)."""
    ids: list[int] = [p.token.token_id for p in positions]
    steps: list[PositionLogprobs | None] = list(positions)
    if echoed is not None:
        ids = [*echoed[0], *ids]
        steps = [*echoed[1], *steps]
    tokens = [names[t] for t in ids]
    offsets, offset = [], text_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return openai.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if p is None else max(p.token.logprob, MIN_LOGPROB) for p in steps],
        top_logprobs=[None if p is None else {names[c.token_id]: max(c.logprob, MIN_LOGPROB)
                                             for c in candidates(p, num_top)} for p in steps],
        text_offset=offsets)


def chat_logprobs(positions: Sequence[PositionLogprobs], names: TokenNames
                  ) -> openai.ChatLogprobs:
    """OpenAI's chat ``logprobs``: per token its text, logprob, UTF-8 bytes and the top N."""
    def entry(token_id: int, logprob: float) -> openai.ChatLogprob:
        name = names[token_id]
        return openai.ChatLogprob(token=name, logprob=max(logprob, MIN_LOGPROB),
                                  bytes=list(name.encode()))

    return openai.ChatLogprobs(content=[
        openai.ChatLogprobsContent(**entry(p.token.token_id, p.token.logprob).model_dump(),
                                   top_logprobs=[entry(c.token_id, c.logprob) for c in p.top])
        for p in positions])


def prompt_logprobs(positions: Sequence[PositionLogprobs | None], names: TokenNames
                    ) -> openai.PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per position the prompt's token and the top N by id."""
    def candidates(p: PositionLogprobs) -> dict[int, openai.PromptLogprob]:
        return {c.token_id: openai.PromptLogprob(logprob=max(c.logprob, MIN_LOGPROB),
                                                 rank=c.rank, decoded_token=names[c.token_id])
                for c in (p.token, *p.top)}

    return [None if p is None else candidates(p) for p in positions]
