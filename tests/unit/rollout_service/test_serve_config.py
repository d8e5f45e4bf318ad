"""RayServeConfig: validated before anything is deployed (no Ray needed)."""

from __future__ import annotations

import pytest

from rollout_service.serve.config import load_serve_config, parse_serve_config


def test_rl_mode_pins_the_replica_count() -> None:
    with pytest.raises(ValueError, match="autoscaling_config: mode 'rl' pins"):
        parse_serve_config({"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}})
    config = parse_serve_config({"mode": "serving",
                                 "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}})
    assert config.autoscaling_config == {"min_replicas": 1, "max_replicas": 4}


def test_bad_fields_are_named_and_overrides_apply(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="num_replicas"):
        parse_serve_config({"num_replicas": 0})
    with pytest.raises(ValueError, match="replica_count"):
        parse_serve_config({"replica_count": 2})
    path = tmp_path / "ray.yaml"
    path.write_text("model: embedded:tiny\nnum_replicas: 3\n")
    assert load_serve_config(path, num_replicas=2).num_replicas == 2
    assert load_serve_config(path).num_replicas == 3


def test_cuda_ipc_is_refused_under_ray_serve() -> None:
    with pytest.raises(ValueError, match="weights_transport: 'cuda_ipc' is not supported under "
                                         "Ray Serve"):
        parse_serve_config({"weights_transport": "cuda_ipc"})


@pytest.mark.parametrize("http_access_log", [True, False])
def test_the_access_log_setting_reaches_the_request_serving_deployments(
        http_access_log: bool) -> None:
    """``http_access_log`` is Serve's access log of the ingress and the engine replicas;
    the coordinator, which every replica polls each second, never logs its calls."""
    from rollout_service.serve.app import deployments

    built = deployments(parse_serve_config({"http_access_log": http_access_log}))
    assert built.ingress.logging_config["enable_access_log"] is http_access_log
    assert built.engine.logging_config["enable_access_log"] is http_access_log
    assert built.coordinator.logging_config["enable_access_log"] is False
    with pytest.raises(ValueError, match="http_access_log"):
        parse_serve_config({"http_access_log": "sometimes"})
