"""Weight sync across simulated hosts: ``nccl`` pushes of an embedded model to 1, 2 and 4
Ray Serve replicas, each replica on a Ray node of its own, gloo standing in for NCCL.

Runs in the caller's process, which is both the Ray driver and the trainer: it starts one
Ray cluster on this host with as many worker nodes as the largest deployment has replicas
(``tools/ray_cluster.py``), then deploys one app per block of ``--order`` (a fresh app of
that many real vLLM CPU replicas), pushes to it once untimed and ``--rounds`` times timed
(main model and drafter, a few tensors changed before each push, untimed), checks that
every replica serves the last version with one and the same checksums, and deletes it.
Blocks, not push-by-push interleaving, because that would keep 1 + 2 + 4 replicas up at
once (about 2.4 GB each here); the default order 1, 2, 4, 2, 1 repeats each smaller
deployment on both sides of the largest, so drift on a shared machine shows as a
difference between a size's two blocks.

Per push: the trainer's wall time from begin to finish; of it, the update calls with
their broadcasts (every bucket received, checked and written to each replica's stored
copy), and the load (pause to resume, the slowest replica's); the bytes the trainer wrote
to sockets during the push (``/proc/self/io`` ``wchar``) over the push's stream (gloo's
broadcast is a binomial tree: its root sends one copy per child, ceil(log2(ranks)) in
all; NCCL's pipelined ring sends one); and each worker's peak receive bytes (its ring
slots, reported by the service) over the bucket size.

    python -m bench.weight_sync_fanout --size small --rounds 4
    python -m bench.weight_sync_fanout --size tiny --order 1,2 --rounds 2 --bucket-mb 1
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file

from bench.spread import median_spread
from rollout_service.embedded import ensure_model
from rollout_service.serve.config import parse_serve_config
from rollout_service.tools.ray_cluster import SimulatedCluster, simulated_cluster
from trainer_client.push import PushReport, WeightPusher, layout, spec_nbytes

TOKEN = "bench-weights-token"
CHANGED = ("lm_head.weight", "model.mtp_layers.0.input_proj.weight")
REPLICA_OPTIONS = {"num_cpus": 1, "runtime_env": {"env_vars": {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}}}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Push:
    """One timed push."""

    total_s: float
    updates_s: float
    load_s: float
    sent_per_byte: float
    peak_per_bucket: float


def wchar() -> int:
    """Bytes this process has written through write-like calls, sockets included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def app_config(num_replicas: int, size: str, bucket_bytes: int) -> dict:
    return {"model": f"embedded:{size}", "app_name": f"fanout{num_replicas}",
            "mtp": {"num_speculative_tokens": 1}, "weights_token": TOKEN,
            "num_replicas": num_replicas, "weights_transport": "nccl",
            "weights_bucket_bytes": bucket_bytes, "weights_num_buckets": 2,
            "engine_kwargs": {"kv_cache_memory_bytes": 32 * 1024**2, "max_model_len": 256},
            "health_check_period_s": 5.0, "push_ack_timeout_s": 600.0,
            "metrics_host": "127.0.0.1", "ray_actor_options": REPLICA_OPTIONS}


def measured(report: PushReport, sent: int, stream_bytes: int, bucket_bytes: int) -> Push:
    peaks = report.server.receive_peak_bytes or [0]
    return Push(total_s=report.total_s, updates_s=report.control_s - report.begin_s,
                load_s=report.server.timings.total_s, sent_per_byte=sent / stream_bytes,
                peak_per_bucket=max(peaks) / bucket_bytes)


def block(cluster: SimulatedCluster, num_replicas: int, args: argparse.Namespace,
          tensors: dict[str, torch.Tensor], version: int) -> tuple[list[Push], dict, int]:
    """Deploy ``num_replicas``, push ``args.rounds + 1`` times; the timed pushes, the
    replicas' common checksums after the last push (of ``tensors`` themselves), and the
    next version."""
    bucket_bytes = args.bucket_mb * 1024**2
    config = parse_serve_config(app_config(num_replicas, args.size, bucket_bytes))
    url = cluster.deploy(config, route_prefix=f"/{config.app_name}")
    stream_bytes = layout([spec_nbytes(s) for s in _specs(tensors)])[1]
    pushes = []
    try:
        with WeightPusher(url, TOKEN, transport="nccl", bucket_bytes=bucket_bytes) as pusher:
            for round_index in range(args.rounds + 1):
                changed = {**tensors, **{n: tensors[n] + 0.01 * (round_index + 1)
                                         for n in CHANGED}}
                before = wchar()
                report = pusher.push(changed.items(), version=version)
                version += 1
                if round_index:  # the first push of a block warms it up
                    pushes.append(measured(report, wchar() - before, stream_bytes,
                                           bucket_bytes))
            pusher.push(tensors.items(), version=version)
            version += 1
        digests = httpx.get(f"{url}/weights/checksums", timeout=300,
                            headers={"authorization": f"Bearer {TOKEN}"}).json()
    finally:
        cluster.delete(config.app_name)
    distinct = {tuple(sorted(d.items())) for d in digests.values()}
    if len(digests) != num_replicas or len(distinct) != 1:
        raise SystemExit(f"{num_replicas} replicas: checksums differ: {digests}")
    return pushes, next(iter(digests.values())), version


def _specs(tensors: dict[str, torch.Tensor]) -> list:
    from trainer_client.push import param_spec

    return [param_spec(name, t) for name, t in tensors.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--order", default="1,2,4,2,1",
                        help="replicas per block, in the order the blocks run")
    parser.add_argument("--rounds", type=int, default=4, help="timed pushes per block")
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket size, MiB")
    args = parser.parse_args()
    order = [int(n) for n in args.order.split(",")]
    tensors = load_file(str(Path(ensure_model(args.size)) / "model.safetensors"))
    results: dict[int, list[Push]] = {n: [] for n in order}
    digests = []
    started = time.monotonic()
    with simulated_cluster(max(order)) as cluster:
        version = 1
        for num_replicas in order:
            pushes, digest, version = block(cluster, num_replicas, args, tensors, version)
            results[num_replicas] += pushes
            digests.append(digest)
            print(f"{num_replicas} replicas: {len(pushes)} pushes, median "
                  f"{statistics.median(p.total_s for p in pushes):.3f} s", flush=True)
    if len({tuple(sorted(d.items())) for d in digests}) != 1:
        raise SystemExit(f"the deployments ended on different weights: {digests}")
    one = statistics.median(p.total_s for p in results[min(order)])
    table = Table(title=f"nccl pushes of embedded:{args.size} ({args.bucket_mb} MiB buckets, "
                        f"2 slots), median (min - max) over {args.rounds} pushes per block, "
                        f"blocks {args.order}; {time.monotonic() - started:.0f} s in all")
    for column in ("replicas", "pushes", "push s", "updates + broadcast s", "load s",
                   "trainer bytes sent / stream", "peak receive / bucket, per worker",
                   "push / 1 replica"):
        table.add_column(column)
    for n in sorted(results):
        runs = results[n]
        table.add_row(str(n), str(len(runs)), median_spread([p.total_s for p in runs]),
                      median_spread([p.updates_s for p in runs]),
                      median_spread([p.load_s for p in runs]),
                      f"{statistics.median(p.sent_per_byte for p in runs):.2f}",
                      f"{max(p.peak_per_bucket for p in runs):.2f}",
                      f"{statistics.median(p.total_s for p in runs) / one:.2f}")
    Console(width=200).print(table)
    sys.exit(0)


if __name__ == "__main__":
    main()
