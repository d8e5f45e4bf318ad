"""What the weight-push test modules share: the probe prompts and the parameters they
change, announcements and placements as a trainer writes them, and vLLM's own counters to
wait on (``test_weights.py``, ``test_weights_refused.py``; others import a few)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from rollout_service.client import RolloutClient
from rollout_service.embedded import ensure_model
from rollout_service.protocol import messages
from rollout_service.tools.launch import ServiceProcess
from rollout_service.tools.scrape import sample_sum
from tests.integration.conftest import TARGET, WEIGHTS_TOKEN, served_version, until
from trainer_client.push import WeightPusher, layout, param_spec, spec_nbytes

PROBE_PROMPTS = [[5 + i, 17, 42, 9] for i in range(6)]
DRAFT_PARAM = "model.mtp_layers.0.input_proj.weight"
MAIN_PARAM = "lm_head.weight"


def load_original() -> dict[str, torch.Tensor]:
    """The tiny embedded checkpoint the session's service starts on, on the target's device."""
    tensors = load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
    return {name: t.to(TARGET.tensor_device) for name, t in tensors.items()}


def trainer_pusher(service: ServiceProcess) -> WeightPusher:
    """The trainer's pusher in the service's transport, small buckets (many per push)."""
    return WeightPusher(service.url, WEIGHTS_TOKEN, bucket_bytes=256 * 1024,
                        transport=TARGET.transport)  # type: ignore[arg-type]


class HeldBack:
    """A push's tensors, the last (smallest) one held back until :meth:`release`.

    A test that needs a push's pause (its ``finish`` call) to land at a chosen moment
    should not start the whole push then: the test pusher sends an update call per
    256 KiB bucket first. On a busy 2-core CI machine, sixteen 1000-token requests
    finished before such a push paused the engine, three attempts in a row. Iterated by
    the pusher (with :attr:`specs`, so it is not materialized first), this sends every
    bucket but the last before :attr:`staged` is set; after :meth:`release` the pause is
    one update call away.

    Args:
        tensors: the tensors to push.
        timeout_s: how long the pusher's thread waits for the release before it fails
            the push (which the pusher then aborts).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], *, timeout_s: float = 120.0) -> None:
        self._items = sorted(tensors.items(), key=lambda item: item[1].nbytes, reverse=True)
        self.specs = [param_spec(name, t) for name, t in self._items]
        self.staged = threading.Event()
        self._released = threading.Event()
        self._timeout_s = timeout_s

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._items[:-1]
        self.staged.set()
        if not self._released.wait(self._timeout_s):
            raise TimeoutError(f"the push's last tensor was not released in {self._timeout_s} s")
        yield self._items[-1]

    def release(self) -> None:
        self._released.set()


def http(service: ServiceProcess, token: str | None = WEIGHTS_TOKEN) -> httpx.Client:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=service.url, headers=headers, timeout=60)


def next_version(service: ServiceProcess) -> int:
    return served_version(service) + 1


def with_change(original: dict[str, torch.Tensor], name: str, seed: int
                ) -> dict[str, torch.Tensor]:
    changed = dict(original)
    g = torch.Generator().manual_seed(seed)
    changed[name] = (torch.randn(original[name].shape, generator=g).to(original[name].device)
                     * original[name].float().std() * 3).to(original[name].dtype)
    return changed


async def probe(client: RolloutClient) -> list[messages.SequenceOutput]:
    responses = await asyncio.gather(*(client.generate(messages.GenerateRequest(
        prompt_token_ids=p, max_tokens=24, temperature=0.0, ignore_eos=True))
        for p in PROBE_PROMPTS))
    return [r.outputs[0] for r in responses]


def accept_rate(outs: list[messages.SequenceOutput]) -> float:
    return (sum(o.spec_decode.num_accepted_tokens for o in outs)
            / sum(o.spec_decode.num_draft_tokens for o in outs))


def begin_body(original: dict[str, torch.Tensor], segment: str, version: int, *,
               transport: str = TARGET.transport, **changes: object) -> dict:
    """A valid announcement in ``transport`` (the service's by default)."""
    specs = [param_spec(n, t) for n, t in original.items()]
    _, seg_bytes = layout([spec_nbytes(s) for s in specs])
    in_segment = {"segment": segment, "segment_bytes": seg_bytes} if transport == "shm" else {}
    body = messages.PushBeginRequest(version=version, transport=transport,
                                     total_bytes=sum(spec_nbytes(s) for s in specs),
                                     params=specs, **in_segment).model_dump(exclude_none=True)
    body.update(changes)
    return body


def placed(name: str, tensor: torch.Tensor, segment: str, offset: int = 0) -> dict:
    """An shm placement as the trainer sends it."""
    return {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "location": {"transport": "shm", "segment": segment, "offset": offset}}


async def generated_tokens(client: RolloutClient) -> float:
    """Tokens vLLM has generated since it started (its own counter).

    Waits use its rise since a reading taken before the requests were sent, not vLLM's
    running-requests gauge: the keep-mode test once saw four requests running and yet
    pushed before any of its own had a token (the gauge reports the engine's last step,
    whoever's requests those were). vLLM counts a token after it has recorded the weight
    version the token came from.
    """
    return sample_sum(await client.metrics_text(), "vllm:generation_tokens_total")


async def requests_in_engine(client: RolloutClient) -> float:
    """Requests vLLM runs or queues, as of its last step (its gauges)."""
    text = await client.metrics_text()
    return (sample_sum(text, "vllm:num_requests_running")
            + sample_sum(text, "vllm:num_requests_waiting"))


async def tokens_generated_reach(client: RolloutClient, count: float, pending: asyncio.Future,
                                 timeout_s: float = 120.0) -> None:
    """Wait until vLLM's generated-token counter reaches ``count`` or the requests end.

    Requests that all finished first are not an error here: on a busy machine the test
    process can be frozen for their whole generation, and the caller sees it in what the
    push held (nothing). A request that failed is: its error is raised instead of a later,
    unrelated assertion.
    """
    async def probe() -> tuple[bool, float]:
        return pending.done(), await generated_tokens(client)

    done, _ = await until(probe, lambda state: state[0] or state[1] >= count,
                          timeout_s=timeout_s, interval_s=0.05)
    if done and pending.exception() is not None:
        raise AssertionError("a request failed before vLLM counted "
                             f"{count:.0f} tokens") from pending.exception()


async def generating_or_done(client: RolloutClient, before: float,
                              pending: asyncio.Future) -> bool:
    return pending.done() or await generated_tokens(client) > before
