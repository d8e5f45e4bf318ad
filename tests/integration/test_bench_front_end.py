"""``bench/front_end.py`` end to end, cut short: the service process really serves the
``service`` mode (its CPU per request is that of a request through it, not of the idle
service the ``direct`` mode leaves alone) and both modes are timed every round."""

from __future__ import annotations

import asyncio

from rich.console import Console

from bench import front_end


def test_the_service_mode_goes_through_the_service_and_direct_does_not() -> None:
    opts = front_end.parser().parse_args(["--rounds", "2", "--serial", "5",
                                          "--requests", "64", "--concurrency", "16"])
    console = Console(record=True, width=160)
    rounds = asyncio.run(front_end.run(opts, console))

    assert len(rounds) == 2
    for measured in rounds:
        assert set(measured) == {"direct", "service"}
        assert all(latency > 0 for latency, _ in measured.values())
        # a request through the service costs it far more than one that passes it by
        assert measured["service"][1] > 5 * measured["direct"][1]
    assert "added by the service" in console.export_text()
