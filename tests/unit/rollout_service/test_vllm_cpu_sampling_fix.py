"""The CPU expand-kernel replacement against a plain reference (no engine)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollout_service.engines.vllm.patches.cpu_sampling import _EXPECTED_PARAMETERS, expand_to_tokens


@given(st.lists(st.tuples(st.floats(0.0, 2.0, width=32), st.integers(0, 4)), min_size=1,
                max_size=12),
       st.sampled_from([torch.float32, torch.int32, torch.int64]))
def test_expand_matches_reference(rows: list[tuple[float, int]], dtype: torch.dtype) -> None:
    values = torch.tensor([v if dtype.is_floating_point else int(v * 10) for v, _ in rows],
                          dtype=dtype)
    counts = [n for _, n in rows]
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    output = torch.full((sum(counts) + 3,), -7, dtype=dtype)
    expand_to_tokens(output, values, cu, replace_from=0, replace_to=1)
    expected = [1 if v == 0 else v for v, n in zip(values.tolist(), counts) for _ in range(n)]
    assert output[: sum(counts)].tolist() == pytest.approx(expected)
    assert output[sum(counts):].tolist() == [-7] * 3  # nothing past the tokens is touched


def test_expand_keeps_fractional_temperatures() -> None:
    output = torch.empty(3)
    expand_to_tokens(output, torch.tensor([0.7, 1.3]), torch.tensor([1, 3]), 0, 1)
    assert output.tolist() == pytest.approx([0.7, 1.3, 1.3])


def test_replaced_function_still_has_the_expected_signature() -> None:
    import inspect

    from vllm.utils import cpu_triton_utils

    assert tuple(inspect.signature(cpu_triton_utils._expand_kernel_impl).parameters) == \
        _EXPECTED_PARAMETERS
