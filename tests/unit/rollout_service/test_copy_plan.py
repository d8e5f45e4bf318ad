"""The recorded copy plan of in-place pushes, on vLLM's real MiMo model and loaders.

vLLM's CPU build repacks linear weights after loading (so the CPU engine itself reloads),
but the model's ``load_weights`` runs before that repacking: built on the CPU and loaded
without post-processing, the model's parameters are exactly what the CUDA engine holds.
The check runs in a child process (it initialises vLLM's distributed state, which other
tests of this session may hold too).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from rollout_service.engines.vllm.copy_plan import CopyPlan, load_in_place

ROOT = Path(__file__).resolve().parents[3]


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _perturbed(tensors: list[tuple[str, torch.Tensor]], seed: int
               ) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, (t.float() + torch.randn(t.shape, generator=g) * 0.01).to(t.dtype))
            for n, t in tensors]


def check_on_vllm_mimo() -> None:
    """Replay == ``load_weights`` on the tiny MiMo model; exits non-zero otherwise."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.model_executor.model_loader.utils import initialize_model

    from rollout_service.config import EMBEDDED_ENGINE_KWARGS
    from rollout_service.embedded import ensure_model
    from rollout_service.engines.speculative import MTPSettings, load_checkpoint_config
    from rollout_service.engines.vllm.engine_args import build_engine_args
    from rollout_service.tools.launch import free_port

    path = str(ensure_model("tiny"))
    config = build_engine_args(path, EMBEDDED_ENGINE_KWARGS, MTPSettings(enabled=False),
                               load_checkpoint_config(path)).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ensure_model_parallel_initialized(1, 1)
        model = initialize_model(vllm_config=config)
        checkpoint = sorted(load_file(str(Path(path) / "model.safetensors")).items())
        plans: dict[int, CopyPlan] = {}
        load_in_place(model, checkpoint, plans)  # records
        plan = plans[id(model)]
        fused = [n for n in plan.names if ".q_proj." in n or ".gate_proj." in n]
        assert fused, "the plan covers no fused QKV / gate-up shard"
        for seed in (1, 2):
            pushed = _perturbed(checkpoint, seed)
            load_in_place(model, pushed, plans)  # replays
            assert plans[id(model)] is plan, "a valid plan was recorded anew"
            replayed = _snapshot(model)
            model.load_weights(iter(pushed))
            reloaded = _snapshot(model)
            differ = [n for n in reloaded if not torch.equal(reloaded[n], replayed[n])]
            assert not differ, f"replay differs from load_weights in {differ[:5]}"
        # A parameter given new memory invalidates the plan: it records anew.
        param = next(p for n, p in model.named_parameters() if n.endswith("qkv_proj.weight"))
        param.data = param.data.clone()
        assert not plan.is_valid(model)
        load_in_place(model, checkpoint, plans)
        assert plans[id(model)] is not plan and plans[id(model)].is_valid(model)
    rest = sorted({n for n, _ in checkpoint} - plan.names)
    print("copy plan OK:", len(plan.names), "of", len(checkpoint),
          "names replayed; by load_weights:", rest)


def test_replay_equals_vllm_load_weights_on_mimo() -> None:
    result = subprocess.run([sys.executable, "-m", "tests.unit.rollout_service.test_copy_plan"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "copy plan OK" in result.stdout, (
        result.stdout[-3000:] + result.stderr[-5000:])


class _Fused(torch.nn.Module):
    """A loader that concatenates two tensors into one parameter and transposes a third:
    the shapes vLLM's loaders take, by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.t = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
        self.calls: list[list[str]] = []

    def load_weights(self, weights):  # noqa: ANN001, ANN201 - vLLM's signature
        loaded = list(weights)
        self.calls.append([n for n, _ in loaded])
        for name, tensor in loaded:
            if name in ("q", "k"):
                self.qk.data.narrow(0, 0 if name == "q" else 2, 2).copy_(tensor)
            elif name == "t":
                self.t.data.copy_(tensor.t())  # transformed: not replayable
            # "skip" is ignored, as loaders skip what the model does not hold


def test_transformed_and_skipped_names_go_to_load_weights() -> None:
    model = _Fused()
    first = [("q", torch.ones(2, 3)), ("k", 2 * torch.ones(2, 3)),
             ("t", torch.arange(6.0).view(3, 2)), ("skip", torch.ones(1))]
    plans: dict[int, CopyPlan] = {}
    load_in_place(model, first, plans)
    assert plans[id(model)].names == {"q", "k"}
    second = [("q", 3 * torch.ones(2, 3)), ("k", 4 * torch.ones(2, 3)),
              ("t", torch.arange(6.0, 12.0).view(3, 2)), ("skip", torch.ones(1))]
    load_in_place(model, second, plans)
    assert model.calls[-1] == ["t", "skip"]
    assert torch.equal(model.qk, torch.cat([3 * torch.ones(2, 3), 4 * torch.ones(2, 3)]))
    assert torch.equal(model.t, torch.arange(6.0, 12.0).view(3, 2).t())


if __name__ == "__main__":
    check_on_vllm_mimo()
