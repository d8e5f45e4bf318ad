"""Ray Serve deploy files: ``deploy/serve.yaml`` and the KubeRay RayService.

Runs in the test process, without a service: serve.yaml's application args are a valid
app config, and the RayService's serveConfigV2 is serve.yaml, with Prometheus
discovering the replicas through the serve service KubeRay creates for it.
"""

from __future__ import annotations

import yaml

from tests.support.deploy_artifacts import PROMETHEUS_YML, ROOT

SERVE_YAML = ROOT / "deploy" / "serve.yaml"
RAYSERVICE_YAML = ROOT / "deploy" / "kuberay" / "rayservice.yaml"


def test_serve_yaml_args_are_a_valid_app_config() -> None:
    from rollout_service.serve.config import parse_serve_config

    serve_config = yaml.safe_load(SERVE_YAML.read_text())
    (application,) = serve_config["applications"]
    assert application["import_path"] == "rollout_service.serve.app:app_builder"
    config = parse_serve_config(application["args"])
    assert config.mode == "rl" and config.autoscaling_config is None
    assert config.num_replicas >= 2


def test_rayservice_runs_the_same_serve_config() -> None:
    """The RayService's serveConfigV2 is deploy/serve.yaml (comments aside), and
    Prometheus discovers replicas through the serve service KubeRay creates for it."""
    rayservice = yaml.safe_load(RAYSERVICE_YAML.read_text())
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == \
        yaml.safe_load(SERVE_YAML.read_text())
    name = rayservice["metadata"]["name"]
    (job,) = [j for j in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
              if j["job_name"] == "rollout"]
    port = yaml.safe_load(SERVE_YAML.read_text())["http_options"]["port"]
    assert job["http_sd_configs"][0]["url"] == \
        f"http://{name}-serve-svc:{port}/metrics/targets"
