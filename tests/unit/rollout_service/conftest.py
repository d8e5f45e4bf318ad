"""Fixtures shared by more than one test module of this folder (CPU, in the test process).

``checkpoint``: the SGLang engine's modules on the FAKE SGLang server
(``test_sglang_{generate,stats,pushes,server,conformance}.py``), a checkpoint folder
holding only a ``config.json`` for the fake to report.
``rendezvous``: the ``nccl`` transport's modules over gloo
(``test_broadcast_{group,receive,service_group}.py``), the trainer's store their groups
meet in, one per module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_service.protocol.broadcast import Rendezvous


@pytest.fixture
def checkpoint(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64,
                                                      "num_nextn_predict_layers": 1}))
    return str(tmp_path)


@pytest.fixture(scope="module")
def rendezvous() -> Rendezvous:
    return Rendezvous("127.0.0.1", 30.0)  # the trainer's store, as long as this object lives
