"""The soak's bookkeeping, without a server: the measured warm-up, growth per process, and the
adversarial inputs (each request's own schema, stop strings and logit-bias map)."""

from __future__ import annotations

import random

import pytest

from tandem.testing.soak import (
    BIAS_IDS, SoakConfig, WaveResult, growth, new_logit_bias, new_schema, new_stop_strings, warmup_waves)


def wave(number: int, head: float, rank: float, fds: int = 40) -> WaveResult:
    return WaveResult(
        wave=number, adversarial=False, duration_s=10.0, requests=10, outcomes={"finished": 10}, kinds={},
        problems=[], drained_s=0.0, running_after=0, waiting_after=0, kv_usage_after=0, preemptions_total=0,
        rss_mb={"head": head, "rank": rank}, open_fds={"head": fds, "rank": fds})


def test_the_warm_up_ends_where_the_curve_joins_the_line_of_the_second_half():
    """Memory climbs for 10 waves (caches filling), then is flat with noise: the warm-up is
    measured as those 10 waves, not assumed as one, and the growth after it is the noise."""
    rng = random.Random(0)
    ranks = [300 + 3 * min(i, 10) + rng.uniform(-0.3, 0.3) for i in range(60)]
    waves = [wave(i + 1, 200.0, rank) for i, rank in enumerate(ranks)]
    assert warmup_waves(waves) in (10, 11)
    grown = growth(waves)
    assert grown.warmup == warmup_waves(waves)
    assert abs(grown.rss) < 0.002 and abs(grown.worst_process_rss) < 0.003 and abs(grown.rss_mb_per_hour) < 2


def test_a_steady_leak_is_growth_however_the_warm_up_is_measured():
    """A line from the first wave on joins its own fit at once: a leak cannot hide in the
    warm-up. Growth compares the means of the first and last three of the 39 measured waves
    (302 and 338 MB); 1 MB a wave of 10 s is 360 MB an hour."""
    waves = [wave(i + 1, 200.0, 300.0 + i) for i in range(40)]
    grown = growth(waves)
    assert grown.warmup == 1
    assert grown.worst_process == "rank" and grown.worst_process_rss == pytest.approx(36 / 302)
    assert grown.rss_mb_per_hour == pytest.approx(360, rel=1e-6)


def test_the_worst_process_is_named_when_the_total_hides_it():
    waves = [wave(i + 1, 1000.0 - 0.5 * i, 100.0 + 0.5 * i) for i in range(5)]
    grown = growth(waves, warmup=1)  # windows of 2: waves 2-3 and 4-5
    assert grown.rss < 0.001 and grown.worst_process == "rank" and grown.worst_process_rss == pytest.approx(1 / 100.75)


def test_one_low_sample_does_not_read_as_growth():
    """An idle rank hands pages back between waves, so single samples dip: means over a
    window, not the maximum over one sample, decide."""
    ranks = [320.0] * 30
    ranks[0] = 316.0
    grown = growth([wave(i + 1, 200.0, rank) for i, rank in enumerate(ranks)], warmup=0)
    assert grown.worst_process_rss < 0.005


def test_short_runs_take_the_first_wave_as_the_warm_up():
    assert warmup_waves([wave(i + 1, 200.0, 300.0 + 5 * i) for i in range(4)]) == 1


def test_every_third_wave_is_adversarial_and_its_inputs_are_new_and_valid():
    config = SoakConfig()
    assert [config.is_adversarial(i) for i in range(6)] == [False, False, True, False, False, True]
    assert not SoakConfig(adversarial_every=0).is_adversarial(2)
    rng = random.Random(1)
    schemas = [new_schema(rng) for _ in range(200)]
    assert len({str(s) for s in schemas}) == 200
    assert all(s["required"] == list(s["properties"]) and 1 <= len(s["properties"]) <= 4 for s in schemas)
    for _ in range(200):
        stops = new_stop_strings(rng)
        assert 1 <= len(stops) <= 4 and all(1 <= len(s) <= 3 and s.isprintable() and " " not in s for s in stops)
        bias = new_logit_bias(rng)
        assert 1 <= len(bias) <= 300 and all(0 <= int(k) < BIAS_IDS and -100 <= v <= 100 for k, v in bias.items())
