"""How an SGLang server batched its work, read from its own log: prefill batches, the
requests they took, and decode log lines.

The serving bench (``bench.serving --engine sglang``) keeps both servers' logs under
``--logs``: the service's server (``service.log``, which also holds the service's own
lines) and SGLang's own (``sglang-server.log``). SGLang logs every prefill batch
(``Prefill batch, #new-seq: N, ...``) and every ``decode_log_interval``-th decode step
(40 by default: ``Decode batch, #running-req: N, ...``). Fewer requests per prefill batch
for the same workload means they reached the scheduler more spread out. Counts are over
the whole log: start-up warm-ups and every mode and level the server ran.

    python -m bench.sglang_log_batches LOGS/service.log LOGS/sglang-server.log
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+)")
DECODE = re.compile(r"Decode batch, #running-req: (\d+)")


@dataclass(frozen=True)
class Batching:
    """One log's batching."""

    prefill_batches: int
    prefilled_requests: int
    """The prefill batches' ``#new-seq``, summed."""
    decode_lines: int
    """Decode steps logged (one per ``decode_log_interval`` steps)."""

    @property
    def requests_per_prefill(self) -> float:
        return self.prefilled_requests / self.prefill_batches if self.prefill_batches else 0.0


def read_batching(text: str) -> Batching:
    """The batching of one SGLang server log's text."""
    prefills = [int(n) for n in PREFILL.findall(text)]
    return Batching(prefill_batches=len(prefills), prefilled_requests=sum(prefills),
                    decode_lines=len(DECODE.findall(text)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="SGLang server logs")
    opts = parser.parse_args()
    table = Table("log", "prefill batches", "requests prefilled", "requests / prefill batch",
                  "decode log lines")
    for path in opts.logs:
        got = read_batching(path.read_text(errors="replace"))
        table.add_row(str(path), str(got.prefill_batches), str(got.prefilled_requests),
                      f"{got.requests_per_prefill:.2f}", str(got.decode_lines))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
