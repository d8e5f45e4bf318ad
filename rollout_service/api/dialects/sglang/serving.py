"""SGLang's ``/generate`` over the service's sequences.

Runs in the service process (standalone, or the Ray Serve ingress), between SGLang's
dialect router (``router.py``) and the :class:`~rollout_service.choices.Sequences`: every
prompt's ``n`` sequences become choices (abortable by the prompt's ``rid``), whose
results become SGLang's answers (sgl-project/sglang
``python/sglang/srt/managers/tokenizer_manager.py``: ``text``, ``output_ids``,
``meta_info``). The acceptance counts go out in SGLang's ``meta_info.spec_*`` names,
computed from the same :class:`~rollout_service.protocol.acceptance.SpecDecodeStats` the
service exported to Prometheus, so the engine adapter's own reader
(``engines/sglang/stats.py``) reads back exactly those counts.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

from rollout_service.choices import Choice, Sequences
from rollout_service.engines.base import InvalidRequestError
from rollout_service.engines.sequences import (
    GenerationResult,
    PositionLogprobs,
    SamplingOptions,
)
from rollout_service.logprob_views import TokenNames
from rollout_service.protocol.acceptance import SpecDecodeStats
from rollout_service.service import reported_stats

from . import protocol as sgl


def _pick(value: Any, index: int) -> Any:
    """A batch field's value for prompt ``index`` (one value applies to every prompt)."""
    return value[index] if isinstance(value, list) else value


def sampling_options(params: sgl.SGLangSamplingParams, *, seed_offset: int, logprobs: int | None,
                     prompt_logprobs: int | None) -> SamplingOptions:
    """SGLang's sampling fields in the engine-neutral options (the same meaning as vLLM's
    names for the same fields: ``sampling.vllm_sampling_options``)."""
    return SamplingOptions(
        max_tokens=params.max_new_tokens or 128, min_tokens=params.min_new_tokens,
        temperature=1.0 if params.temperature is None else params.temperature,
        top_p=1.0 if params.top_p is None else params.top_p,
        top_k=max(0, params.top_k or 0), min_p=params.min_p or 0.0,
        seed=None if params.sampling_seed is None else params.sampling_seed + seed_offset,
        stop=(params.stop,) if isinstance(params.stop, str) else tuple(params.stop or ()),
        stop_token_ids=tuple(params.stop_token_ids or ()),
        include_stop_str_in_output=params.no_stop_trim, ignore_eos=params.ignore_eos,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def spec_fields(stats: SpecDecodeStats | None, num_output_tokens: int) -> dict[str, Any]:
    """A sequence's acceptance in SGLang's ``meta_info`` names: 0.5.12+'s and the older
    ones slime reads (``engines/sglang/stats.py`` has the table)."""
    if stats is None:
        return {}
    fields: dict[str, Any] = {
        "spec_verify_ct": stats.num_verify_steps,
        "spec_num_correct_drafts": stats.num_accepted_tokens,
        "spec_num_proposed_drafts": stats.num_draft_tokens,
        "spec_accept_token_num": stats.num_accepted_tokens,
        "spec_draft_token_num": stats.num_draft_tokens,
        "spec_accept_rate": stats.accept_rate or 0.0,
        "spec_accept_length": (num_output_tokens / stats.num_verify_steps
                               if stats.num_verify_steps else 1.0),
    }
    if stats.accepted_per_position:
        at_least = [stats.num_drafts, *stats.accepted_per_position, 0]
        fields["spec_correct_drafts_histogram"] = [
            at_least[j] - at_least[j + 1] for j in range(len(stats.accepted_per_position) + 1)]
    return fields


def finish_reason(result: GenerationResult) -> sgl.FinishReason:
    if result.finish_reason == "stop":
        return sgl.FinishReason(type="stop", matched=result.stop_reason)
    if result.finish_reason == "length":
        return sgl.FinishReason(type="length", length=len(result.token_ids))
    return sgl.FinishReason(type="abort", message="aborted")


class _Prompt:
    """One prompt of a request: its rid, sampling and logprob asks."""

    def __init__(self, req: sgl.GenerateReqInput, index: int) -> None:
        prompts = req.text if req.text is not None else req.input_ids
        self.prompt: str | list[int] = (prompts[index] if req.is_batch  # type: ignore[index]
                                        else prompts)  # type: ignore[assignment]
        rid = _pick(req.rid, index)
        self.rid: str = rid or uuid.uuid4().hex
        self.params: sgl.SGLangSamplingParams = _pick(req.sampling_params, index) \
            or sgl.SGLangSamplingParams()
        self.return_logprob = bool(_pick(req.return_logprob, index))
        self.num_top = (_pick(req.top_logprobs_num, index) or 0) if self.return_logprob else 0
        start = _pick(req.logprob_start_len, index)
        self.prompt_start: int | None = (start if self.return_logprob and start is not None
                                         and start >= 0 else None)


class SGLangServing:
    """``POST /generate`` (SGLang's shape) on one :class:`~rollout_service.choices.Sequences`."""

    def __init__(self, service: Sequences) -> None:
        self._service = service

    def _prompts(self, req: sgl.GenerateReqInput) -> list[_Prompt]:
        prompts = req.text if req.text is not None else req.input_ids
        count = len(prompts) if req.is_batch else 1  # type: ignore[arg-type]
        for name in ("sampling_params", "rid", "return_logprob", "logprob_start_len",
                     "top_logprobs_num"):
            value = getattr(req, name)
            if isinstance(value, list) and len(value) != count:
                raise InvalidRequestError(f"{name}: {len(value)} values for {count} prompts")
        return [_Prompt(req, i) for i in range(count)]

    @staticmethod
    def _choices(req: sgl.GenerateReqInput, prompts: Sequence[_Prompt]) -> list[Choice]:
        return [Choice(prompt=p.prompt, request_id=f"{p.rid}-{i}", client_id=p.rid,
                       category=req.category, sampling=sampling_options(
                           p.params, seed_offset=i,
                           logprobs=p.num_top if p.return_logprob else None,
                           prompt_logprobs=p.num_top if p.prompt_start is not None else None))
                for p in prompts for i in range(p.params.n)]

    async def generate(self, req: sgl.GenerateReqInput) -> sgl.GenerateOutput | list[
            sgl.GenerateOutput]:
        """Every prompt times its ``n``; one object for one sequence, else a list."""
        prompts = self._prompts(req)
        choices = self._choices(req, prompts)
        results = await self._service.run(choices)
        owners = [p for p in prompts for _ in range(p.params.n)]
        names = TokenNames(self._service.decode_tokens, as_token_ids=False)
        if req.return_text_in_logprobs:
            await names.learn([lps for r in results for lps in (r.logprobs, r.prompt_logprobs)],
                              [t for r in results if r.prompt_logprobs for t in r.prompt_token_ids])
        outputs = [self._output(r, owner, names, text_in_logprobs=req.return_text_in_logprobs)
                   for r, owner in zip(results, owners)]
        return outputs[0] if len(outputs) == 1 and not req.is_batch else outputs

    async def generate_stream(self, req: sgl.GenerateReqInput
                              ) -> AsyncGenerator[sgl.GenerateOutput, None]:
        """SGLang's default stream: each event the sequence so far (cumulative text and
        ``output_ids``), ``finish_reason`` null until its last; ``index`` in a batch."""
        prompts = self._prompts(req)
        choices = self._choices(req, prompts)
        owners = [p for p in prompts for _ in range(p.params.n)]
        is_many = len(choices) > 1 or req.is_batch
        texts = [""] * len(choices)
        prompt_ids: list[tuple[int, ...]] = [() for _ in choices]
        ids: list[list[int]] = [[] for _ in choices]
        logprobs: list[list[PositionLogprobs]] = [[] for _ in choices]
        names = TokenNames(self._service.decode_tokens, as_token_ids=False)
        async with aclosing(self._service.stream(choices)) as deltas:
            async for index, delta in deltas:
                texts[index] += delta.text
                ids[index] += delta.token_ids
                logprobs[index] += delta.logprobs
                if delta.prompt_token_ids is not None:
                    prompt_ids[index] = delta.prompt_token_ids
                result = delta.result
                if result is None:  # the sequence so far
                    result = GenerationResult(
                        prompt_token_ids=prompt_ids[index], token_ids=tuple(ids[index]),
                        text=texts[index], finish_reason="", weight_versions=(),
                        logprobs=tuple(logprobs[index]) if owners[index].return_logprob
                        else None, spec_decode=None)
                if req.return_text_in_logprobs:
                    await names.learn([delta.logprobs, result.prompt_logprobs],
                                      result.prompt_token_ids if result.prompt_logprobs else ())
                out = self._output(result, owners[index], names,
                                   text_in_logprobs=req.return_text_in_logprobs,
                                   is_final=delta.result is not None)
                yield out.model_copy(update={"index": index}) if is_many else out

    @staticmethod
    def _output(result: GenerationResult, prompt: _Prompt, names: TokenNames, *,
                text_in_logprobs: bool, is_final: bool = True) -> sgl.GenerateOutput:
        def entry(token_id: int, logprob: float | None) -> sgl.LogprobEntry:
            return (logprob, token_id, names[token_id] if text_in_logprobs else None)

        spans = result.weight_versions
        meta: dict[str, Any] = {
            "id": prompt.rid, "finish_reason": finish_reason(result) if is_final else None,
            "prompt_tokens": len(result.prompt_token_ids),
            "completion_tokens": len(result.token_ids),
            "cached_tokens": result.num_cached_tokens or 0,
            "weight_version": spans[-1].version if spans else None,
            "weight_versions": [s.model_dump() for s in spans] or None,
            **spec_fields(reported_stats(result), len(result.token_ids))}
        if result.logprobs is not None:
            meta["output_token_logprobs"] = [entry(p.token.token_id, p.token.logprob)
                                             for p in result.logprobs]
            if prompt.num_top:
                meta["output_top_logprobs"] = [[entry(c.token_id, c.logprob) for c in p.top]
                                               for p in result.logprobs]
        if result.prompt_logprobs is not None and prompt.prompt_start is not None:
            positions = list(zip(result.prompt_token_ids, result.prompt_logprobs))
            positions = positions[prompt.prompt_start:]
            meta["input_token_logprobs"] = [entry(t, None if p is None else p.token.logprob)
                                            for t, p in positions]
            if prompt.num_top:
                meta["input_top_logprobs"] = [
                    None if p is None else [entry(c.token_id, c.logprob) for c in p.top]
                    for _, p in positions]
        return sgl.GenerateOutput(text=result.text, output_ids=list(result.token_ids),
                                  meta_info=sgl.MetaInfo(**meta))
