"""What a ``cuda_ipc`` push's control messages cost on the CPU, by placement format.

The bytes of a ``cuda_ipc`` push never travel: its cost beyond the GPU copies is the
control path, every tensor's placement built and sent by the trainer, validated by the
service, and handed to vLLM's workers twice (the main model's load and the drafter's).
This script times that path, with no GPU and no engine, for two formats of the same
staged push (every tensor in the trainer's staging buffer):

- ``handle per tensor``: each placement carries the staging buffer's handle and an
  offset (how the staged push was sent before begin named the buffer, and how an
  unstaged push still sends its per-tensor exports);
- ``staging buffer``: begin names the buffer once (``cuda_ipc_buffer``) and each
  placement carries its offset only.

The handle is a well-formed description, not a live export (its values do not change
what validating it costs). The steps timed per push, with the functions the service
and the workers run:

- trainer: build the placements and the update request, dump its JSON;
- service: parse and validate the request, check every placement against the push
  (``weights.intake``), check for overlaps, build the engine's update and its two
  ``update_info`` dicts (main, drafter);
- workers: each ``update_info`` pickled and unpickled (what vLLM's RPC does with it)
  and parsed into a ``PushUpdateInfo``, as each of the two loads does.

Rounds alternate the formats, the first in turn; medians with min - max.

    python -m bench.push_messages --size 1b --rounds 15
"""

from __future__ import annotations

import argparse
import base64
import pickle
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from rollout_service.embedded.tiny_mimo import checkpoint_shapes, model_size
from rollout_service.engines.vllm.transfer import PushUpdateInfo, update_info
from rollout_service.protocol import messages
from rollout_service.protocol.cuda_ipc import ByteBufferHandle
from rollout_service.protocol.placement import CudaIpcLocation, TensorPlacement
from rollout_service.protocol.tensors import DTYPE_BYTES, TensorMeta, numel
from rollout_service.weights.intake import (
    ActivePush,
    build_update,
    check_no_overlap,
    validate_announcement,
    validate_placement,
)

FORMATS = ("handle per tensor", "staging buffer")
STEPS = ("trainer", "service", "workers")
DTYPE = "bfloat16"


def staging_handle(nbytes: int) -> ByteBufferHandle:
    """A staging buffer's description as ``export_byte_buffer`` writes it (values made
    up)."""
    return ByteBufferHandle(
        gpu_uuid="GPU-8c2a7e0e-1d3b-4f5a-9e6c-7b8d9a0b1c2d", shape=[nbytes], stride=[1],
        storage_offset=0, dtype="uint8", storage_handle=base64.b64encode(bytes(64)).decode(),
        storage_size_bytes=nbytes, storage_offset_bytes=0,
        ref_counter_handle=base64.b64encode(b"/torch_4242_1234567890_0").decode(),
        ref_counter_offset=0, event_handle=base64.b64encode(bytes(64)).decode(),
        event_sync_required=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class Push:
    """One push's fixed parts: the checkpoint, its layout in the buffer, the buffer."""

    shapes: dict[str, tuple[int, ...]]
    offsets: dict[str, int]
    buffer: ByteBufferHandle

    @classmethod
    def of(cls, size: str) -> Push:
        shapes = checkpoint_shapes(model_size(size))
        offsets, end = {}, 0
        for name, shape in shapes.items():
            offsets[name] = end
            end += -(-numel(shape) * DTYPE_BYTES[DTYPE] // 256) * 256  # 256-byte aligned
        return cls(shapes=shapes, offsets=offsets, buffer=staging_handle(end))

    def begin(self, named_buffer: bool) -> messages.PushBeginRequest:
        return messages.PushBeginRequest(
            version=1, transport="cuda_ipc", total_bytes=sum(
                numel(s) * DTYPE_BYTES[DTYPE] for s in self.shapes.values()),
            params=[messages.ParamSpec(name=n, shape=list(s), dtype=DTYPE)
                    for n, s in self.shapes.items()],
            cuda_ipc_buffer=self.buffer if named_buffer else None)


def one_push(push: Push, named_buffer: bool) -> dict[str, float]:
    """Seconds per step of one push's control path in one format."""
    begin = push.begin(named_buffer)
    checkpoint = {n: TensorMeta(shape=s, dtype=DTYPE) for n, s in push.shapes.items()}
    active = ActivePush(push_id="p" * 32, request=begin, expected=validate_announcement(
        begin, checkpoint, transport="cuda_ipc"), timeout_s=60.0)
    seconds: dict[str, float] = {}

    def timed(step: str, work: Callable[[], object]) -> object:
        start = time.perf_counter()
        result = work()
        seconds[step] = time.perf_counter() - start
        return result

    def trainer() -> str:
        placements = [TensorPlacement(name=n, dtype=DTYPE, shape=s, location=CudaIpcLocation(
            handle=None if named_buffer else push.buffer, offset=push.offsets[n]))
            for n, s in push.shapes.items()]
        return messages.PushUpdateRequest(push_id=active.push_id,
                                          tensors=placements).model_dump_json()

    def service(body: str) -> list[dict]:
        request = messages.PushUpdateRequest.model_validate_json(body)
        for placement in request.tensors:
            validate_placement(active, placement)
            active.placements[placement.name] = placement
        check_no_overlap(active.placements.values(), begin.cuda_ipc_buffer)
        update = build_update(active)
        return [update_info(update, draft=draft) for draft in (False, True)]

    def workers(infos: list[dict]) -> None:
        for info in infos:
            parsed = PushUpdateInfo(**pickle.loads(pickle.dumps(info)))
            assert len(parsed.placements) == len(push.shapes)

    body = timed("trainer", trainer)
    infos = timed("service", lambda: service(body))  # type: ignore[arg-type]
    timed("workers", lambda: workers(infos))  # type: ignore[arg-type]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1b", choices=("tiny", "small", "1b", "7b"))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    push = Push.of(args.size)
    for named in (False, True):
        one_push(push, named)  # warm-up: pydantic's and the allocator's first calls
    runs: dict[str, list[dict[str, float]]] = {f: [] for f in FORMATS}
    for r in range(args.rounds):
        order = FORMATS if r % 2 == 0 else FORMATS[::-1]
        for fmt in order:
            runs[fmt].append(one_push(push, named_buffer=fmt == "staging buffer"))

    def ms(fmt: str, step: str | None) -> tuple[float, float, float]:
        xs = [1e3 * (sum(run.values()) if step is None else run[step]) for run in runs[fmt]]
        return statistics.median(xs), min(xs), max(xs)

    table = Table(title=f"cuda_ipc control path, {len(push.shapes)} tensors ({args.size}), "
                        f"{args.rounds} rounds: median ms (min - max)")
    table.add_column("format")
    for step in (*STEPS, "total"):
        table.add_column(step, justify="right")
    for fmt in FORMATS:
        table.add_row(fmt, *(f"{m:.2f} ({lo:.2f} - {hi:.2f})"
                             for m, lo, hi in (ms(fmt, s) for s in (*STEPS, None))))
    console = Console()
    console.print(table)
    before, after = ms(FORMATS[0], None)[0], ms(FORMATS[1], None)[0]
    console.print(f"staging buffer / handle per tensor (total, medians): {after / before:.3f}")


if __name__ == "__main__":
    main()
