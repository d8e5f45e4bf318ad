"""The CPU seeded-prefill fix on a FAKE model runner (no engine): the discarded requests'
generators are rewound by state and kept from the offset rewind that kills the engine.
The engine that dies without it: tests/integration/rollout_service/test_openai.py::
test_seeded_choices_survive_a_chunked_prefill."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import torch

from rollout_service.engines.vllm.patches.cpu_seeded_prefill import (
    _EXPECTED_PARAMETERS,
    without_offset_rewind,
)


def vllm_bookkeeping(runner: SimpleNamespace) -> str:
    """What vLLM does first: rewind every discarded request's generator by offset."""
    for index in np.nonzero(runner.discard_request_mask.np[:runner.input_batch.num_reqs])[0]:
        generator = runner.input_batch.generators.get(int(index))
        if generator is not None:
            generator.set_offset(generator.get_offset() - 4)  # raises on a CPU generator
    return "outputs"


def runner_of(seeds: list[int], discard: list[bool], outputs: list[list[int]]
              ) -> SimpleNamespace:
    generators = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
    requests = {f"r{i}": SimpleNamespace(sampling_params=SimpleNamespace(seed=s),
                                         output_token_ids=outputs[i])
                for i, s in enumerate(seeds)}
    return SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=len(seeds), generators=generators,
                                    req_ids=list(requests)),
        discard_request_mask=SimpleNamespace(np=np.array(discard)), requests=requests)


def draw(generator: torch.Generator) -> list[float]:
    return torch.rand(3, generator=generator).tolist()


def test_a_discarded_prefill_draw_is_undone_and_the_offset_rewind_avoided() -> None:
    runner = runner_of([5, 6, 7], discard=[True, False, True], outputs=[[], [], [3]])
    generators = dict(runner.input_batch.generators)
    for generator in generators.values():
        draw(generator)  # this step's sampling
    resumed_state = generators[2].get_state()
    assert without_offset_rewind(vllm_bookkeeping)(runner) == "outputs"
    assert runner.input_batch.generators == generators  # all back in the batch
    assert draw(generators[0]) == draw(torch.Generator().manual_seed(5))  # as if never drawn
    assert torch.equal(generators[2].get_state(), resumed_state)  # kept tokens: kept draw


def test_without_the_fix_vllm_raises_on_a_cpu_generator() -> None:
    runner = runner_of([5], discard=[True], outputs=[[]])
    try:
        vllm_bookkeeping(runner)
    except RuntimeError as exc:
        assert "offset" in str(exc)
    else:
        raise AssertionError("the CPU generator took an offset: the fix may be obsolete")


def test_wrapped_method_still_has_the_expected_signature() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping = inspect.unwrap(GPUModelRunner._bookkeeping_sync)
    assert tuple(inspect.signature(bookkeeping).parameters) == _EXPECTED_PARAMETERS
