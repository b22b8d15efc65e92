"""The gateway's retry hint for refusals: in-flight requests over the measured drain rate."""
from gateway.core import DrainRate


def test_retry_after_is_in_flight_over_the_completion_rate():
    d = DrainRate(window_s=10.0)
    assert d.retry_after_s(50, now=100.0) == 1                 # nothing measured: 1 s
    for i in range(40):                                        # 4 completions per second
        d.completed(now=90.5 + i * 0.25)
    assert d.rate(now=100.4) == 4.0
    assert d.retry_after_s(20, now=100.4) == 5                 # 20 in flight / 4 per s
    assert d.retry_after_s(1, now=100.4) == 1                  # at least 1 s
    assert d.retry_after_s(10_000, now=100.4) == 60            # at most 60 s
    assert d.rate(now=200.0) == 0.0                            # old completions forgotten
    assert d.retry_after_s(20, now=200.0) == 1
