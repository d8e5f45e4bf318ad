"""Random MTP loss problems for hypothesis, shared by the loss's and the top-1 agreement's
loop-reference tests (``tests/unit/trainer_client/test_mtp_loss_formula.py``,
``test_mtp_accuracy.py``). Plain torch on the CPU.

A problem: hidden states per depth (batch-first), labels, a loss mask (binary, weights or
all zeros), the output layer's weight and optional bias, the scaling factor, the
per-token switch and the layout the code under test gets the hidden states in.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st


@st.composite
def problems(draw: st.DrawFn) -> dict:
    """A random MTP problem; float64 so the comparison can be tight."""
    num_depths = draw(st.integers(1, 3))
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 7))
    hidden_size, vocab = draw(st.integers(1, 5)), draw(st.integers(2, 9))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask_kind = draw(st.sampled_from(["binary", "weights", "zeros"]))
    if mask_kind == "binary":
        mask = torch.randint(0, 2, (batch, seq), generator=gen).double()
    elif mask_kind == "weights":
        mask = torch.rand(batch, seq, generator=gen, dtype=torch.float64)
    else:
        mask = torch.zeros(batch, seq, dtype=torch.float64)
    return {
        "hidden_bsh": [torch.randn(batch, seq, hidden_size, generator=gen, dtype=torch.float64)
                       for _ in range(num_depths)],
        "labels": torch.randint(0, vocab, (batch, seq), generator=gen),
        "mask": mask,
        "weight": torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64),
        "bias": (torch.randn(vocab, generator=gen, dtype=torch.float64)
                 if draw(st.booleans()) else None),
        "scaling_factor": draw(st.sampled_from([0.1, 0.3, 1.0])),
        "per_token": draw(st.booleans()),
        "layout": draw(st.sampled_from(["sbh", "bsh"])),
    }
