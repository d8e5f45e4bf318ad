"""A server's stored copies of its ``nccl`` pushes: the one arriving, and the one served.

Runs in the service process (standalone, or a Ray Serve replica); the files themselves
are written by the engine's first worker (``engines/bucket_receiver.py``) and read
by every worker when the push loads (``protocol/store.py``). The served version's copy
stays until the next push commits: it is what a Ray Serve replica that (re)starts
fetches from a peer (``serve/peer_store.py``). A push that fails leaves no file.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from rollout_service.protocol.store import StoreRef, check_store_dir


class StoredCopies:
    """The stored copies under one folder.

    Args:
        folder: where they go (``weights_store_dir``); None: a new temporary folder,
            removed by :meth:`close`.
    """

    def __init__(self, folder: Path | None) -> None:
        self._is_temporary = folder is None
        self.folder = check_store_dir(
            Path(tempfile.mkdtemp(prefix="mtp-rollout-store-")) if folder is None else folder)
        if self._is_temporary:  # a checkpoint-sized file must not outlive the service
            atexit.register(shutil.rmtree, self.folder, ignore_errors=True)
        self.committed: StoreRef | None = None
        """The served version's copy (None before the first ``nccl`` push)."""
        self.committed_checksums: dict[int, str] = {}
        """Its buckets that came without a checksum (the frameworks' framing): each one's
        checksum as this server's writer computed it on arrival (``store.copy_checksum``),
        by index; what a peer fetching the copy checks those buckets by."""

    def path(self, push_id: str) -> str:
        return str(self.folder / f"push-{push_id}.bin")

    def commit(self, store: StoreRef, copy_checksums: dict[int, str] | None = None) -> None:
        """``store`` is now the served version's copy (``copy_checksums``: its unchecksummed
        buckets' checksums); the previous one goes."""
        previous, self.committed = self.committed, store
        self.committed_checksums = dict(copy_checksums or {})
        if previous is not None and previous.path != store.path:
            Path(previous.path).unlink(missing_ok=True)

    def discard(self, push_id: str) -> None:
        """A push that did not load: its file (what arrived of it) goes."""
        path = self.path(push_id)
        if self.committed is None or self.committed.path != path:
            Path(path).unlink(missing_ok=True)

    def close(self) -> None:
        if self._is_temporary:
            shutil.rmtree(self.folder, ignore_errors=True)
