"""Fixtures shared by more than one test module of this folder (CPU, in the test process).

``checkpoint``: the SGLang engine's modules on the FAKE SGLang server
(``test_sglang_{generate,stats,pushes,server,conformance}.py``), a checkpoint folder
holding only a ``config.json`` for the fake to report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def checkpoint(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64,
                                                      "num_nextn_predict_layers": 1}))
    return str(tmp_path)

