"""The received copy of a ``nccl`` push: a file on the server's disk, the push's byte
stream at its own offsets, written bucket after bucket.

Written by one engine worker per server while the trainer's buckets arrive (each bucket
from the worker's fixed-size ring slot, so no worker ever holds the whole checkpoint in
memory); read by every worker of that server when the push loads (a read-only shared
mapping, like the ``shm`` transport's segment: views, no copy); kept as the served
version's stored copy, from which a Ray Serve replica that (re)starts gets the current
weights without the trainer (it fetches the file from a peer replica, checking every
bucket's checksum: ``serve/peer_store.py``).

Why a file and not memory: the push loads only once every bucket has arrived and been
checked, so generation goes on with the old weights during the whole broadcast and a
broadcast that fails half-way loads nothing, and the received bytes need a home the
size of the checkpoint until then. On disk (the page cache) that home is not the
worker's memory. Never under ``/dev/shm``: that is the memory the transport avoids.

torch is imported lazily.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_service.protocol.messages import BucketInfo
from rollout_service.protocol.shm import SHM_DIR, Segment

if TYPE_CHECKING:
    import torch

__all__ = ["BucketInfo", "StoreRef", "StoreWriter", "bucket_checksum", "check_store_dir",
           "checksum_hex", "copy_checksum", "map_store"]

CHECKSUM_CHUNK_WORDS = 1 << 20
"""Words per step of :func:`bucket_checksum`: its temporaries stay at 16 MiB."""
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def bucket_checksum(data: torch.Tensor) -> int:
    """A position-dependent checksum of a byte tensor whose length is a multiple of 8,
    on its own device: ``s1 * K + s2`` over 64-bit words ``w_i`` with ``s1 = sum w_i``
    and ``s2 = sum (i + 1) w_i``, in wrapping 64-bit arithmetic (the same on CPU and CUDA:
    modular sums commute). It catches a payload shorter than announced (a stale tail)
    and reordered words; it is no cryptographic digest.

    Raises:
        ValueError: the length is not a multiple of 8.
    """
    if data.numel() % 8:
        raise ValueError(f"nbytes: {data.numel()} is not a multiple of 8")
    s1, s2 = _word_sums(data)
    return ((s1 & _MASK64) * _GOLDEN + s2) & _MASK64


def copy_checksum(data: torch.Tensor) -> int:
    """The checksum of a bucket that came without one (the frameworks' framing, whose
    length need not be a multiple of 8): :func:`bucket_checksum` of its bytes padded with
    zeros to a whole word, which is ``bucket_checksum`` itself for a whole-word bucket.
    A server's writer computes it as the bucket arrives, so that a peer's stored copy of
    the bucket can be checked as a trainer's checksummed bucket is
    (``serve/peer_store.py``)."""
    whole = data.numel() - data.numel() % 8
    s1, s2 = _word_sums(data[:whole])
    if whole < data.numel():
        tail = int.from_bytes(bytes(data[whole:].cpu().tolist()), "little")
        s1, s2 = s1 + tail, s2 + (whole // 8 + 1) * tail
    return ((s1 & _MASK64) * _GOLDEN + s2) & _MASK64


def _word_sums(data: torch.Tensor) -> tuple[int, int]:
    """``(sum w_i, sum (i + 1) w_i)`` over the 64-bit words of ``data`` (whole words)."""
    import torch

    words = data.view(torch.int64)
    positions = torch.arange(1, min(CHECKSUM_CHUNK_WORDS, max(words.numel(), 1)) + 1,
                             dtype=torch.int64, device=data.device)
    s1 = s2 = 0
    for start in range(0, words.numel(), CHECKSUM_CHUNK_WORDS):
        chunk = words[start:start + CHECKSUM_CHUNK_WORDS]
        total = int(chunk.sum().item())
        s1 += total
        s2 += start * total + int((chunk * positions[:chunk.numel()]).sum().item())
    return s1, s2


def checksum_hex(value: int) -> str:
    """The wire form of a checksum: 16 lowercase hex digits."""
    return f"{value & _MASK64:016x}"


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreRef:
    """Where a push's received stream lies on the server: the file (the stream at its own
    offsets) and the buckets it arrived in, in push order."""

    path: str
    buckets: tuple[BucketInfo, ...]

    @property
    def nbytes(self) -> int:
        return self.buckets[-1].end if self.buckets else 0


def check_store_dir(path: Path) -> Path:
    """``path`` as a store directory, created if needed.

    Raises:
        ValueError: naming ``weights_store_dir``, for a folder under /dev/shm (the memory
            the transport must not use) or one that cannot be created.
    """
    resolved = path.expanduser().resolve()
    if resolved == SHM_DIR or SHM_DIR in resolved.parents:
        raise ValueError(f"weights_store_dir: {path} is under {SHM_DIR}; the nccl transport "
                         "keeps received pushes on disk, not in shared memory")
    try:
        resolved.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"weights_store_dir: {path} cannot be created ({exc})") from exc
    return resolved


class StoreWriter:
    """Writes one push's buckets at their offsets (one worker per server)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)

    def write(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset`` (the whole of it)."""
        view = data.cast("B")
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def map_store(path: str) -> Segment:
    """The store file mapped read-only and shared (every worker of the server maps the
    same pages; on CUDA they can be pinned as the segment's are: ``PinnedSegment``).

    Raises:
        ValueError: no such file.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise ValueError(f"the push's stored copy {path} does not exist") from exc
    try:
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return Segment(os.path.basename(path), mapping, is_owner=False, read_only=True)
