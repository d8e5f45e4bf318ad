"""WeightPusher pieces that need no service: layout and input checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollout_service.protocol.shm import ALIGNMENT
from trainer_client.push import WeightPusher, layout, param_spec, spec_nbytes


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=50))
def test_layout_is_aligned_and_disjoint(sizes: list[int]) -> None:
    offsets, total = layout(sizes)
    assert all(o % ALIGNMENT == 0 for o in offsets)
    spans = sorted(zip(offsets, sizes))
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert offsets[-1] + sizes[-1] <= total


def test_mixed_dtypes_never_misaligned() -> None:
    tensors = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.float32),
               torch.zeros(7, dtype=torch.int8), torch.zeros(2, dtype=torch.float64)]
    sizes = [spec_nbytes(param_spec(f"t{i}", t)) for i, t in enumerate(tensors)]
    offsets, _ = layout(sizes)
    assert all(o % t.element_size() == 0 for o, t in zip(offsets, tensors))
    assert sizes == [6, 20, 7, 16]


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="transport"):
        WeightPusher("http://127.0.0.1:1", "t", transport="rdma")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_bytes"):
        WeightPusher("http://127.0.0.1:1", "t", bucket_bytes=0)
