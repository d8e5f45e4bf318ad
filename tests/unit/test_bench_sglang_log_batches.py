"""``bench/sglang_log_batches.py``: SGLang's own batch lines counted, other lines not."""

from __future__ import annotations

from bench.sglang_log_batches import read_batching

LOG = """\
[2026-12-06 03:42:45] Prefill batch, #new-seq: 1, #new-token: 16, #cached-token: 0, \
token usage: 0.00, #running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: True
INFO:     127.0.0.1:5000 - "POST /generate HTTP/1.1" 200 OK
[2026-12-06 03:43:25] Decode batch, #running-req: 128, #token: 7219, token usage: 0.00, \
accept len: 1.33, accept rate: 0.33, cuda graph: True, gen throughput (token/s): 146.14
[2026-12-06 03:43:26] Prefill batch, #new-seq: 5, #new-token: 80, #cached-token: 0, \
token usage: 0.00, #running-req: 123, #queue-req: 0
[2026-12-06 03:43:26] Prefill batch, #new-seq: 6, #new-token: 96, #cached-token: 0, \
token usage: 0.00, #running-req: 122, #queue-req: 0
[2026-12-06 03:43:27] Decode batch, #running-req: 128, #token: 14072, token usage: 0.01
2026-12-06 03:43:27 INFO rollout_service.service: a line that names a Prefill batch too
"""


def test_prefill_and_decode_lines_are_counted() -> None:
    got = read_batching(LOG)
    assert (got.prefill_batches, got.prefilled_requests, got.decode_lines) == (3, 12, 2)
    assert got.requests_per_prefill == 4.0


def test_a_log_without_batches_has_none() -> None:
    got = read_batching("INFO: started\n")
    assert (got.prefill_batches, got.requests_per_prefill, got.decode_lines) == (0, 0.0, 0)
