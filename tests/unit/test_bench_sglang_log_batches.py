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


def prefill(new_seq: int, running: int) -> str:
    return (f"[2026-12-06 14:36:45] Prefill batch, #new-seq: {new_seq}, #new-token: 16, "
            f"#cached-token: 0, token usage: 0.00, #running-req: {running}, #queue-req: 0\n")


def decode(running: int, rate: float = 100.0) -> str:
    return (f"[2026-12-06 14:36:46] Decode batch, #running-req: {running}, #token: 7149, "
            f"accept len: 1.35, cuda graph: True, gen throughput (token/s): {rate}, "
            f"#queue-req: 0\n")


def test_a_refill_runs_from_an_emptied_batch_to_the_next_decode_line() -> None:
    log = (prefill(1, 0) + decode(1)                                   # a warm-up request
           + prefill(1, 0) + prefill(20, 1) + prefill(27, 21) + decode(48)  # a wave of 48
           + prefill(5, 43) + prefill(3, 45) + decode(48)              # a trickle: no refill
           + prefill(2, 0) + prefill(30, 2) + prefill(8, 32) + prefill(8, 40))  # log ends
    got = read_batching(log)
    assert [(r.prefill_batches, r.requests) for r in got.refills] == [
        (1, 1), (3, 48), (4, 48)]
    assert [(r.prefill_batches, r.requests) for r in got.waves(min_requests=40)] == [
        (3, 48), (4, 48)]
    assert got.waves(min_requests=49) == []


def test_an_emptied_batch_right_after_a_refill_starts_another() -> None:
    got = read_batching(prefill(1, 0) + prefill(9, 1) + prefill(4, 0) + prefill(6, 4))
    assert [(r.prefill_batches, r.requests) for r in got.refills] == [(2, 10), (2, 10)]


def test_a_prefill_line_without_running_requests_still_counts() -> None:
    got = read_batching("[t] Prefill batch, #new-seq: 7, #new-token: 16\n" + prefill(3, 0))
    assert (got.prefill_batches, got.prefilled_requests) == (2, 10)
    assert [(r.prefill_batches, r.requests) for r in got.refills] == [(1, 3)]


def test_the_full_batch_rates_are_those_logged_at_the_most_running_requests() -> None:
    got = read_batching(decode(128, 40838.5) + decode(21, 900.0) + decode(128, 42000.0)
                        + prefill(5, 123) + decode(127, 39000.0))
    assert got.full_batch_rates == (40838.5, 42000.0)
    assert read_batching(prefill(1, 0)).full_batch_rates == ()


def timed_prefill(new_seq: int, running: int, new_tokens: int, rate: float,
                  replay: int | None = None) -> str:
    """A prefill line as SGLang 0.5.23 writes it: ``rate`` is ``new_tokens`` (and the
    replayed ones) over the time since the previous prefill line."""
    replayed = "" if replay is None else f"#replay-token: {replay}, "
    return (f"[2026-12-07 19:49:48] Prefill batch, #new-seq: {new_seq}, #new-token: "
            f"{new_tokens}, #cached-token: 0, token usage: 0.00, #running-req: {running}, "
            f"#queue-req: 0, #pending-token: 0, {replayed}cuda graph: True, "
            f"input throughput (token/s): {rate}\n")


def test_a_refill_spans_the_gaps_of_its_batches_after_the_first() -> None:
    """The first batch's gap is the decoding before the wave: not the wave's."""
    log = (timed_prefill(4, 0, 400, 10.0)                  # 40 s since the last prefill
           + timed_prefill(10, 4, 300, 1000.0)             # 0.3 s later
           + timed_prefill(6, 14, 100, 500.0, replay=150)  # 0.5 s later: 250 tokens
           + decode(20)
           + timed_prefill(20, 0, 10, 1.0) + decode(20))   # one batch: no span
    got = read_batching(log)
    assert [(r.requests, r.span_s) for r in got.refills] == [(20, 0.8), (20, 0.0)]


def test_a_refill_with_a_line_lacking_its_rate_has_no_span() -> None:
    got = read_batching(timed_prefill(4, 0, 400, 10.0) + prefill(6, 4)
                        + timed_prefill(2, 10, 10, 0.0) + decode(12))
    assert [(r.requests, r.span_s) for r in got.refills] == [(12, None)]
    assert read_batching(timed_prefill(4, 0, 400, 10.0) + timed_prefill(2, 4, 10, 0.0)
                         ).refills[0].span_s is None
