"""vLLM engine: ``AsyncLLM`` with MTP speculative decoding and per-request stats.

Runs inside the rollout service process; ``AsyncLLM`` spawns the engine-core
process (and its workers) and talks to it over ZMQ. Each ``generate`` or ``stream``
call is one engine request with ``n == 1``, so vLLM attaches exact spec-decode
counts to the finished output (``per_request_spec_decode_metrics``), which this
module turns into :class:`~rollout_service.protocol.acceptance.SpecDecodeStats`.
Without a speculative config (``mtp.enabled: false``) vLLM refuses per-request
metrics, so none are asked for and sequences carry no stats.

``generate`` asks for the final output only; ``stream`` for deltas
(``RequestOutputKind.DELTA``, detokenized as they come), and closing its iterator
closes vLLM's, which aborts the request.

Started with ``EngineSpec.runtime_spec_schedule`` (the speculation control), the engine
starts with a K schedule holding every K (``spec_schedule.startup_ranges``), changes it
at run time (``schedule_methods.py``) and measures its steps with a stat logger
(``step_costs.py``). Its engine args come from ``engine_args.py``; its request and output
types are translated in ``outputs.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import asdict, replace

from vllm import SamplingParams
from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from rollout_service.engines.base import (
    NO_LOAD,
    ChatTurn,
    EngineInfo,
    EngineSpec,
    EngineUnavailableError,
    GenerationDelta,
    GenerationResult,
    InvalidRequestError,
    LoadTimings,
    PushLoads,
    SamplingOptions,
    WeightsLoad,
    WeightUpdate,
    check_prompt,
)
from rollout_service.engines.broadcast_engine import BucketReceive, WorkerReceive
from rollout_service.engines.chat import chat_prompt_ids
from rollout_service.engines.sequences import PositionLogprobs
from rollout_service.engines.vllm import drafter_at_k0
from rollout_service.engines.vllm.engine_args import (
    build_engine_args,
    has_pushable_drafter,
    loads_in_place,
)
from rollout_service.engines.vllm.graph_policy import with_user_schedule_graphs
from rollout_service.engines.vllm.outputs import (
    output_logprobs,
    prompt_logprobs,
    sampling_params,
    to_result,
)
from rollout_service.engines.vllm.schedule_methods import SpecScheduleMethods
from rollout_service.engines.vllm.spec_schedule import with_startup_schedule
from rollout_service.engines.vllm.start_method import spawn_engine_core_if_cuda
from rollout_service.engines.vllm.step_costs import StepCostMonitor
from rollout_service.engines.vllm.transfer import update_info
from rollout_service.engines.vllm.usage_context import serving_usage_context
from rollout_service.engines.vllm.worker_ext import combined_checksums
from rollout_service.protocol.broadcast import Backend, GroupSpec
from rollout_service.protocol.messages import PauseMode
from rollout_service.protocol.store import BucketInfo

logger = logging.getLogger(__name__)

_VERIFY_COST_REPEATS = 12
"""Runs of each dummy batch when measuring the verify cost; the fastest counts."""


async def start(spec: EngineSpec) -> VLLMEngine:
    """The :data:`~rollout_service.engines.base.EngineStarter` of vLLM.

    Raises:
        ValueError: a config vLLM or the MTP settings reject (naming the field).
    """
    args = build_engine_args(spec.model_path, spec.engine_kwargs, spec.mtp,
                             spec.checkpoint_config, served_model_name=spec.served_model_name,
                             weights_transport=spec.weights_transport)
    skip_at_k0 = spec.runtime_spec_schedule and drafter_at_k0.resolve(spec.drafter_at_k0,
                                                                        args)
    if not spec.runtime_spec_schedule:
        args = with_user_schedule_graphs(args, spec.full_cuda_graphs)
        engine = VLLMEngine.start(args, served_model_name=spec.served_model_name,
                                  weights_load=spec.weights_load)
    else:
        startup = with_startup_schedule(args, full_cuda_graphs=spec.full_cuda_graphs)
        engine = VLLMEngine.start(startup,
                                  served_model_name=spec.served_model_name,
                                  weights_load=spec.weights_load, step_costs=StepCostMonitor())
    try:
        if spec.runtime_spec_schedule:
            await engine.check_spec_schedule()
        if skip_at_k0:
            await engine.skip_drafter_at_k0(required=spec.drafter_at_k0 == "skip")
        await engine.measure_verify_cost(spec.verify_cost_batch_size)
    except BaseException:
        await engine.shutdown()
        raise
    return engine


class VLLMEngine(SpecScheduleMethods):
    """:class:`~rollout_service.engines.base.Engine` on vLLM's ``AsyncLLM``.

    Create it with :func:`start` inside the event loop that will serve it.
    """

    def __init__(self, llm: AsyncLLM, info: EngineInfo, *, loads_in_place: bool = False,
                 step_costs: StepCostMonitor | None = None) -> None:
        self._llm = llm
        self.info = info
        self.loads_in_place = loads_in_place
        """Whether pushes are copied into the served parameters instead of reloaded."""
        self._tokenizer = llm.get_tokenizer()
        self._step_costs = step_costs

    @classmethod
    def start(cls, engine_args: AsyncEngineArgs, served_model_name: str,
              weights_load: WeightsLoad = "auto",
              step_costs: StepCostMonitor | None = None) -> VLLMEngine:
        """Start the engine and vLLM's engine-core process (spawned on CUDA:
        ``start_method.py``); ``step_costs`` measures its steps (a stat logger beside
        vLLM's own)."""
        loggers = None if step_costs is None else [step_costs.logger_factory()]
        spawn_engine_core_if_cuda()
        llm = AsyncLLM.from_engine_args(engine_args, stat_loggers=loggers,
                                        usage_context=serving_usage_context())
        _cache_vllm_environment()
        model_config = llm.model_config
        spec = llm.vllm_config.speculative_config
        info = EngineInfo(
            model=served_model_name,
            engine="vllm",
            model_path=model_config.model,
            max_model_len=model_config.max_model_len,
            vocab_size=model_config.get_vocab_size(),
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            speculative_method=spec.method if spec else None,
            has_pushable_drafter=has_pushable_drafter(spec, model_config),
            world_size=int(llm.vllm_config.parallel_config.world_size_across_dp),
        )
        in_place = loads_in_place(weights_load, model_config)
        logger.info("weight pushes load %s (weights_load: %s)",
                    "in place" if in_place else "by layerwise reload", weights_load)
        return cls(llm, info, loads_in_place=in_place, step_costs=step_costs)

    async def measure_verify_cost(self, batch_size: int) -> None:
        """Measure a verify step's cost over a plain decode step (``verify_cost.py``, in
        the workers, before anything is served) into ``info.verify_cost_ratio``."""
        k = self.info.num_speculative_tokens
        if k == 0 or batch_size == 0:
            return
        start = time.perf_counter()
        measured = await self._llm.collective_rpc(
            "rollout_verify_cost", args=(batch_size, k, _VERIFY_COST_REPEATS))
        if not measured or measured[0] is None:
            return
        cost = measured[0]
        self.info = replace(self.info, verify_cost_ratio=cost["verify_cost_ratio"])
        logger.info("verify step with %d drafts at batch size %d: %.2f ms, plain decode step "
                    "%.2f ms: verify cost ratio %.2f (measured in %.1f s)", k,
                    int(cost["batch_size"]), 1e3 * cost["verify_s"], 1e3 * cost["plain_s"],
                    cost["verify_cost_ratio"], time.perf_counter() - start)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as the engine would see them."""
        return list(self._tokenizer.encode(text))

    async def generate(self, prompt: str | list[int], sampling: SamplingOptions,
                       request_id: str) -> GenerationResult:
        prompt_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(self.info, prompt_ids, sampling.max_tokens)
        final = None
        try:
            params = sampling_params(sampling)
            async for output in self._llm.generate({"prompt_token_ids": prompt_ids}, params,
                                                   request_id):
                final = output
        except EngineDeadError as exc:
            raise EngineUnavailableError(f"vLLM engine died: {exc}") from exc
        except (ValueError, VLLMClientError) as exc:
            # vLLM's own request validation: the request's fault, not the engine's.
            raise InvalidRequestError(str(exc)) from exc
        assert final is not None and final.finished, "AsyncLLM ended without a final output"
        completion = final.outputs[0]
        # Without stop strings vLLM did not detokenize (see sampling_params): one decode
        # of the whole sequence here instead of one incremental step per token there.
        text = completion.text if params.detokenize else self._tokenizer.decode(
            completion.token_ids, skip_special_tokens=params.skip_special_tokens)
        return to_result(prompt_ids, final, text, sampling,
                         verify_cost_ratio=self.info.verify_cost_ratio)

    async def stream(self, prompt: str | list[int], sampling: SamplingOptions,
                     request_id: str) -> AsyncIterator[GenerationDelta]:
        prompt_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(self.info, prompt_ids, sampling.max_tokens)
        params = sampling_params(sampling, is_streamed=True)
        text: list[str] = []
        token_ids: list[int] = []
        logprobs: list[PositionLogprobs] = []
        prompt_lps: tuple[PositionLogprobs | None, ...] | None = None
        try:
            # aclosing: our consumer closing this generator closes vLLM's, which aborts.
            async with aclosing(self._llm.generate({"prompt_token_ids": prompt_ids}, params,
                                                   request_id)) as outputs:
                async for output in outputs:
                    completion = output.outputs[0]
                    new_text = completion.text
                    new_ids = tuple(completion.token_ids)
                    token_ids += new_ids
                    new_logprobs = output_logprobs(completion, new_ids, sampling.logprobs) or ()
                    logprobs += new_logprobs
                    if prompt_lps is None:  # vLLM sends them with the first output only
                        prompt_lps = prompt_logprobs(output, prompt_ids, sampling.prompt_logprobs)
                    result = None
                    if output.finished:
                        new_text = self._last_text("".join(text), new_text, token_ids, params)
                        result = to_result(
                            prompt_ids, output, "".join(text) + new_text, sampling,
                            token_ids=token_ids,
                            logprobs=logprobs if sampling.logprobs is not None else None,
                            prompt=prompt_lps, verify_cost_ratio=self.info.verify_cost_ratio)
                    yield GenerationDelta(text=new_text, token_ids=new_ids,
                                          logprobs=tuple(new_logprobs), result=result,
                                          prompt_token_ids=None if text else tuple(prompt_ids))
                    text.append(new_text)
        except EngineDeadError as exc:
            raise EngineUnavailableError(f"vLLM engine died: {exc}") from exc
        except (ValueError, VLLMClientError) as exc:
            raise InvalidRequestError(str(exc)) from exc

    def _last_text(self, sent: str, new_text: str, token_ids: Sequence[int],
                   params: SamplingParams) -> str:
        """The last delta's text, so that a stream's text is :meth:`generate`'s.

        Without stop strings ``generate`` decodes the whole sequence, which keeps the
        bytes of a character cut off by the token limit (as U+FFFD) where incremental
        detokenization drops them: the last delta carries the rest of that decode.
        """
        if params.stop:
            return new_text
        whole = self._tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
        return whole[len(sent):] if whole.startswith(sent) else new_text

    async def chat_prompt(self, turns: Sequence[ChatTurn]) -> list[int]:
        return chat_prompt_ids(self._tokenizer, turns)

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids))

    async def decode_tokens(self, token_ids: Sequence[int]) -> list[str]:
        # vLLM's OpenAI server shows a logprob's token the same way (decode of the id alone).
        return [self._tokenizer.decode([token]) for token in token_ids]

    async def abort(self, request_ids: Sequence[str]) -> None:
        """``AsyncLLM.abort``: each request's caller gets its final output, finish reason
        ``abort``, with the tokens generated so far (also when only the final output was
        asked for)."""
        if request_ids:
            await self._llm.abort(list(request_ids))

    async def pause(self, mode: PauseMode = "wait") -> int:
        """``AsyncLLM.pause_generation`` without its closing ``asyncio.sleep(0.02)``.

        vLLM sleeps there only so that the last outputs of drained requests reach their
        callers before the call returns ("not required for correctness", its comment
        says). Nothing here depends on that order: the version spans of every token come
        from the engine core, not from when the outputs arrive. On an H200 the sleep
        was 20 of a 1.14B push's 133 ms.
        """
        await self._llm.renderer.clear_mm_cache_async()
        await self._llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=True)
        return self._llm.output_processor.get_num_unfinished_requests()

    async def resume(self) -> None:
        await self._llm.resume_generation()

    async def load_weights(self, update: WeightUpdate, *, version: str) -> PushLoads:
        """One vLLM weight-update session per model, the main model's first; the same
        stream feeds both."""
        return PushLoads(
            main=await self._load_model(update, draft=False, version=version)
            if update.loads_main else NO_LOAD,
            draft=await self._load_model(update, draft=True, version=None)
            if update.loads_draft else NO_LOAD)

    async def _load_model(self, update: WeightUpdate, *, draft: bool,
                          version: str | None) -> LoadTimings:
        start = time.perf_counter()
        if draft:
            await self._llm.start_draft_weight_update()
        else:
            await self._llm.start_weight_update()
        info = update_info(update, draft=draft, in_place=self.loads_in_place)
        await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))
        loaded = time.perf_counter()
        await self._llm.finish_weight_update(weight_version=version)
        return LoadTimings(load_s=loaded - start, finalize_s=time.perf_counter() - loaded)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._llm.reset_prefix_cache())

    @asynccontextmanager
    async def profiled(self) -> AsyncIterator[None]:
        """vLLM's own profiler around the block (the engine's ``profiler_config``; for
        ``bench.step_profile``)."""
        await self._llm.start_profile()
        try:
            yield
        finally:
            await self._llm.stop_profile()

    # ---- the nccl transport (broadcast_backend.py in the workers) -------------------

    @property
    def num_workers(self) -> int:
        return int(self._llm.vllm_config.parallel_config.world_size)

    @property
    def group_backends(self) -> tuple[Backend, ...]:
        from vllm.platforms import current_platform

        return ("nccl",) if current_platform.is_cuda() else ("gloo",)

    async def join_group(self, spec: GroupSpec) -> None:
        """Have every worker start joining ``spec``'s group (returns at once)."""
        await self._llm.collective_rpc("rollout_group_join", args=(spec.as_dict(),))

    async def group_state(self, group_id: str) -> list[str]:
        """Each worker's join: ``running``, ``done``, ``failed: ...`` or ``unknown``."""
        return await self._llm.collective_rpc("rollout_group_state", args=(group_id,))

    async def leave_group(self) -> None:
        await self._llm.collective_rpc("rollout_group_leave")

    async def start_bucket(self, receive: BucketReceive, bucket: BucketInfo) -> None:
        """Have every worker start receiving ``bucket`` (returns at once; generation goes
        on, the workers receive on threads of their own)."""
        await self._llm.collective_rpc("rollout_bucket_start", args=(
            asdict(receive), bucket.model_dump(mode="json")))

    async def bucket_states(self, push_id: str, index: int) -> list[str]:
        return await self._llm.collective_rpc("rollout_bucket_state", args=(push_id, index))

    async def receive_reports(self, push_id: str, num_buckets: int) -> list[WorkerReceive]:
        reports = await self._llm.collective_rpc("rollout_receive_report",
                                                 args=(push_id, num_buckets))
        return [WorkerReceive(state=r["state"], peak_bytes=r["peak_bytes"], copy_checksums={
            int(i): c for i, c in r["copy_checksums"].items()}) for r in reports]

    async def weight_checksums(self) -> dict[str, str]:
        """SHA-256 of the main model's and the drafter's parameters: ``main`` and
        ``draft`` over every worker's shard (so a shard that failed to load on any
        tensor-parallel rank shows), and each rank's own as ``main/rank<i>``."""
        per_rank = await self._llm.collective_rpc("rollout_weight_checksums")
        return combined_checksums(per_rank)

    async def health(self) -> None:
        try:
            await self._llm.check_health()
        except EngineDeadError as exc:
            raise EngineUnavailableError(f"vLLM engine died: {exc}") from exc

    async def shutdown(self) -> None:
        self._llm.shutdown()


def _cache_vllm_environment() -> None:
    """Freeze vLLM's environment variables in this process, as vLLM does itself in its
    engine-core and worker processes once they have started.

    Without it the front end re-reads ``os.environ`` for every output of every step
    (``VLLM_COMPUTE_NANS_IN_LOGITS`` in the iteration stats): 10% of the service's
    event loop at 128 concurrent requests on an H200 (py-spy, bench/serving.py).
    """
    from vllm import envs

    enable = getattr(envs, "enable_envs_cache", None)
    if enable is not None:
        enable()
