"""The two ways an engine maps the trainer's segment.

The CPU engine maps it private copy-on-write (a stray write stays in the engine);
an engine on CUDA maps the trainer's pages shared and read-only, what it pins
(``PinnedSegment``; pinning needs CUDA, run by the ``cuda-shm`` GPU target). Both
must read what the trainer wrote for the *next* push through the same mapping, since
the engine keeps it across pushes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from rollout_service.protocol.shm import Segment


@pytest.mark.parametrize("shared_read_only", [False, True])
def test_a_kept_mapping_reads_the_trainers_next_push(shared_read_only: bool) -> None:
    with Segment.create("mtp-rollout-test-attach", 4096) as trainer:
        trainer.tensor(0, torch.float32, (4,)).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        engine = Segment.attach(trainer.name, shared_read_only=shared_read_only)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no warning about a non-writable buffer
                first = engine.tensor(0, torch.float32, (4,)).clone()
            trainer.tensor(0, torch.float32, (4,)).copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))
            second = engine.tensor(0, torch.float32, (4,)).clone()
            assert first.tolist() == [1.0, 2.0, 3.0, 4.0]
            assert second.tolist() == [5.0, 6.0, 7.0, 8.0]
            assert engine.read_only is shared_read_only
            assert engine.address(16) == engine.address(0) + 16
        finally:
            engine.close()
