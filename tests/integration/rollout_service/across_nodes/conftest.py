"""One Ray cluster and app for this folder's modules (``nodes_app.py`` says what it is).

Package scope: started by the first test here, stopped after the last, so the two modules
pay one cluster start (about 1.5 minutes on the 2-core CI machine) and no other test
shares the machine with it. Each test leaves both replicas serving the same weights, at
a version the next reads from ``/weights/status`` rather than assumes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout_service.embedded import ensure_model
from rollout_service.tools.ray_cluster import ServeOnNodes
from tests.integration.rollout_service.across_nodes.nodes_app import running_app


@pytest.fixture(scope="package")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each replica's stored copies, in a folder named for the replica."""
    return tmp_path_factory.mktemp("stores")


@pytest.fixture(scope="package")
def app(stores: Path) -> Iterator[ServeOnNodes]:
    with running_app(stores) as running:
        yield running


@pytest.fixture(scope="package")
def original() -> dict[str, torch.Tensor]:
    return load_file(str(Path(ensure_model("tiny")) / "model.safetensors"))
