"""The ``nccl`` transport's fault table: each fault of issue 26 against a Ray Serve app of two
real vLLM CPU replicas on two nodes of a Ray cluster started on this host (gloo standing
in for NCCL), what each replica served after it, whether any engine process died, and how
long until the deployment took a push again.

Runs in the caller's process (the Ray driver and the trainer; a spawned process is the
trainer that dies). Before each case the app serves one version on both replicas (their
checksums equal). A case breaks one push (``tests/support/faulty_trainer.py``: a bucket
that stalls, comes short or long, a trainer killed mid-broadcast; or a second trainer, or a
replica killed mid-update), then:

- *answer*: what the broken push got (HTTP status), and after how long;
- *replicas served*: each replica's checksums against the ones before (``old``: the same
  bytes; a replica that restarted is matched against the same, after it caught up);
- *died*: engine replica processes gone that the case did not kill itself;
- *recovered after*: from the fault to the end of the next push, made by a new trainer in
  a new group, that loaded on every replica (the killed replica's replacement included:
  it takes the current version from its peer's stored copy before it serves).

    python -m bench.weight_sync_faults
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file

from rollout_service.client import ServiceError
from rollout_service.embedded import ensure_model
from rollout_service.serve.config import parse_serve_config
from rollout_service.tools.ray_cluster import serve_on_nodes
from tests.support.faulty_trainer import break_bucket, push_and_die
from trainer_client.push import WeightPusher

TOKEN = "faults-weights-token"
BUCKET_BYTES = 1 << 20
STALL_TIMEOUT_S = 5.0
HEADERS = {"authorization": f"Bearer {TOKEN}"}
CONFIG = {"model": "embedded:tiny", "mtp": {"num_speculative_tokens": 1},
          "weights_token": TOKEN, "num_replicas": 2, "weights_transport": "nccl",
          "weights_bucket_bytes": BUCKET_BYTES, "weights_group_timeout_s": 30.0,
          "health_check_period_s": 1.0, "health_check_timeout_s": 10.0,
          "push_ack_timeout_s": 120.0, "metrics_host": "127.0.0.1",
          "ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": {
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}}}}
TENSORS = str(Path(ensure_model("tiny")) / "model.safetensors")


class Deployment:
    """The app under test, seen over HTTP."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.original = load_file(TENSORS)

    def get(self, path: str) -> dict:
        response = httpx.get(f"{self.url}{path}", headers=HEADERS, timeout=300)
        response.raise_for_status()
        return response.json()

    def version(self) -> int:
        status = self.get("/weights/status")
        return max(v for v in (status["main_version"], status["draft_version"], 0)
                   if v is not None)

    def replicas(self) -> list[dict]:
        return [r for r in self.get("/health")["replicas"] if r["status"] != "gone"]

    def engine_pids(self) -> dict[int, set[int]]:
        """Each replica process and its engine processes (vLLM's core and worker)."""
        return {r["pid"]: {p.pid for p in psutil.Process(r["pid"]).children(recursive=True)}
                for r in self.replicas()}

    def changed(self, step: float) -> dict[str, torch.Tensor]:
        return {**self.original, "lm_head.weight": self.original["lm_head.weight"] + step}

    def push(self, tensors: dict[str, torch.Tensor], **options: object) -> None:
        with WeightPusher(self.url, TOKEN, transport="nccl", bucket_bytes=BUCKET_BYTES,
                          **options) as pusher:  # type: ignore[arg-type]
            pusher.push(tensors.items(), version=self.version() + 1)


def broken_push(fault: str) -> Callable[[Deployment], None]:
    def run(app: Deployment) -> None:
        options = {"group_timeout_s": STALL_TIMEOUT_S} if fault == "stall" else {}
        with WeightPusher(app.url, TOKEN, transport="nccl", bucket_bytes=BUCKET_BYTES,
                          **options) as pusher:  # type: ignore[arg-type]
            break_bucket(pusher, fault, index=2)
            pusher.push(app.changed(0.5).items(), version=app.version() + 1)
    return run


def dying_trainer(app: Deployment) -> None:
    process = multiprocessing.get_context("spawn").Process(target=push_and_die, args=(
        app.url, TOKEN, TENSORS, app.version() + 1, 2, BUCKET_BYTES))
    process.start()
    process.join(300)
    status = app.get("/weights/status")
    deadline = time.monotonic() + 300
    while status["active_push_id"] is not None and time.monotonic() < deadline:
        time.sleep(0.1)
        status = app.get("/weights/status")
    raise ServiceError(0, f"trainer exit {process.exitcode}; the push ended "
                          f"{status['last_push']['outcome']}")


def second_trainer(app: Deployment) -> None:
    with WeightPusher(app.url, TOKEN, transport="nccl", bucket_bytes=BUCKET_BYTES) as first:
        first.push(app.original.items(), version=app.version() + 1)
        with WeightPusher(app.url, TOKEN, transport="nccl", bucket_bytes=BUCKET_BYTES) as other:
            other.push(app.original.items(), version=app.version() + 1)


def replica_killed(app: Deployment) -> None:
    victim = app.replicas()[0]["pid"]
    with WeightPusher(app.url, TOKEN, transport="nccl", bucket_bytes=BUCKET_BYTES) as pusher:
        group = pusher._group
        assert group is not None
        honest = group.during_update

        def kill_then_send(key, payload, *, index, checksum, update):  # noqa: ANN001, ANN202
            if index == 2:
                os.kill(victim, signal.SIGKILL)
            return honest(key, payload, index=index, checksum=checksum, update=update)

        group.during_update = kill_then_send  # type: ignore[method-assign]
        pusher.push(app.changed(0.5).items(), version=app.version() + 1)


CASES: list[tuple[str, Callable[[Deployment], None], bool]] = [
    ("trainer stalls mid-broadcast (bucket 2 never sent)", broken_push("stall"), False),
    ("trainer dies mid-broadcast (after bucket 2's header)", dying_trainer, False),
    ("short broadcast (half of bucket 2)", broken_push("short"), False),
    ("long broadcast (bucket 2 past the ring slot)", broken_push("long"), False),
    ("second trainer while the first owns the group", second_trainer, False),
    ("replica killed mid-update (bucket 2)", replica_killed, True),
]


def run_case(app: Deployment, case: Callable[[Deployment], None], kills: bool
             ) -> list[str]:
    app.push(app.original)  # the case starts from one version, served everywhere
    before, pids = app.get("/weights/checksums"), app.engine_pids()
    digest = next(iter(before.values()))
    started = time.monotonic()
    try:
        case(app)
        answer = "200 (loaded)"
    except ServiceError as exc:
        answer = f"{exc.status or exc.message} after {time.monotonic() - started:.1f} s"
    except RuntimeError as exc:
        answer = f"trainer error after {time.monotonic() - started:.1f} s: {str(exc)[:40]}"
    served = app.get("/weights/checksums")
    cells = ", ".join("old" if d == digest else "gone" if "error" in d else "NEW"
                      for d in served.values())
    gone = [pid for pid, children in pids.items()
            if not psutil.pid_exists(pid) or any(not psutil.pid_exists(c) for c in children)]
    died = f"{len(gone)} replica (killed by the case)" if kills and len(gone) == 1 else (
        "none" if not gone else f"{len(gone)} replicas")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:  # the killed one's replacement must serve first
        try:
            if len([r for r in app.replicas() if r["status"] == "ok"]) == 2:
                app.push(app.changed(0.25))
                break
        except (ServiceError, httpx.HTTPError, RuntimeError):
            pass
        time.sleep(1.0)
    recovered = time.monotonic() - started
    after = app.get("/weights/checksums")
    if len({tuple(sorted(d.items())) for d in after.values()}) != 1 or len(after) != 2:
        raise SystemExit(f"replicas disagree after recovery: {after}")
    return [answer, cells, died, f"{recovered:.1f} s"]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rows = []
    with serve_on_nodes(parse_serve_config(CONFIG), num_nodes=2) as running:
        app = Deployment(running.url)
        for name, case, kills in CASES:
            rows.append([name, *run_case(app, case, kills)])
            print(" | ".join(rows[-1]), flush=True)
    table = Table(title="nccl faults, 2 vLLM CPU replicas on 2 Ray nodes, gloo; "
                        "replicas served = each replica's checksums against the ones before")
    for column in ("case", "answer", "replicas served", "processes died", "recovered after"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
