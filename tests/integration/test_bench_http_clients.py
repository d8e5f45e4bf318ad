"""``bench/http_clients.py`` cut short: every client is timed every round against the
stand-in server (``closed_loop`` raises on a request that fails), and the table compares
each with httpx's own pool."""

from __future__ import annotations

import argparse

from rich.console import Console

from bench import http_clients


async def test_every_client_is_timed_every_round() -> None:
    opts = argparse.Namespace(concurrency=[8], requests=16, rounds=2, delay_s=0.0)
    console = Console(record=True, width=200)
    results = await http_clients.run(opts, console)

    assert set(results) == {8} and set(results[8]) == set(http_clients.CLIENTS)
    for rates, cpus in results[8].values():
        assert len(rates) == len(cpus) == 2
        assert all(rate > 0 for rate in rates) and all(cpu > 0 for cpu in cpus)
    assert "requests/s vs httpx" in console.export_text()
