"""``bench/profile_summary.py`` reads py-spy's raw stacks, with and without subprocesses."""

from __future__ import annotations

from pathlib import Path

from bench.profile_summary import read_stacks, summarize, thread_of

SERVICE = 'process 10:"python -m rollout_service.cli serve"'
ENGINE = 'process 11:"VLLM::EngineCore"'


def test_a_child_processs_samples_go_to_its_own_thread(tmp_path: Path) -> None:
    raw = tmp_path / "k0.collapsed.txt"
    raw.write_text(
        f"{SERVICE};thread (1): MainThread;run (loop.py:1);select (selectors.py:2) 3\n"
        f"{SERVICE};spawn_main (spawn.py:1);{ENGINE};thread (2): MainThread;"
        "step (core.py:9);propose (speculator.py:7) 5\n"
        "thread (3): MainThread;main (x.py:1) 2\n")
    stacks = read_stacks(raw)
    assert [thread_of(frames) for frames, _ in stacks] == [
        "python -m rollout_service.cli serve / thread (1): MainThread",
        "VLLM::EngineCore / thread (2): MainThread",
        "thread (3): MainThread"]
    summary = summarize(stacks, top=3)
    assert "50.0%  VLLM::EngineCore / thread (2): MainThread" in summary
    assert "50.0%  propose (speculator.py:7)" in summary
