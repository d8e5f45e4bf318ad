"""POSIX shared-memory segments: the ``shm`` transport's data path.

The trainer process creates a segment (a file under ``/dev/shm``), keeps it for
its whole run and writes every push into it; vLLM's worker processes map the
same segment and load tensors straight from it. The bytes are copied twice in
all: trainer memory -> segment, segment -> model parameters. Only the segment's
name and tensor offsets travel over HTTP.

Segments are opened with ``mmap`` directly rather than through
``multiprocessing.shared_memory``, whose resource tracker unlinks segments it
did not create when the reading process exits.
"""

from __future__ import annotations

import mmap
import os
import re
import warnings
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from rollout_service.protocol.tensors import numel

if TYPE_CHECKING:  # the service process validates names without importing torch
    import torch

SHM_DIR = Path("/dev/shm")
ALIGNMENT = 64
"""Byte alignment of every tensor in a segment: a cache line, and a multiple of
every dtype's size, so tensors of different dtypes never sit misaligned."""
_MADV_POPULATE_READ = 22  # Linux 5.14+; Python 3.11's mmap has no constant for it
SEGMENT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$"
"""A plain file name under /dev/shm: no path separators, no leading dot."""
_NAME = re.compile(SEGMENT_NAME_PATTERN)


def align(offset: int) -> int:
    """``offset`` rounded up to :data:`ALIGNMENT`."""
    return -(-offset // ALIGNMENT) * ALIGNMENT


def segment_path(name: str) -> Path:
    """The file behind segment ``name``.

    Raises:
        ValueError: a name that is not a plain file name (no path tricks).
    """
    if not _NAME.match(name):
        raise ValueError(f"segment: {name!r} is not a valid segment name "
                         f"(letters, digits, '_', '.', '-'; no '/')")
    return SHM_DIR / name


class Segment:
    """A mapped shared-memory segment; use :meth:`create` or :meth:`attach`."""

    def __init__(self, name: str, mapping: mmap.mmap, *, is_owner: bool,
                 read_only: bool = False) -> None:
        self.read_only = read_only
        self.name = name
        self.nbytes = len(mapping)
        self._mmap = mapping
        self._is_owner = is_owner

    @classmethod
    def create(cls, name: str, nbytes: int) -> Segment:
        """Create (or replace) a segment of ``nbytes``, readable by this user only."""
        path = segment_path(name)
        fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mapping, is_owner=True)

    @classmethod
    def attach(cls, name: str, *, shared_read_only: bool = False) -> Segment:
        """Map an existing segment for reading.

        The mapping is private copy-on-write: torch gets a writable buffer (it
        warns on read-only ones) and a stray write can never reach the trainer.
        With ``shared_read_only`` it is the trainer's own pages, read-only: what
        :class:`PinnedSegment` must pin, since pinning a private writable mapping
        would break copy-on-write and pin private copies that the trainer's next
        push never reaches.
        Its pages are then mapped for reading in one call
        (``MADV_POPULATE_READ``) instead of one fault per 4 KiB during the load.
        Not ``MAP_POPULATE``: on a writable private mapping it pre-faults for
        writing, which copies every page (measured: 0.3 s for 211 MB).

        Raises:
            ValueError: no such segment.
        """
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise ValueError(f"segment: {name!r} does not exist under {SHM_DIR}") from exc
        try:
            size = os.fstat(fd).st_size
            if shared_read_only:
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            else:
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            mapping.madvise(_MADV_POPULATE_READ)
        except OSError:  # Linux < 5.14: pages fault in lazily instead
            pass
        return cls(name, mapping, is_owner=False, read_only=shared_read_only)

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor view of the segment's bytes at ``offset`` (no copy)."""
        import torch

        with warnings.catch_warnings():
            if self.read_only:  # torch warns on buffers it cannot write; nothing writes here
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(self._mmap, dtype=dtype, count=numel(shape), offset=offset)
        return flat.view(shape)

    def address(self, offset: int = 0) -> int:
        """The memory address of byte ``offset`` (for single-threaded ``memmove``)."""
        import torch

        return self.tensor(offset, torch.uint8, (1,)).data_ptr()

    def close(self) -> None:
        """Unmap; the owner also removes the segment."""
        try:
            self._mmap.close()
        except BufferError:
            # A tensor view still exports the buffer; the mapping goes with it.
            pass
        if self._is_owner:
            segment_path(self.name).unlink(missing_ok=True)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class PinnedSegment:
    """The segment registered with CUDA as page-locked memory in this process.

    A copy between a GPU and pageable memory goes through a driver staging buffer, in
    chunks, synchronously; with registered memory it runs at PCIe speed as one DMA
    and can overlap the next tensor's. The trainer registers its segment for its
    device-to-host copies, an engine worker on CUDA for its host-to-device loads;
    each once per segment (both keep the segment across pushes), unregistered
    before the segment is unmapped.

    Raises:
        RuntimeError: CUDA refused to register the memory (the caller may go on
            unpinned, only slower).
    """

    def __init__(self, segment: Segment) -> None:
        import torch

        self._segment = segment
        self._address = segment.address(0)
        # A read-only mapping is registered read-only (cudaHostRegisterReadOnly): the
        # driver then pins the shared pages without asking for write access.
        flags = _CUDA_HOST_REGISTER_READ_ONLY if segment.read_only else 0
        err = torch.cuda.cudart().cudaHostRegister(self._address, segment.nbytes, flags)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the push segment failed: error {int(err)}")

    def close(self) -> None:
        import torch

        torch.cuda.cudart().cudaHostUnregister(self._address)


_CUDA_HOST_REGISTER_READ_ONLY = 0x08
"""``cudaHostRegisterReadOnly`` (CUDA 11.1+, ``cuda_runtime_api.h``)."""
