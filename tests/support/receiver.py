"""A local weight receiver: the service's ``/weights/*`` protocol with no engine behind it.

For trainer-side tests and timings that must not depend on an inference engine (the GPU
machine has no vLLM): it speaks the same JSON messages (``rollout_service.protocol.messages``),
remembers where every announced tensor lies in the trainer's shared-memory segment, and
:meth:`LocalReceiver.digests` hashes those bytes afterwards (outside any timed push), so
a test can prove that what arrived is what the trainer exported. It loads nothing into
any model and does none of the service's validation against a checkpoint: it is a
receiver, not a fake of the service. Runs a stdlib HTTP server on a thread of the test
process.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from rollout_service.protocol import messages
from rollout_service.protocol.placement import ShmLocation, TensorPlacement
from rollout_service.protocol.shm import Segment


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (any device, any dtype)."""
    data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


class LocalReceiver:
    """Accepts pushes at ``url``; :meth:`digests` reads back the last finished push.

    Args:
        reject_begin_with: answer every ``begin`` with this HTTP status (to test how a
            trainer survives a refused push), or None to accept.
    """

    def __init__(self, *, reject_begin_with: int | None = None) -> None:
        self.reject_begin_with = reject_begin_with
        self.versions: list[int] = []
        self._finished: list[TensorPlacement] | None = None
        self._begin: messages.PushBeginRequest | None = None
        self._placements: list[TensorPlacement] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                status, payload = receiver.handle(self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> LocalReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def handle(self, path: str, body: bytes) -> tuple[int, dict]:
        if path == "/weights/begin":
            if self.reject_begin_with is not None:
                return self.reject_begin_with, {"error": {"message": "refused by the test"}}
            self._begin = messages.PushBeginRequest.model_validate_json(body)
            self._placements = []
            return 200, messages.PushBeginResponse(push_id="local", timeout_s=60.0).model_dump()
        if path == "/weights/update":
            self._placements += messages.PushUpdateRequest.model_validate_json(body).tensors
            expected = 0 if self._begin is None else len(self._begin.params)
            return 200, messages.PushUpdateResponse(num_received=len(self._placements),
                                                    num_expected=expected).model_dump()
        if path == "/weights/finish" and self._begin is not None:
            return 200, self._finish(self._begin).model_dump()
        return 404, {"error": {"message": f"no push in progress for {path}"}}

    def _finish(self, begin: messages.PushBeginRequest) -> messages.PushFinishResponse:
        self._finished = self._placements
        self.versions.append(begin.version)
        timings = messages.PushTimings(pause_s=0.0, load_main_s=0.0, finalize_main_s=0.0,
                                       load_draft_s=0.0, finalize_draft_s=0.0, resume_s=0.0,
                                       total_s=0.0)
        self._begin = None
        return messages.PushFinishResponse(version=begin.version, target=begin.target,
                                           num_bytes=begin.total_bytes, timings=timings)

    def digests(self) -> dict[str, str]:
        """SHA-256 per tensor of the last finished push, read from the trainer's segment
        (call it before the pusher is closed or pushes again)."""
        if self._finished is None:
            raise RuntimeError("no push finished")
        digests, segments = {}, {}
        try:
            for placement in self._finished:
                location = placement.location
                assert isinstance(location, ShmLocation), "the local receiver reads shm pushes"
                if location.segment not in segments:
                    segments[location.segment] = Segment.attach(location.segment)
                data = segments[location.segment].tensor(location.offset, torch.uint8,
                                                         (placement.nbytes,))
                digests[placement.name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        finally:
            for segment in segments.values():
                segment.close()
        return digests
