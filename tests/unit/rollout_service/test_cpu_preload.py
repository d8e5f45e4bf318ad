"""The CPU engine's preload holds one OpenMP runtime: vLLM's engine refuses to start with
Intel's and GNU's both in ``LD_PRELOAD`` (``vllm/utils/ompmultiprocessing.py``), and its CPU
platform adds GNU's to the environment of any process that builds an engine config (a
clean-clone CI run had every engine a test module started after an in-process engine fail
with that assertion)."""

from __future__ import annotations

import pytest

from rollout_service.engines.vllm import cpu_preload

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
IOMP = "/venv/lib/libiomp5.so"


@pytest.fixture
def libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_preload, "cpu_preload_libraries", lambda: [TCMALLOC, IOMP])


def test_gnu_openmp_added_before_by_vllm_is_dropped_for_intels(
        monkeypatch: pytest.MonkeyPatch, libraries: None) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/torch.libs/libgomp-a34b3233.so.1:/opt/libfoo.so")
    assert cpu_preload.preload_for_cpu_engine() == [TCMALLOC, IOMP]
    preload = cpu_preload.os.environ["LD_PRELOAD"]
    assert preload == f"{TCMALLOC}:{IOMP}:/opt/libfoo.so"
    assert "libgomp" not in preload   # what vLLM's OMPProcessManager asserts


def test_a_second_call_changes_nothing(monkeypatch: pytest.MonkeyPatch, libraries: None) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/opt/libfoo.so")
    cpu_preload.preload_for_cpu_engine()
    first = cpu_preload.os.environ["LD_PRELOAD"]
    assert cpu_preload.preload_for_cpu_engine() == []
    assert cpu_preload.os.environ["LD_PRELOAD"] == first


def test_without_intel_openmp_gnus_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_preload, "cpu_preload_libraries", lambda: [TCMALLOC])
    monkeypatch.setenv("LD_PRELOAD", "/torch.libs/libgomp-a34b3233.so.1")
    cpu_preload.preload_for_cpu_engine()
    assert cpu_preload.os.environ["LD_PRELOAD"] == f"{TCMALLOC}:/torch.libs/libgomp-a34b3233.so.1"
