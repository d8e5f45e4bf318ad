"""CUDA IPC handles across two processes on one GPU, through their JSON form.

Process A (spawned) plays the trainer: it makes bf16 and fp32 tensors on cuda:0
(plain, sliced from a larger tensor, several views of one allocation), exports
each with :func:`export_handle`, and sends ``model_dump_json()`` strings, the
tensors' bytes and their SHA-256 over a multiprocessing queue. This process
plays the engine worker: it parses the JSON, opens every handle with
:func:`open_handle` and checks the bytes are bit-identical; then A overwrites a
tensor and this process sees the change through its mapping (no copy was made).
A handle naming another GPU is refused before anything is mapped.

Imports only torch, pydantic, pytest, the stdlib and ``rollout_service.protocol``
(no vLLM, no fastapi). Skipped without CUDA. Run alone (tests/integration/conftest.py needs
the service's dependencies, hence ``--noconftest``):

    python -m pytest --noconftest -m gpu tests/integration/rollout_service/test_cuda_ipc_gpu.py -rA
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from typing import Any

import pytest
import torch

from rollout_service.protocol.cuda_ipc import CudaIpcHandle, export_handle, open_handle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TIMEOUT_S = 120
OTHER_GPU = "GPU-00000000-0000-0000-0000-000000000000"


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _trainer_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda:0").manual_seed(0)
    big = torch.randn(300, 64, device="cuda:0", generator=g, dtype=torch.float32)
    shared = torch.randn(5000, device="cuda:0", generator=g).to(torch.bfloat16)
    return {
        "embed.weight": torch.randn(257, 96, device="cuda:0", generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(96, device="cuda:0", generator=g, dtype=torch.float32),
        "layer.0.scale": torch.randn(3, 1, 4, device="cuda:0", generator=g).to(torch.bfloat16),
        "big.slice": big[100:160],                    # storage offset > 0
        "shared.a": shared[:1000].view(40, 25),       # two views of one allocation
        "shared.b": shared[1000:4000].view(3, 1000),
        "large.weight": torch.randn(2048, 1024, device="cuda:0", generator=g,
                                    dtype=torch.float32),
    }


def trainer(queue: Any, verified: Any, written: Any, done: Any) -> None:
    """Process A: export every tensor, send JSON + bytes + digests, then keep them alive."""
    tensors = _trainer_tensors()
    torch.cuda.synchronize()
    for name, tensor in tensors.items():
        handle = export_handle(tensor, name)
        raw = _raw(tensor)
        queue.put((name, handle.model_dump_json(), raw, hashlib.sha256(raw).hexdigest()))
    # Not a new export (every export must be opened once, or torch keeps the memory):
    # the last one's description, pointing at another GPU.
    wrong = handle.model_copy(update={"gpu_uuid": OTHER_GPU})
    queue.put(("wrong-gpu", wrong.model_dump_json(), b"", ""))
    queue.put(None)
    if not verified.wait(TIMEOUT_S):
        return
    tensors["norm.weight"].fill_(7.0)  # the receiver must see this through its mapping
    torch.cuda.synchronize()
    written.set()
    done.wait(TIMEOUT_S)  # the receiver maps the memory until it says so


def test_handles_cross_processes_as_json_bit_identical() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    verified, written, done = ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=trainer, args=(queue, verified, written, done), daemon=True)
    proc.start()
    opened: dict[str, torch.Tensor] = {}
    try:
        wrong = last = None
        while (item := queue.get(timeout=TIMEOUT_S)) is not None:
            name, text, raw, digest = item
            assert isinstance(text, str)  # JSON only crosses the process boundary
            handle = CudaIpcHandle.model_validate_json(text)
            if name == "wrong-gpu":
                wrong = handle
                continue
            tensor = open_handle(handle, device_index=0, shape=handle.shape,
                                 dtype=handle.dtype)
            assert tensor.device == torch.device("cuda:0") and not tensor.requires_grad
            mine = _raw(tensor)
            assert hashlib.sha256(mine).hexdigest() == digest, name
            assert mine == raw, name
            opened[name] = tensor
            last = handle
        del tensor  # the mappings live in `opened` only
        assert len(opened) == 7
        assert {str(t.dtype) for t in opened.values()} == {"torch.bfloat16", "torch.float32"}

        assert wrong is not None
        with pytest.raises(ValueError, match=f"gpu_uuid: the handle's memory is on GPU "
                                             f"{OTHER_GPU}"):
            open_handle(wrong, device_index=0, shape=wrong.shape, dtype=wrong.dtype)
        assert last is not None
        with pytest.raises(ValueError, match="shape: the handle describes"):
            open_handle(last, device_index=0, shape=[1, *last.shape], dtype=last.dtype)

        verified.set()
        assert written.wait(TIMEOUT_S)
        assert torch.equal(opened["norm.weight"].cpu(), torch.full((96,), 7.0))
    finally:
        opened.clear()
        torch.cuda.synchronize()
        done.set()
        proc.join(TIMEOUT_S)
    assert proc.exitcode == 0


def test_export_refuses_what_it_cannot_share() -> None:
    with pytest.raises(ValueError, match="'w' has strides"):
        export_handle(torch.zeros(4, 3, device="cuda:0").t(), "w")
    with pytest.raises(ValueError, match="'w' is on cpu"):
        export_handle(torch.zeros(4, 3), "w")
    with pytest.raises(ValueError, match="'w' is empty"):
        export_handle(torch.zeros(0, 3, device="cuda:0"), "w")
