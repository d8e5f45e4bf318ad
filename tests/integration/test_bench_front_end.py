"""``bench/front_end.py`` end to end, cut short: each service process really serves its
mode (its CPU per request is that of a request through it, not of the idle service the
``direct`` mode leaves alone; the SGLang dialect's through the same process), the h11
one parses with h11, the httpx one's engine sends through httpx, the baseline one runs
the code of its commit, and every mode is timed every round."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from bench import front_end
from bench.baseline import worktree
from rollout_service import cli


def test_the_service_mode_goes_through_the_service_and_direct_does_not() -> None:
    # psutil reads CPU time in scheduler ticks (10 ms): over 64 requests one tick of the
    # idle service read 0.156 ms a request on CI, a quarter of a request through it then.
    # Over 512, a request through the service (about 1 ms) outweighs a few idle ticks.
    opts = front_end.parse_options(["--rounds", "2", "--serial", "5", "--requests", "512",
                                    "--concurrency", "16", "--baseline", "HEAD"])
    console = Console(record=True, width=160)
    rounds = asyncio.run(front_end.run(opts, console))

    assert len(rounds) == 2
    for measured in rounds:
        assert set(measured) == {"direct", "service", "service-sglang", "service-h11",
                                 "service-httpx", "service-baseline"}
        assert all(latency > 0 for latency, _ in measured.values())
        # a request through the service costs it far more than one that passes it by
        assert measured["service"][1] > 5 * measured["direct"][1]
        assert measured["service-sglang"][1] > 5 * measured["direct"][1]
        assert measured["service-h11"][1] > 5 * measured["direct"][1]
        assert measured["service-httpx"][1] > 5 * measured["direct"][1]
        assert measured["service-baseline"][1] > 5 * measured["direct"][1]
    text = console.export_text()
    assert "added by the service" in text and "service-baseline" in text


def test_the_baseline_tree_is_the_commit_and_its_code_is_what_m_imports(
        tmp_path: Path) -> None:
    """``worktree`` checks ``REV`` out, ``-m`` run in it imports that tree's package (not
    the editable install's), and the tree is gone afterwards."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True, cwd=Path(front_end.__file__).parents[1]).stdout.strip()
    with worktree("HEAD", tmp_path) as tree:
        assert tree is not None
        checked_out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                     text=True, check=True, cwd=tree).stdout.strip()
        imported = subprocess.run(
            [sys.executable, "-c", "import rollout_service; print(rollout_service.__file__)"],
            capture_output=True, text=True, check=True, cwd=tree).stdout.strip()
    assert checked_out == head
    assert Path(imported).resolve().is_relative_to(tree.resolve())
    assert not tree.exists()


@pytest.mark.parametrize("modes", ["direct", "service,service-sglang", "direct,service,nope"])
def test_modes_without_the_references_or_unknown_are_refused(modes: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        front_end.modes_arg(modes)


def test_the_baseline_adds_its_mode_to_those_asked() -> None:
    opts = front_end.parse_options(["--modes", "direct,service", "--baseline", "abc123"])
    assert opts.modes == ("direct", "service", "service-baseline")
    assert front_end.parse_options([]).modes == front_end.MODES


def test_the_h11_mode_serves_with_h11(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve_h11`` runs the CLI with uvicorn's h11 protocol, the rest of the config kept."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    seen = []
    monkeypatch.setattr(cli, "app", lambda: seen.append(cli.server_config(object(), 4.0)))
    monkeypatch.setattr(cli, "server_config", cli.server_config)  # put back afterwards
    front_end.serve_h11()
    [config] = seen
    config.load()
    assert config.http_protocol_class is H11Protocol
    assert config.timeout_keep_alive == 4.0


async def test_the_httpx_mode_sends_through_httpx_over_aiohttp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve_httpx`` runs the CLI with the SGLang engine's HTTP an httpx client over
    ``httpx_aiohttp``'s transport, with no cap on connections."""
    from httpx_aiohttp import AiohttpTransport

    from rollout_service.engines.sglang import engine, http_client

    made = []
    monkeypatch.setattr(cli, "app", lambda: made.append(engine.AiohttpServer("http://sglang:1")))
    monkeypatch.setattr(engine, "AiohttpServer", engine.AiohttpServer)  # put back afterwards
    front_end.serve_httpx()
    [server] = made
    assert isinstance(server, http_client.HttpxServer)
    assert server.base_url == "http://sglang:1"
    transport = server._client._transport
    assert isinstance(transport, AiohttpTransport)
    pool = transport.get_client()
    assert pool.connector is not None and pool.connector.limit == 0
    await pool.close()
    await server.aclose()
