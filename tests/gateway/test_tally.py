"""`gateway.tally.Tally`: what one request consumed, as route and relay record it and
settlement reads it, whatever the request's end.

The worker's messages are real `GenerateResponse` / `AbortResponse` protobufs; the latency
histograms it feeds are read back from the gateway's own metrics registry.
"""

from __future__ import annotations

import time

import pytest

from gateway import metrics
from gateway.tally import Tally
from gateway.worker_client import WorkerReply
from rpc import worker_pb2


def delta(index: int, completion_tokens: int, cached: int = 0) -> worker_pb2.GenerateResponse:
    """A sample's delta: `completion_tokens` is that sample's total so far."""
    return worker_pb2.GenerateResponse(
        index=index, text="x", completion_tokens=completion_tokens, cached_tokens=cached
    )


def reply(*responses: worker_pb2.GenerateResponse, first_token_at: float) -> WorkerReply:
    return WorkerReply("w1", "127.0.0.1:7001", list(responses), first_token_at)


def observed(name: str) -> float:
    """How many observations a latency histogram holds so far."""
    return metrics.REGISTRY.get_sample_value(f"{name}_count") or 0.0


TTFT = "switchboard_time_to_first_token_seconds"
ITL = "switchboard_inter_token_latency_seconds"


# --- status --------------------------------------------------------------------------------------


def test_a_fresh_tally_has_consumed_nothing():
    tally = Tally()
    assert (tally.started, tally.completion, tally.completion_tokens, tally.cached_tokens) == (
        False,
        {},
        0,
        0,
    )
    assert (tally.running_on, tally.grant, tally.error_status) == (None, None, None)


@pytest.mark.parametrize(
    ("finished", "error_status", "status"),
    [
        (False, None, 499),  # the client left before the response was produced
        (True, None, 200),
        (False, 504, 504),
        (True, 502, 502),  # a failure after the response ended still counts as the failure
    ],
)
def test_status_is_the_requests_outcome(finished, error_status, status):
    tally = Tally(finished=finished, error_status=error_status)
    assert tally.status == status


# --- streamed deltas -----------------------------------------------------------------------------


def test_record_keeps_each_samples_latest_total():
    """A delta carries its sample's total so far: recorded, not added."""
    tally = Tally()
    for message in (delta(0, 1), delta(1, 1), delta(0, 2), delta(0, 3), delta(1, 2)):
        tally.record(message)
    assert tally.completion == {0: 3, 1: 2}
    assert tally.completion_tokens == 5
    assert tally.started


def test_record_keeps_the_most_cached_prompt_tokens():
    tally = Tally()
    for message in (delta(0, 1, cached=16), delta(1, 1, cached=32), delta(0, 2, cached=0)):
        tally.record(message)
    assert tally.cached_tokens == 32


def test_the_first_delta_is_a_first_token_and_the_rest_are_gaps():
    tally = Tally(arrived=time.monotonic() - 0.5)
    first_tokens, gaps = observed(TTFT), observed(ITL)
    before = time.monotonic()
    tally.record(delta(0, 1))
    assert (observed(TTFT) - first_tokens, observed(ITL) - gaps) == (1, 0)
    stamped = tally.last_message_at
    assert before <= stamped <= time.monotonic()
    tally.record(delta(0, 2))
    tally.record(delta(0, 3))
    assert (observed(TTFT) - first_tokens, observed(ITL) - gaps) == (1, 2)
    assert tally.last_message_at >= stamped


# --- a whole reply -------------------------------------------------------------------------------


def test_record_reply_counts_every_samples_last_total():
    tally = Tally()
    first_tokens, gaps = observed(TTFT), observed(ITL)
    tally.record_reply(
        reply(
            delta(0, 1, cached=8),
            delta(1, 1, cached=8),
            delta(0, 2),
            delta(1, 2),
            delta(1, 3),
            first_token_at=time.monotonic(),
        )
    )
    assert (tally.started, tally.completion, tally.completion_tokens) == (True, {0: 2, 1: 3}, 5)
    assert tally.cached_tokens == 8
    assert (observed(TTFT) - first_tokens, observed(ITL) - gaps) == (1, 0)  # one first, no gaps


# --- what an aborting worker reports -------------------------------------------------------------


def report(completion_tokens: int, cached: int = 0) -> worker_pb2.AbortResponse:
    return worker_pb2.AbortResponse(
        found=True, prompt_tokens=10, completion_tokens=completion_tokens, cached_tokens=cached
    )


def test_an_abort_report_counts_the_prompt_as_processed():
    tally = Tally()
    tally.charge_reported(report(0))
    assert (tally.started, tally.completion_tokens) == (True, 0)


@pytest.mark.parametrize(
    ("reports", "charged"),
    [
        ((3,), 5),  # it saw more than the worker reported: what it saw
        ((9,), 9),  # the worker generated more than reached the gateway: the report
        ((9, 4), 9),  # a later, smaller report never lowers it
    ],
)
def test_completion_is_the_larger_of_what_was_seen_and_reported(reports, charged):
    tally = Tally()
    tally.record(delta(0, 3))
    tally.record(delta(1, 2))
    for tokens in reports:
        tally.charge_reported(report(tokens))
    assert tally.completion_tokens == charged


def test_an_abort_report_raises_cached_tokens_only_upwards():
    tally = Tally(cached_tokens=16)
    tally.charge_reported(report(1, cached=8))
    assert tally.cached_tokens == 16
    tally.charge_reported(report(1, cached=48))
    assert tally.cached_tokens == 48


# --- overhead ------------------------------------------------------------------------------------


def test_overhead_is_the_time_since_arrival_less_the_workers_answer():
    now = time.monotonic()
    tally = Tally(arrived=now - 1.0, called_at=now - 0.8, answered_at=now - 0.3)
    overhead = tally.overhead_s()
    assert 0.5 - 1e-6 <= overhead < 0.5 + (time.monotonic() - now) + 1e-6


def test_overhead_without_an_answer_is_all_the_time_since_arrival():
    now = time.monotonic()
    tally = Tally(arrived=now - 0.25)
    assert 0.25 - 1e-6 <= tally.overhead_s() < 0.25 + (time.monotonic() - now) + 1e-6
