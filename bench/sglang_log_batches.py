"""How an SGLang server batched its work, read from its own log: prefill batches, the
requests they took, decode log lines, and how an emptied batch filled again.

The serving bench (``bench.serving --engine sglang``) keeps both servers' logs under
``--logs``: the service's server (``service.log``, which also holds the service's own
lines) and SGLang's own (``sglang-server.log``). SGLang logs every prefill batch
(``Prefill batch, #new-seq: N, ...``) and every ``decode_log_interval``-th decode step
(40 by default: ``Decode batch, #running-req: N, ...``). Fewer requests per prefill batch
for the same workload means they reached the scheduler more spread out. Counts are over
the whole log: start-up warm-ups and every mode and level the server ran.

A refill is what follows a prefill batch taken with ``#running-req: 0`` (every request of
the last wave finished, as when a closed loop's requests all end in one step): the prefill
batches in a row, up to the next decode line, that took the next wave in. The more of them
a wave of the same size needs, the more spread out it reached the scheduler; each is an
engine step that decodes nothing for the requests already in.

A refill's span is the time from its first prefill batch to its last, by SGLang's own
clock: each prefill line's input rate is its tokens over the time since the scheduler's
previous prefill line, so the gaps of the batches after the first add up to it. For waves
of one size, a longer span is a wave that reached the scheduler over more time.

A decode line also carries SGLang's own ``gen throughput (token/s)`` over the steps since
the last one. Its median over the lines logged at the log's largest ``#running-req`` (a
full batch) is how fast the engine decoded when the front end had kept it full: where two
servers match there, a gap between them lies in how their batches filled and emptied.

    python -m bench.sglang_log_batches LOGS/service.log LOGS/sglang-server.log
"""

from __future__ import annotations

import argparse
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.spread import median_spread

LINE = re.compile(r"Prefill batch, #new-seq: (\d+)(?:, #new-token: (\d+))?"
                  r"(?:.*?#running-req: (\d+))?(?:.*?#replay-token: (\d+))?"
                  r"(?:.*?input throughput \(token/s\): ([\d.]+))?"
                  r"|Decode batch, #running-req: (\d+)(?:.*?gen throughput \(token/s\): "
                  r"([\d.]+))?")
"""A prefill line (its new requests, and where the line gives them its new and replayed
tokens, the requests running and SGLang's input rate) or a decode line (the requests
running and, where given, SGLang's generation rate)."""


def prefill_gap_s(new_tokens: str, replay_tokens: str, input_rate: str) -> float | None:
    """The time since the scheduler's previous prefill line, as SGLang 0.5.23 measures it
    (``report_prefill_stats`` in ``srt/managers/scheduler_components/metrics_reporter.py``:
    the input rate is the line's new and replayed tokens over that gap); None where the
    line lacks the fields or gives a rate of 0."""
    if not new_tokens or not input_rate or float(input_rate) <= 0:
        return None
    return (int(new_tokens) + int(replay_tokens or 0)) / float(input_rate)


@dataclass(frozen=True)
class Refill:
    """The prefill batches that took a wave in after the running batch emptied."""

    prefill_batches: int
    requests: int
    span_s: float | None = None
    """From the refill's first prefill batch to its last, by SGLang's own clock (the
    gaps of the batches after the first, :func:`prefill_gap_s`): how long the wave took to
    reach the scheduler; 0 for one batch, None where a line lacks the gap."""


@dataclass(frozen=True)
class Batching:
    """One log's batching."""

    prefill_batches: int
    prefilled_requests: int
    """The prefill batches' ``#new-seq``, summed."""
    decode_lines: int
    """Decode steps logged (one per ``decode_log_interval`` steps)."""
    refills: tuple[Refill, ...] = ()
    """Each refill of an emptied batch, in the log's order."""
    full_batch_rates: tuple[float, ...] = ()
    """SGLang's ``gen throughput`` of the decode lines at the largest ``#running-req``."""

    @property
    def requests_per_prefill(self) -> float:
        return self.prefilled_requests / self.prefill_batches if self.prefill_batches else 0.0

    def waves(self, min_requests: int) -> list[Refill]:
        """The refills that took at least ``min_requests``: a whole wave, not a warm-up's
        one request."""
        return [r for r in self.refills if r.requests >= min_requests]


def refill(new_seqs: list[int], gaps: list[float | None]) -> Refill:
    """A refill of prefill batches taking ``new_seqs`` requests, the batches after the
    first ``gaps`` apart."""
    span = None if None in gaps else sum(g for g in gaps if g is not None)
    return Refill(len(new_seqs), sum(new_seqs), span)


def read_batching(text: str) -> Batching:
    """The batching of one SGLang server log's text, read in one pass."""
    prefills: list[int] = []
    refills: list[Refill] = []
    rates: list[tuple[int, float]] = []  # (running, gen throughput) of the decode lines
    num_decode_lines = 0
    current: list[int] | None = None  # the open refill's prefill batches' #new-seq
    gaps: list[float | None] = []  # and the gaps of those after its first
    for (new_seq, new_tokens, running, replay, input_rate, decode_running,
         rate) in LINE.findall(text):
        starts = bool(new_seq) and running == "0"
        if current is not None and (not new_seq or starts):  # a decode line ends it
            refills.append(refill(current, gaps))
            current = None
        if new_seq:
            prefills.append(int(new_seq))
            if starts:
                current, gaps = [int(new_seq)], []
            elif current is not None:
                current.append(int(new_seq))
                gaps.append(prefill_gap_s(new_tokens, replay, input_rate))
        else:
            num_decode_lines += 1
            if rate:
                rates.append((int(decode_running), float(rate)))
    if current is not None:
        refills.append(refill(current, gaps))
    full = max((running for running, _ in rates), default=0)
    return Batching(prefill_batches=len(prefills), prefilled_requests=sum(prefills),
                    decode_lines=num_decode_lines, refills=tuple(refills),
                    full_batch_rates=tuple(rate for running, rate in rates if running == full))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="SGLang server logs")
    parser.add_argument("--wave", type=int, default=64, help=(
        "the fewest requests a refill takes to count as a wave's (default 64; the serving "
        "bench's waves are its concurrency)"))
    opts = parser.parse_args()
    table = Table("log", "prefill batches", "requests prefilled", "requests / prefill batch",
                  "decode log lines", "waves refilled",
                  "prefill batches / refill (median)", "requests / refill (median)",
                  "refill span ms (median, min - max)",
                  "decode tok/s at a full batch (median, lines)")
    for path in opts.logs:
        got = read_batching(path.read_text(errors="replace"))
        waves = got.waves(opts.wave)
        medians = (f"{statistics.median(r.prefill_batches for r in waves):g}",
                   f"{statistics.median(r.requests for r in waves):g}") if waves else ("-", "-")
        spans = [1e3 * r.span_s for r in waves if r.span_s is not None]
        rates = got.full_batch_rates
        rate = f"{statistics.median(rates):.0f} ({len(rates)})" if rates else "-"
        table.add_row(str(path), str(got.prefill_batches), str(got.prefilled_requests),
                      f"{got.requests_per_prefill:.2f}", str(got.decode_lines), str(len(waves)),
                      *medians, median_spread(spans, "{:.0f}") if spans else "-", rate)
    Console(width=180).print(table)


if __name__ == "__main__":
    main()
