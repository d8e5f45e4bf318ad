"""A replica's stored copy of the last ``nccl`` push, served to peer replicas that
(re)start, and the fetch that brings it into a new replica's own store.

Runs in each Ray Serve engine replica's process (``replica_group.py``). Like
checkpoint-engine's peer-to-peer mode for inference instances that join late
(MoonshotAI/checkpoint-engine, ``checkpoint_engine/ps.py``), a replica that starts after
a push gets its weights from a replica that has them, not from the trainer: here the
peer's stored copy of the push (``protocol/store.py``), which is exactly the trainer's
byte stream. The server is a small threaded HTTP server on a free port of the replica's
metrics host (the address is in the replica's ``/health`` report, ``store_address``),
behind the weights token, answering byte ranges of the committed copy only. The fetch
takes the push bucket by bucket, checks each against the checksum the trainer sent with
it or, for a bucket of the frameworks' framing (which carries none), the one the holders'
writers computed as it arrived (the coordinator's ``StoredPush`` keeps both), and writes
it at its offset: a peer's copy that is short or corrupt is refused, and the fetch holds
one bucket in memory.
Plain TCP: nothing goes through Ray's object store (shared memory) or ``/dev/shm``.
"""

from __future__ import annotations

import hmac
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import torch

from rollout_service.protocol.store import BucketInfo, StoreWriter, checksum_hex, copy_checksum
from rollout_service.weights.stored_copies import StoredCopies

CHUNK_BYTES = 1 << 20
"""How much of a range the server reads and writes at a time."""


class StoreServer:
    """Serves ``copies.committed`` (module docstring); ``address`` is ``host:port``.

    Args:
        copies: the replica's stored copies.
        token: the weights token every request must carry (None: refuse all).
        host: the address to bind (the replica's ``metrics_host``).
    """

    def __init__(self, copies: StoredCopies, token: str | None, host: str) -> None:
        self._httpd = ThreadingHTTPServer((host, 0), _handler(copies, token))
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        threading.Thread(target=self._httpd.serve_forever, daemon=True,
                         name="rollout-store-server").start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _handler(copies: StoredCopies, token: str | None) -> type[BaseHTTPRequestHandler]:
    expected = f"Bearer {token}".encode() if token else None

    class StoreHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            given = (self.headers.get("authorization") or "").encode()
            if expected is None or not hmac.compare_digest(given, expected):
                self.send_error(401, "weights token required")
                return
            url = urlsplit(self.path)
            committed = copies.committed
            push_id = url.path.removeprefix("/store/")
            if committed is None or committed.path != copies.path(push_id):
                self.send_error(404, f"no stored copy of push {push_id}")
                return
            query = parse_qs(url.query)
            offset, length = int(query["offset"][0]), int(query["length"][0])
            if offset < 0 or length <= 0 or offset + length > os.path.getsize(committed.path):
                self.send_error(416, "range outside the stored copy")
                return
            self.send_response(200)
            self.send_header("content-length", str(length))
            self.end_headers()
            with open(committed.path, "rb") as f:
                f.seek(offset)
                while length > 0:
                    chunk = f.read(min(CHUNK_BYTES, length))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    length -= len(chunk)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # one line per bucket of every fetch: not worth the replica's log

    return StoreHandler


def fetch_store(peers: list[str], token: str | None, push_id: str,
                buckets: list[BucketInfo], path: str, *,
                copy_checksums: dict[int, str] | None = None, timeout_s: float = 600.0) -> str:
    """Copy push ``push_id``'s stored copy from the first peer that has it whole into
    ``path``; returns that peer's address. ``copy_checksums``: the checksums of the
    buckets that came without one, by index (``StoredPush.copy_checksums``).

    Raises:
        RuntimeError: no peer served every bucket with its checksum (each peer's failure
            named).
    """
    failures = []
    headers = {"authorization": f"Bearer {token}"} if token else {}
    for peer in peers:
        writer = StoreWriter(path)
        try:
            with httpx.Client(base_url=f"http://{peer}", headers=headers,
                              timeout=timeout_s) as client:
                for bucket in buckets:
                    _fetch_bucket(client, push_id, bucket, writer,
                                  (copy_checksums or {}).get(bucket.index))
            return peer
        except (httpx.HTTPError, ValueError) as exc:
            failures.append(f"{peer}: {exc}")
        finally:
            writer.close()
    raise RuntimeError(f"no peer served push {push_id}'s stored copy: "
                       + ("; ".join(failures) or "none listed"))


def _fetch_bucket(client: httpx.Client, push_id: str, bucket: BucketInfo,
                  writer: StoreWriter, copy_checksum_hex: str | None) -> None:
    """One bucket of a peer's copy, checked (``copy_checksum_hex``: the holders' checksum
    of a bucket that came without one), written at its offset."""
    expected = bucket.checksum or copy_checksum_hex
    if expected is None:  # nothing to check it by: a copy that might be anything
        raise ValueError(f"bucket {bucket.index}: no checksum to check a peer's copy by")
    response = client.get(f"/store/{push_id}",
                          params={"offset": bucket.offset, "length": bucket.nbytes})
    response.raise_for_status()
    data = bytearray(response.content)
    if len(data) != bucket.nbytes:
        raise ValueError(f"bucket {bucket.index}: {len(data)} bytes, the push had "
                         f"{bucket.nbytes}")
    checksum = checksum_hex(copy_checksum(torch.frombuffer(data, dtype=torch.uint8)))
    if checksum != expected:
        whose = "the trainer's" if bucket.checksum else "its holders' on arrival"
        raise ValueError(f"bucket {bucket.index}: checksum {checksum}, {whose} {expected}")
    writer.write(bucket.offset, memoryview(data))
