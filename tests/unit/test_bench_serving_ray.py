"""``bench/serving_ray.py``: the Ray Serve app the benchmarks start, each replica on 1/N of
the standalone service's share."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serving_ray import ray_serve_config
from rollout_service.serve.config import parse_serve_config

SERVICE = {"model": "embedded:tiny", "weights_transport": "shm",
           "engine_kwargs": {"dtype": "bfloat16", "gpu_memory_utilization": 0.25}}


def test_on_a_gpu_two_replicas_share_it_and_its_memory_share(tmp_path: Path) -> None:
    data = ray_serve_config(SERVICE, num_replicas=2, device="cuda", max_ongoing_requests=512,
                            scratch=tmp_path)
    config = parse_serve_config(data)
    assert config.num_replicas == 2
    assert config.ray_actor_options == {"num_gpus": 0.5}
    assert config.engine_kwargs == {"dtype": "bfloat16", "gpu_memory_utilization": 0.125}
    assert config.engine_start_lock == tmp_path / "engine-start.lock"  # one start at a time
    assert config.max_ongoing_requests == 512
    assert SERVICE["engine_kwargs"]["gpu_memory_utilization"] == 0.25  # not changed in place


def test_on_the_cpu_each_replica_takes_its_cores_unbound(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    data = ray_serve_config({**SERVICE, "engine_kwargs": {}}, num_replicas=2, device="cpu",
                            max_ongoing_requests=8, scratch=tmp_path)
    assert data["ray_actor_options"] == {"num_cpus": 4, "runtime_env": {"env_vars": {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "4"}}}
    assert data["engine_kwargs"] == {}


def test_what_the_app_refuses_fails_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weights_transport"):
        ray_serve_config({**SERVICE, "weights_transport": "cuda_ipc"}, num_replicas=2,
                         device="cuda", max_ongoing_requests=8, scratch=tmp_path)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ray_serve_config({**SERVICE, "engine_kwargs": {}}, num_replicas=2, device="cuda",
                         max_ongoing_requests=8, scratch=tmp_path)
