"""What the live-SGLang modules share (``test_sglang_live.py``,
``test_sglang_cuda_ipc_live.py``, ``test_sglang_nccl_live.py``; GPU only:
``ROLLOUT_TEST_TARGET=sglang``, the sglang bundle): their marks, prompts and probe
tensors, greedy answers and their acceptance, a refused push, and each module's own SGLang
server with a service driving it through ``engine_url``."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.sglang_server import own_checksums, sglang_server
from rollout_service.client import RolloutClient, ServiceError
from rollout_service.config import EMBEDDED_SGLANG_ENGINE_KWARGS
from rollout_service.embedded import ensure_model
from rollout_service.engines.speculative import MTPSettings
from rollout_service.protocol import messages
from rollout_service.tools.launch import ServiceProcess
from tests.integration.conftest import (
    NUM_SPECULATIVE_TOKENS,
    TARGET,
    served_version,
    service_config,
    weights_status,
)
from trainer_client.push import WeightPusher

LIVE_SGLANG = [
    pytest.mark.gpu,
    pytest.mark.skipif(TARGET.engine != "sglang", reason="ROLLOUT_TEST_TARGET=sglang only"),
    pytest.mark.skipif(not torch.cuda.is_available()
                       or importlib.util.find_spec("sglang") is None,
                       reason="needs a CUDA GPU and the sglang package (the sglang bundle)"),
]
"""The modules' ``pytestmark``."""

PROMPTS = [[5 + i, 17, 42, 9] for i in range(6)]
DRAFT_PARAM = "model.mtp_layers.0.input_proj.weight"
MAIN_ONLY_PARAM = "model.norm.weight"
"""The main model's final norm: the drafter has its own (``final_layernorm``)."""


async def one_by_one(client: RolloutClient, max_tokens: int = 24
                     ) -> list[messages.SequenceOutput]:
    """Each of :data:`PROMPTS` greedily, one request at a time: SGLang computes them alike
    from push to push (each prefilled in full, no batch shapes)."""
    outputs = []
    for prompt in PROMPTS:
        answer = await client.generate(messages.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        outputs.append(answer.outputs[0])
    return outputs


def accept_rate(outs: list[messages.SequenceOutput]) -> float:
    return (sum(o.spec_decode.num_accepted_tokens for o in outs)
            / sum(o.spec_decode.num_draft_tokens for o in outs))


def changed(original: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Fresh copies on the originals' device: the main model's final norm scaled, the
    drafter's input projection replaced by noise three times its spread."""
    device = original[MAIN_ONLY_PARAM].device
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {name: t.clone() for name, t in original.items()}
    norm = tensors[MAIN_ONLY_PARAM]
    tensors[MAIN_ONLY_PARAM] = (norm.float() * (0.5 + torch.rand(
        norm.shape, generator=g, device=device))).to(norm.dtype)
    draft = tensors[DRAFT_PARAM]
    tensors[DRAFT_PARAM] = (torch.randn(draft.shape, generator=g, device=device)
                            * draft.float().std() * 3).to(draft.dtype)
    return tensors


@contextmanager
def own_sglang(log: Path, **server_args: Any) -> Iterator[str]:
    """An SGLang server on the embedded tiny checkpoint, its MTP layer the drafter, no
    radix cache (a greedy answer computed alike whether or not a prefix was cached), the
    target's arguments plus ``server_args``; yields its URL."""
    args = {**EMBEDDED_SGLANG_ENGINE_KWARGS, **TARGET.engine_kwargs,
            "disable_radix_cache": True, **server_args}
    with sglang_server(str(ensure_model("tiny")), args,
                       MTPSettings(num_speculative_tokens=NUM_SPECULATIVE_TOKENS), log) as url:
        yield url


@contextmanager
def service_on(engine_url: str, workdir: Path, **config: Any) -> Iterator[ServiceProcess]:
    """A service driving the server at ``engine_url``, healthy."""
    with ServiceProcess(workdir / "service.log", config=service_config(
            workdir, engine_url=engine_url, **config)) as proc:
        proc.wait_healthy(timeout_s=300)
        yield proc


def refuse_a_float32_push(sglang: str, service: ServiceProcess, pusher: WeightPusher,
                          original: dict[str, torch.Tensor], name: str) -> None:
    """Push ``original`` with ``name`` in float32, a dtype the service refuses: a 400 that
    names the dtype, and SGLang's own checksums and both served versions as they were."""
    before, state = own_checksums(sglang), weights_status(service)
    bad = {**original, name: original[name].float()}
    with pytest.raises(ServiceError, match="dtype") as refused:
        pusher.push(bad.items(), version=served_version(service) + 1)
    assert refused.value.status == 400
    assert own_checksums(sglang) == before
    after = weights_status(service)
    assert (after.main_version, after.draft_version) == (state.main_version, state.draft_version)
