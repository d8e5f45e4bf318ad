"""vLLM's token-in/token-out generation over the service's sequences.

Runs in the service process (standalone, or the Ray Serve ingress), between vLLM's
dialect router (``router.py``) and the :class:`~rollout_service.choices.Sequences`: a
request's ``n`` sequences become choices (abortable by its ``request_id``), whose results
become vLLM's response shapes (vllm-project/vllm
``vllm/entrypoints/scale_out/token_in_token_out/serving.py``). The sampling fields mean
what they mean on ``/v1/completions`` (``sampling.vllm_sampling_options``), and every
sequence is observed into Prometheus once, by the service, as from any other dialect.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from rollout_service.choices import Choice, Sequences, check_model
from rollout_service.completions import finish_reason, request_metrics, usage
from rollout_service.engines.base import InvalidRequestError
from rollout_service.engines.sequences import (
    ChatTurn,
    GenerationResult,
    PositionLogprobs,
    TokenLogprob,
)
from rollout_service.logprob_views import (
    MIN_LOGPROB,
    TokenNames,
    candidates,
    chat_logprobs,
    prompt_logprobs,
)
from rollout_service.protocol.openai import ChatLogprobs, CompletionUsage
from rollout_service.sampling import vllm_sampling_options
from rollout_service.service import reported_stats, to_spec_info

from . import protocol as vllm


def token_logprobs(positions: Sequence[PositionLogprobs], num_top: int) -> vllm.TokenLogprobs:
    """vLLM's generate-shaped logprobs: integer token ids, the sampled token first among
    each position's candidates (``_create_tokens_logprobs``)."""
    def one(c: TokenLogprob) -> vllm.TokenLogprob:
        return vllm.TokenLogprob(token_id=c.token_id, logprob=max(c.logprob, MIN_LOGPROB),
                                 rank=c.rank)

    return vllm.TokenLogprobs(content=[
        vllm.TokenLogprobsContent(**one(p.token).model_dump(),
                                  top_logprobs=[one(c) for c in candidates(p, num_top)])
        for p in positions])


async def tokenize(service: Sequences, req: vllm.TokenizeRequest) -> vllm.TokenizeAnswer:
    """vLLM's ``/tokenize``: the ids the engine would generate from."""
    info = await service.engine_info()
    check_model(req.model, info.model)
    if req.messages is not None:
        ids = await service.chat_prompt([ChatTurn(role=m.role, content=m.text)
                                         for m in req.messages])
    else:
        assert req.prompt is not None
        ids = await service.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return vllm.TokenizeAnswer(count=len(ids), max_model_len=info.max_model_len, tokens=ids,
                               token_strs=await service.decode_tokens(ids)
                               if req.return_token_strs else None)


async def detokenize(service: Sequences, req: vllm.DetokenizeRequest) -> vllm.DetokenizeAnswer:
    info = await service.engine_info()
    check_model(req.model, info.model)
    if any(t >= info.vocab_size for t in req.tokens):
        raise InvalidRequestError(f"tokens: ids must be below the vocabulary size "
                                  f"{info.vocab_size}")
    return vllm.DetokenizeAnswer(prompt=await service.decode(req.tokens))


class TokensServing:
    """``POST /inference/v1/generate`` on one :class:`~rollout_service.choices.Sequences`."""

    def __init__(self, service: Sequences) -> None:
        self._service = service

    def _choices(self, req: vllm.TokensRequest) -> list[Choice]:
        params = req.sampling_params
        return [Choice(prompt=list(req.token_ids), request_id=f"{req.request_id}-{i}",
                       client_id=req.request_id, category=req.category,
                       sampling=vllm_sampling_options(
                           params, max_tokens=params.max_tokens,
                           temperature=params.temperature, top_p=params.top_p,
                           seed=None if params.seed is None else params.seed + i,
                           stop=params.stop, logprobs=params.logprobs))
                for i in range(params.n)]

    async def _logprobs(self, req: vllm.TokensRequest, positions: Sequence[PositionLogprobs]
                        | None, names: TokenNames) -> vllm.TokenLogprobs | ChatLogprobs | None:
        num_top = req.sampling_params.logprobs
        if positions is None or num_top is None:
            return None
        if req.output_mode == "tokens":
            return token_logprobs(positions, num_top)
        await names.learn([positions])
        return chat_logprobs(positions, names)

    async def generate(self, req: vllm.TokensRequest) -> vllm.TokensResponse:
        info = await self._service.engine_info()
        check_model(req.model, info.model)
        results = await self._service.run(self._choices(req))
        names = TokenNames(self._service.decode_tokens, as_token_ids=False)
        first = results[0]
        if first.prompt_logprobs is not None:
            await names.learn([first.prompt_logprobs])
        is_text = req.output_mode == "text"
        return vllm.TokensResponse(
            request_id=req.request_id, model=info.model, created=int(time.time()),
            choices=[vllm.TokensChoice(
                index=i, finish_reason=finish_reason(r), stop_reason=r.stop_reason,
                token_ids=list(r.token_ids), text=r.text if is_text else None,
                logprobs=await self._logprobs(req, r.logprobs, names),
                weight_versions=list(r.weight_versions),
                spec_decode=to_spec_info(reported_stats(r))) for i, r in enumerate(results)],
            usage=usage(results, len(results)),
            prompt_token_ids=list(first.prompt_token_ids) if req.return_token_ids else None,
            prompt_logprobs=None if first.prompt_logprobs is None
            else prompt_logprobs(first.prompt_logprobs, names),
            metrics=request_metrics(results, info))

    async def generate_stream(self, req: vllm.TokensRequest
                              ) -> AsyncGenerator[vllm.TokensStreamResponse, None]:
        """A chunk per delta of each sequence (its new tokens), the last of each with its
        finish reason, version spans and counts; then the usage chunk when asked for."""
        info = await self._service.engine_info()
        check_model(req.model, info.model)
        choices = self._choices(req)
        names = TokenNames(self._service.decode_tokens, as_token_ids=False)
        results: dict[int, GenerationResult] = {}
        is_first, is_text = True, req.output_mode == "text"
        async with aclosing(self._service.stream(choices)) as deltas:
            async for index, delta in deltas:
                result = delta.result
                if result is not None:
                    results[index] = result
                prompt_ids = None
                if is_first and req.return_token_ids and delta.prompt_token_ids is not None:
                    prompt_ids = list(delta.prompt_token_ids)
                is_first = False
                logprobs = await self._logprobs(req, delta.logprobs, names) if delta.logprobs \
                    else None
                yield vllm.TokensStreamResponse(
                    request_id=req.request_id, prompt_token_ids=prompt_ids,
                    choices=[vllm.TokensStreamChoice(
                        index=index, token_ids=list(delta.token_ids), logprobs=logprobs,
                        text=delta.text if is_text else None,
                        finish_reason=None if result is None else finish_reason(result),
                        stop_reason=None if result is None else result.stop_reason,
                        weight_versions=None if result is None else list(result.weight_versions),
                        spec_decode=None if result is None
                        else to_spec_info(reported_stats(result)))])
        if req.stream_options is not None and req.stream_options.include_usage:
            ordered = [results[i] for i in range(len(choices))]
            totals: CompletionUsage = usage(ordered, len(ordered))
            yield vllm.TokensStreamResponse(request_id=req.request_id, choices=[],
                                              usage=totals,
                                              metrics=request_metrics(ordered, info))
