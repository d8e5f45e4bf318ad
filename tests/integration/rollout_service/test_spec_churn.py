"""K changed at random every few engine steps under load, on the real engine: no engine
error, every request finishes with every token it asked for.

The engine starts as the service starts it with the speculation control on (the start-up
schedule holding every K; ``bench/spec_churn.py``), in this process. On the CPU (vLLM's
model runner V1, eager) a small run with ``drafter_at_k0: run`` (``skip`` needs model
runner V2). On CUDA (``gpu``-marked: vLLM's compile and CUDA graphs, model runner V2) the
issue's run: 256 requests in flight with prompts of 8-400 tokens, 1,000 changes, K = 0
among them, once with the drafter run at K = 0 and once with it skipped, with the
capture sizes the service aligns (``speculation_control.full_cuda_graphs: align``). An
H200 engine had died of an illegal memory access after K = 0 was pinned under load with
vLLM's own sizes (docs/speculation-control.md; ``batch.sh churn`` reproduces that).
H200, 2026-12-05: 2 passed (run: 1000 changes over 3345 steps, 7801/7801 requests; skip:
1000 over 3300, 7749/7749).

    python -m pytest -q -m gpu tests/integration/rollout_service/test_spec_churn.py -rA
"""

from __future__ import annotations

import os

import pytest
from vllm.platforms import current_platform

from bench.spec_churn import ChurnConfig, churn, prepare, start_engine
from rollout_service.embedded import ensure_model

IS_CUDA = current_platform.is_cuda()  # NVML only: no CUDA context before vLLM's spawn
if IS_CUDA:
    K_MAX, CONFIG = 3, ChurnConfig(concurrency=256, num_changes=1000, steps_per_change=3,
                                   prompt_tokens=(8, 400), max_tokens=(16, 256))
else:  # two shared cores: a smaller load, the same code path
    K_MAX, CONFIG = 2, ChurnConfig(concurrency=16, num_changes=100, steps_per_change=3,
                                   prompt_tokens=(8, 200), max_tokens=(8, 48))

pytestmark = [pytest.mark.gpu] if IS_CUDA else []


@pytest.mark.parametrize("drafter_at_k0", [
    "run", pytest.param("skip", marks=pytest.mark.skipif(
        not IS_CUDA, reason="drafter_at_k0: skip needs model runner V2 (CUDA)"))])
async def test_random_k_changes_under_load_never_fail_a_request(
        drafter_at_k0: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine runs in this process, whose environment vLLM's CPU platform changes
    # (LD_PRELOAD): restored afterwards, for the services later tests start from here.
    monkeypatch.setenv("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))
    if IS_CUDA:  # vLLM's defaults: compile and CUDA graphs, as served (and counted)
        model, kwargs = str(ensure_model("tiny")), {"dtype": "bfloat16", "cudagraph_metrics": True,
                                                    "gpu_memory_utilization": 0.3}
    else:
        model, kwargs = "embedded:tiny", {}
    engine, steps = start_engine(model, k_max=K_MAX, drafter_at_k0=drafter_at_k0,
                                 full_cuda_graphs="align", engine_kwargs=kwargs)
    try:
        await prepare(engine, static=False, skip=drafter_at_k0 == "skip")
        report = await churn(engine, steps, CONFIG)
    finally:
        await engine.shutdown()
    suspects = "\n".join(f"{c.at_s:.2f} s, step {c.step}, batch {c.batch_size}: {c.schedule}"
                         for c in report.last_changes)
    assert not report.errors, f"{report.summary()}\n{report.errors[:5]}\n{suspects}"
    assert report.num_changes >= CONFIG.num_changes and report.num_k0_everywhere > 0
    assert report.num_finished == report.num_requests > CONFIG.concurrency
    # The load was real: the batch filled up while K changed under it.
    assert report.max_batch_size >= CONFIG.concurrency // 2, report.summary()
    if IS_CUDA:  # the aligned sizes were in force: every graph a multiple of 12 tokens, and
        # no uniform decode fell to PIECEWISE (where the drafter's graph diverges)
        graphs = [key for key in steps.counts if key.mode != "NONE"]
        assert graphs and all(key.num_padded_tokens % 12 == 0 for key in graphs), graphs
        assert not steps.shadowed_decodes(), steps.report()
    print(report.summary())
