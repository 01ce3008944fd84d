"""The soak benchmark's pure logic (bench/soak_sample.py, bench/soak_report.py, bench/soak_episodes.py):
how a Redis key is put in its family, and when a series counts as growing or back to its start."""

from __future__ import annotations

import pytest

from bench.soak_episodes import KINDS, MIX, kind_of
from bench.soak_report import analyse, fit, verdict
from bench.soak_sample import key_family

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("key", "family"),
    [
        ("tp:run:0123abcd", "run:*"),
        ("tp:run:0123abcd:jobs", "run:*:jobs"),
        ("tp:run:0123abcd:working", "run:*:working"),
        ("tp:job:j1:done", "job:*:done"),
        ("tp:host:t1234567:live", "host:*:live"),
        ("tp:host:t1234567:subnet-owners", "host:*:subnet-owners"),
        ("tp:req:soak-1:abc", "req:*"),
        ("tp:sess:run1:sid9", "sess:*"),
        ("tp:warm:t1234567:hello-file", "warm:*"),
        ("tp:blob:task-facts:0a1b", "blob:task-facts:*"),
        ("tp:runs:recent", "runs:recent"),
        ("tp:count:failures", "count:failures"),
        ("tp:hosts", "hosts"),
        ("termpool.t1234567.exec", "kombu:termpool.<h>.exec"),
    ],
)
def test_key_family(key, family):
    assert key_family(key, "t1234567") == family


def test_fit_finds_the_slope_and_no_error_on_a_line():
    slope, error = fit([0, 1, 2, 3], [5, 7, 9, 11])
    assert slope == pytest.approx(2.0) and error == pytest.approx(0.0)


def test_a_steady_rise_grows_and_noise_is_flat():
    rising = [(x, 100 + 0.05 * x) for x in range(0, 2001, 200)]  # +100 over the run
    assert verdict("disk output mb", rising, 2000, 100, 200)["verdict"] == "grows"
    noisy = [(x, 700 + (15 if i % 2 else -15)) for i, x in enumerate(range(0, 2001, 200))]
    assert verdict("rss_mb exec", noisy, 2000, 700, 700)["verdict"] == "flat"


def test_a_plateau_after_warm_up_is_flat_and_back_to_start_uses_the_start():
    plateau = [(0, 10)] + [(x, 900) for x in range(200, 2001, 200)]  # records up to RECORD_TTL, then level
    v = verdict("redis keys", plateau, 2000, 10, 11)
    assert v["verdict"] == "flat" and v["back_to_start"] is True
    assert verdict("redis keys", plateau, 2000, 10, 900)["back_to_start"] is False


def test_analyse_reads_the_idle_sample_and_counts_a_missing_family_as_zero():
    def sample(episodes, phase, keys, families):
        return {
            "episodes": episodes,
            "phase": phase,
            "redis": {"used_memory_mb": 3.0, "keys": keys, "keys_by_family": families},
            "rss_mb": {"exec": 100.0},
            "fds": {"exec": 20},
            "docker": {"containers": 0},
            "disk": {"output": {"mb": 1.0, "entries": 3}},
        }

    samples = [sample(0, "start", 5, {"hosts": 5}), sample(100, "soak", 9, {"hosts": 5, "run:*": 4})]
    samples.append(sample(100, "idle", 5, {"hosts": 5}))
    by_name = {v["series"]: v for v in analyse(samples)}
    assert by_name["redis keys run:*"]["start"] == 0 and by_name["redis keys run:*"]["idle"] == 0
    assert by_name["redis keys"]["back_to_start"] is True


def test_every_kind_comes_in_every_twenty_episodes():
    assert len(KINDS) == 20 == sum(MIX.values())
    for first in (0, 20, 40):
        window = [kind_of(i) for i in range(first, first + 20)]
        assert {k: window.count(k) for k in MIX} == MIX
