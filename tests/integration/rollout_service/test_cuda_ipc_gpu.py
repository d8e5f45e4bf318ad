"""CUDA IPC handles across two processes on one GPU, through their JSON form.

Process A (spawned) plays the trainer: it makes bf16 and fp32 tensors on cuda:0 (plain,
sliced from a larger tensor, several views of one allocation, and a byte buffer holding
two of them, as the trainer's staging buffer does), exports each with
:func:`export_handle` (the byte buffer with :func:`export_byte_buffer`, as
``WeightPusher`` does for begin's ``cuda_ipc_buffer``), and sends ``model_dump_json()``
strings, the tensors' bytes and their SHA-256 over a multiprocessing queue. This process
plays the engine worker: it parses the JSON, opens every handle with :func:`open_handle`
and checks the bytes are bit-identical; then A overwrites a tensor and this process sees
the change through its mapping (no copy was made). A handle naming another GPU is
refused before anything is mapped.

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

from rollout_service.protocol.cuda_ipc import (
    ByteBufferHandle,
    CudaIpcHandle,
    export_byte_buffer,
    export_handle,
    open_handle,
)
from rollout_service.protocol.tensors import view_in

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TIMEOUT_S = 120
OTHER_GPU = "GPU-00000000-0000-0000-0000-000000000000"
STAGED = {"embed.weight": 0, "norm.weight": 257 * 96 * 2}
"""Byte offsets of two tensors in the ``staged`` byte buffer."""


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


def _staged(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A byte buffer holding copies of the ``STAGED`` tensors at their offsets."""
    staged = torch.zeros(STAGED["norm.weight"] + 96 * 4, dtype=torch.uint8, device="cuda:0")
    for name, offset in STAGED.items():
        tensor = tensors[name]
        view_in(staged, offset, list(tensor.shape),
                str(tensor.dtype).removeprefix("torch.")).copy_(tensor)
    return staged


def trainer(queue: Any, verified: Any, written: Any, done: Any) -> None:
    """Process A: export every tensor, send JSON + bytes + digests, then keep them alive."""
    tensors = _trainer_tensors()
    tensors["staged"] = _staged(tensors)
    torch.cuda.synchronize()
    for name, tensor in tensors.items():
        export = export_byte_buffer if name == "staged" else export_handle
        handle = export(tensor, name)
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
        wrong = None
        while (item := queue.get(timeout=TIMEOUT_S)) is not None:
            name, text, raw, digest = item
            assert isinstance(text, str)  # JSON only crosses the process boundary
            kind = ByteBufferHandle if name == "staged" else CudaIpcHandle
            handle = kind.model_validate_json(text)
            if name == "wrong-gpu":
                wrong = handle
                continue
            tensor = open_handle(handle, device_index=0)
            assert tensor.device == torch.device("cuda:0") and not tensor.requires_grad
            mine = _raw(tensor)
            assert hashlib.sha256(mine).hexdigest() == digest, name
            assert mine == raw, name
            opened[name] = tensor
        del tensor  # the mappings live in `opened` only
        assert len(opened) == 8
        assert {str(t.dtype) for t in opened.values()} == {"torch.bfloat16", "torch.float32",
                                                           "torch.uint8"}
        for name, offset in STAGED.items():  # views into the buffer, bit-identical
            own = opened[name]
            view = view_in(opened["staged"], offset, list(own.shape),
                           str(own.dtype).removeprefix("torch."))
            assert view.data_ptr() == opened["staged"].data_ptr() + offset
            assert _raw(view) == _raw(own), name

        assert wrong is not None
        with pytest.raises(ValueError, match=f"gpu_uuid: the handle's memory is on GPU "
                                             f"{OTHER_GPU}"):
            open_handle(wrong, device_index=0)

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
