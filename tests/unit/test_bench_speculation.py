"""``bench/speculation.py``'s pieces: the decaying rollout (long-tailed, capped,
reproducible) and the check of the controller's model against the pinned modes."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table

from bench.speculation_options import per_engine_memory
from bench.speculation_report import model_check, print_report
from bench.speculation_rounds import rollout_lengths, rollout_tail, round_order
from rollout_service.protocol.speculation import BucketStatus, SpeculationControlStatus


def test_rollout_lengths_decay_from_many_short_to_a_few_long() -> None:
    lengths = rollout_lengths(512, 1024, seed=0)
    assert len(lengths) == 512 and all(1 <= n <= 1024 for n in lengths)
    assert statistics.median(lengths) < 64, "most responses are short"
    assert max(lengths) >= 512, "a few are long: concurrency decays down to one request"
    assert rollout_lengths(512, 1024, seed=0) == lengths
    assert rollout_lengths(512, 1024, seed=1) != lengths


def status(tokens_per_s: dict[int, list[float | None]]) -> SpeculationControlStatus:
    """A controller state with these expected tokens/s per bucket edge and K."""
    return SpeculationControlStatus(
        k_max=2, buckets=[BucketStatus(batch_size=b, k=0, reason="best expected throughput",
                                       controller_k=0, tokens_per_s=v)
                          for b, v in tokens_per_s.items()],
        is_collapsed=False, is_probing=False, collapse_rate=None, acceptance=[0.9, 0.8],
        draft_version=0, num_observations=1, last_batch_size=64, pinned=None,
        engine_schedule=None, cost_table=[], calibration_s=None, num_applied=1,
        num_refused=0, last_error=None)


def rows(table: Table) -> list[list[str]]:
    return [list(r) for r in zip(*(list(c.cells) for c in table.columns), strict=True)]


def test_model_check_reads_the_bucket_holding_the_concurrency_and_each_over_k0() -> None:
    control = status({16: [100.0, 150.0, 90.0], 64: [400.0, 300.0, None]})
    rates = {"spec-off": [500.0], "k=0": [200.0, 220.0], "k=1": [330.0], "k=2": [110.0],
             "k=0 skip": [1.0]}
    # 17..64 is the bucket of 64: the model there, not at 16.
    assert rows(model_check("c=40", 40, control, rates)) == [
        ["0", "400", "1.00", "210", "1.00"],
        ["1", "300", "0.75", "330", "1.57"],
        ["2", "no cost data", "-", "110", "0.52"]]
    # Past the last edge: the last bucket; a suffix picks one spec engine's pinned modes.
    assert rows(model_check("c=512", 512, control, rates, " skip"))[0] == [
        "0", "400", "1.00", "1", "1.00"]
    assert rows(model_check("c=1", 1, control, {}))[1] == ["1", "150", "1.50", "-", "-"]


def test_engines_share_the_gpu_memory_and_an_overcommit_is_refused() -> None:
    assert per_engine_memory(None, num_engines=2) == 0.4
    three = per_engine_memory(None, num_engines=3)
    assert three * 3 <= 0.9, "spec-off, run and skip must all start (3 x 0.4 did not)"
    assert per_engine_memory(0.3, num_engines=3) == 0.3
    with pytest.raises(ValueError, match="--gpu-memory-utilization: 0.4 for each of 3"):
        per_engine_memory(0.4, num_engines=3)


def test_skip_and_run_are_compared_round_by_round() -> None:
    """Rounds swing together (the H100's spec-off ran 10-17k tok/s at c = 64): skip over
    run is the median of each round's own ratio, not a ratio of medians."""
    console = Console(record=True, width=200)
    print_report(console, "noise 0.1", {"c=64": {
        "spec-off": [100.0, 100.0, 100.0],
        "k=0 run": [80.0, 90.0, 100.0], "k=0 skip": [100.0, 90.0, 120.0],
        "k=1 run": [100.0, 100.0, 100.0], "k=1 skip": [90.0, 95.0, 130.0],
        "controller run": [50.0, 200.0, 100.0], "controller skip": [60.0, 100.0, 300.0]}})
    text = console.export_text()
    assert "k=0 skip / k=0 run" in text and "1.200" in text  # 1.25, 1.0, 1.2
    assert "controller skip / controller run" in text and "1.200" in text.split(
        "controller skip / controller run")[1]  # 1.2, 0.5, 3.0
    # the control: at K >= 1 skip changes nothing, so the engines' own difference
    assert "0.950" in text.split("k=1 skip / k=1 run (control)")[1]  # 0.9, 0.95, 1.3
    assert "k=0 skip / k=0 run (control)" not in text


def test_the_frozen_mode_pins_the_controllers_schedule_and_its_runs_report_changes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--frozen``: before its round the mode pins ``controller_k`` per bucket as
    ``/health`` shows it (not the pin in force), and the report pairs the controller
    with it round by round; ``--profile-modes frozen`` needs ``--frozen``. The
    controller's own runs report the schedules its engine took while they lasted."""
    import asyncio
    from types import SimpleNamespace

    from bench.speculation_options import parse_options
    from bench.speculation_rounds import FROZEN, watched, with_pin

    class Client:  # the two methods of RolloutClient a pin calls
        pins: list[dict[int, int] | None] = []
        num_applied = 7

        async def health(self) -> SimpleNamespace:
            return SimpleNamespace(speculation_control=SimpleNamespace(buckets=[
                SimpleNamespace(batch_size=4, k=0, controller_k=2),
                SimpleNamespace(batch_size=256, k=0, controller_k=3)],
                num_applied=self.num_applied, engine_schedule=[
                    SimpleNamespace(batch_size=4, k=2), SimpleNamespace(batch_size=256, k=3)]))

        async def pin_schedule(self, schedule: dict[int, int] | None) -> SimpleNamespace:
            self.pins.append(schedule)
            return (await self.health()).speculation_control

    client = Client()
    mode = with_pin(client, FROZEN, lambda: asyncio.sleep(0, 1))  # type: ignore[arg-type]
    assert mode.setup is not None
    asyncio.run(mode.setup())
    assert client.pins == [{4: 2, 256: 3}]

    async def run_changing_two_schedules() -> int:
        client.num_applied += 2
        return 1

    lines: list[object] = []
    controller = watched(client, run_changing_two_schedules, lines.append)  # type: ignore[arg-type]

    async def one_run() -> None:
        assert controller.setup is not None and controller.after is not None
        await controller.setup()
        await controller.run()
        await controller.after()

    asyncio.run(one_run())
    assert client.pins[-1] is None
    assert lines == ["2 schedules applied during the run; in force at its end: B<=4: 2, "
                     "B<=256: 3"]

    console = Console(record=True, width=200)
    print_report(console, "noise 0.3", {"rollout 512": {
        "spec-off": [100.0, 100.0, 100.0], "k=3": [110.0, 110.0, 110.0],
        "frozen": [100.0, 110.0, 120.0], "controller": [90.0, 110.0, 96.0]}})
    assert "0.900" in console.export_text().split("controller / frozen")[1]  # .9, 1, .8

    assert parse_options(["--frozen", "--profile-modes", "frozen"])[0].frozen
    with pytest.raises(SystemExit):
        parse_options(["--profile-modes", "frozen"])
    assert "--profile-modes" in capsys.readouterr().err


def test_the_capture_ceiling_reaches_every_cuda_engine(tmp_path: Path) -> None:
    """``--max-capture-tokens``: spec-off and the spec engines get the same ceiling (an
    A/B of graphs, not of engines); unset, vLLM's own."""
    from argparse import Namespace

    from bench.speculation import service_config

    opts = Namespace(k_max=3, full_cuda_graphs="align", calibration_max_batch_size=32,
                     device="cuda", eager=False, gpu_memory_utilization=0.28,
                     max_capture_tokens=2048)
    for drafter_at_k0 in (None, "auto"):
        kwargs = service_config(opts, tmp_path, drafter_at_k0=drafter_at_k0).engine_kwargs
        assert kwargs["compilation_config"] == {"max_cudagraph_capture_size": 2048}
    opts.max_capture_tokens = None
    assert "compilation_config" not in service_config(opts, tmp_path,
                                                      drafter_at_k0="auto").engine_kwargs


def test_the_defaults_parse_and_bad_flags_are_refused_by_name(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The default ``--drafter-at-k0`` (``auto``, the service's default) is a valid
    choice; ``batch.sh spec-bench`` runs it. Bad values exit naming their flag."""
    from bench.speculation_options import parse_options

    opts, noises = parse_options([])
    assert opts.drafter_at_k0 == ["auto"] and opts.waves == 1 and noises == [0.25]
    opts, _ = parse_options(["--drafter-at-k0", "run,skip", "--waves", "4"])
    assert opts.drafter_at_k0 == ["run", "skip"] and opts.waves == 4
    for argv, flag in ((["--waves", "0"], "--waves"),
                       (["--drafter-at-k0", "run,run"], "--drafter-at-k0"),
                       (["--drafter-at-k0", "sometimes"], "--drafter-at-k0"),
                       (["--static-k", "4", "--k-max", "3"], "--static-k")):
        with pytest.raises(SystemExit):
            parse_options(argv)
        assert flag in capsys.readouterr().err


def test_a_level_round_keeps_c_in_flight_for_c_times_waves_requests() -> None:
    """``--waves``: the round at concurrency c sends c x waves requests, c at a time, and
    the run's prompts cover that round and the rollout (a run with ``--waves 3`` once ran
    out of prompts at its warm-up)."""
    import asyncio

    from bench.speculation_rounds import level_round, levels_arg, prompts_needed

    class Recorder:  # the one method of HttpMode a round calls
        calls: list[tuple[int, int]] = []

        async def run_round(self, concurrency: int, num_requests: int) -> int:
            self.calls.append((concurrency, num_requests))
            return num_requests

    recorder = Recorder()
    assert asyncio.run(level_round(recorder, 16, 4)()) == 64  # type: ignore[arg-type]
    assert asyncio.run(level_round(recorder, 1, 1)()) == 1  # type: ignore[arg-type]
    assert recorder.calls == [(16, 64), (1, 1)]
    assert prompts_needed([1, 16, 64], 3, 0) == 192
    assert prompts_needed([1, 16], 4, 512) == 512
    assert levels_arg("") == [] and levels_arg("16, 64") == [16, 64]  # LEVELS= : rollout only
    assert prompts_needed(levels_arg(""), 3, 512) == 512


def test_a_rollouts_tail_is_its_last_finishers_and_their_drafts() -> None:
    """The tail of a round: the last ``num_tail`` sequences to finish (in any answer
    order), the time since the one before them, and their pooled acceptance; spec-off's
    answers carry no drafts."""
    def answer(drafts: int, accepted: int) -> dict[str, object]:
        return {"outputs": [{"token_ids": [1], "spec_decode": {
            "num_draft_tokens": drafts, "num_accepted_tokens": accepted}}]}

    finishes = [(3.0, answer(30, 10)), (0.5, answer(100, 90)), (1.0, answer(10, 9)),
                (2.0, answer(20, 5)), (0.2, answer(50, 50))]
    tail = rollout_tail(finishes, num_tail=3)
    assert (tail.num_sequences, tail.num_tail) == (5, 3)
    assert tail.makespan_s == 3.0 and tail.tail_s == 2.5  # after the one at 0.5 s
    assert (tail.tail_drafts, tail.tail_accepted) == (60, 24)
    assert "0.400 of their 60 draft tokens" in str(tail)
    off = rollout_tail([(t, {"outputs": [{"token_ids": [1], "spec_decode": None}]})
                        for t in (1.0, 2.0)], num_tail=4)
    assert off.tail_s == 2.0 and "no drafts" in str(off)


def test_a_rollout_round_sends_each_prompt_its_length_and_counts_as_the_mode_does() -> None:
    """A rollout round: ``waves`` rollouts one after the other, each every prompt at once
    with its own ``max_tokens`` and a seed of its own; the tokens are the mode's own count
    of each answer (a dialect's answer has its own shape), and each wave's tail is
    reported."""
    import asyncio

    from bench.speculation_rounds import Rollout, rollout_round

    class Recorder:  # the two methods of HttpMode a rollout round calls
        bodies: list[dict[str, object]] = []

        async def answer(self, body: dict[str, object]) -> dict[str, object]:
            self.bodies.append(body)
            return {"n": body["max_tokens"], "outputs": [{"spec_decode": None}]}

        def count(self, answer: dict[str, object]) -> int:
            return int(answer["n"])  # type: ignore[call-overload]

    recorder, tails = Recorder(), []
    rollout = Rollout(prompts=("a", "b", "c"), lengths=(5, 1, 30))
    assert asyncio.run(rollout_round(recorder, rollout, 0.0,  # type: ignore[arg-type]
                                     tails.append, waves=2)()) == 72
    sent = [(b["prompt"], b["max_tokens"], b["seed"]) for b in recorder.bodies]
    assert sorted(sent[:3]) == [("a", 5, 0), ("b", 1, 1), ("c", 30, 2)]  # wave 1 first
    assert sorted(sent[3:]) == [("a", 5, 3), ("b", 1, 4), ("c", 30, 5)]
    assert [t.num_sequences for t in tails] == [3, 3]


@given(num_modes=st.integers(2, 9), pair=st.integers(0, 20))
def test_each_pair_of_rounds_runs_every_neighbour_in_both_orders(num_modes: int,
                                                                   pair: int) -> None:
    """A mode that always followed the same one would carry that slot's cost (on the H100
    ``frozen`` always ran right after ``controller``): over rounds 2p and 2p + 1 each
    mode runs once, and each pair of neighbours runs once in each order."""
    names = [f"m{i}" for i in range(num_modes)]
    first, second = round_order(names, 2 * pair), round_order(names, 2 * pair + 1)
    assert sorted(first) == sorted(second) == sorted(names)
    neighbours = set(zip(first, first[1:]))
    assert {(b, a) for a, b in zip(second, second[1:])} == neighbours
    assert round_order(names, 0) == names
