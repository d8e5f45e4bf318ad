"""A stand-in for the service's CLI that only answers ``GET /health`` (a fake: no engine).

``python -m tests.support.health_only_server serve --host H --port P`` binds ``P`` at once
and answers ``{"status": "ok"}``; when the port is taken it exits 1 with the line uvicorn
prints in that case. What ``ServiceProcess``'s start-again-on-another-port needs, without
the minute a real engine takes to start.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    try:
        server = HTTPServer((args.host, args.port), Health)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
              f"('{args.host}', {args.port}): address already in use", flush=True)
        sys.exit(1)
    server.serve_forever()


if __name__ == "__main__":
    main()
