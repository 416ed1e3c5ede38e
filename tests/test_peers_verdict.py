"""benchmarks/peers.py's verdict on hand-made repeats: the row-spread test and the paired per-repeat test
(benchmarks/common.py's paired ratios and true median)."""

import statistics
import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import peers  # (benchmarks/peers.py: imports no peer package at module level)


def rows(ours: list[float], peer: list[float]) -> list[dict]:
    def row(key: str, runs: list[float]) -> dict:
        median = statistics.median(runs)
        return {"key": key, "tool": peers.ROWS[key], "sample_runs": runs, "sample_images_per_s": median,
                "sample_spread": (max(runs) - min(runs)) / median}  # fmt: skip

    return [row("ours", ours), row("diffusers", peer)]


def test_paired_repeats_can_be_beyond_the_noise_that_one_outlier_gives_the_medians() -> None:
    # medians 21 vs 17 (+23.5%); ours' outlier 26 makes its spread (26 - 20) / 21 = 28.6% > the margin
    v = peers.verdict(rows([21, 20, 26, 21, 20.5], [17, 16, 18, 17, 16.5]), "sample")
    assert v["margin"] == pytest.approx(21 / 17 - 1) and v["noise"] == pytest.approx(6 / 21)
    assert v["ours_first"] and v["beyond_noise"] is False
    assert v["paired_ratios"] == pytest.approx([21 / 17, 20 / 16, 26 / 18, 21 / 17, 20.5 / 16.5])
    assert v["ahead_in"] == 5 and v["beyond_noise_paired"] is True
    assert v["paired"]["median"] == pytest.approx(statistics.median([21 / 17, 20 / 16, 26 / 18, 21 / 17, 20.5 / 16.5]))
    assert v["paired"]["min"] == pytest.approx(21 / 17) and v["paired"]["max"] == pytest.approx(26 / 18)
    assert "ahead in 5 of 5" in peers.verdict_line(v)


def test_one_repeat_behind_is_within_the_noise() -> None:
    v = peers.verdict(rows([110, 100, 104], [94, 91, 110]), "sample")
    assert v["ours_first"] and v["ahead_in"] == 2 and v["beyond_noise_paired"] is False


def test_even_repeats_use_the_true_median_and_the_bare_loop_is_no_peer() -> None:
    # 4 repeats: medians (20 + 22) / 2 = 21 and (16 + 18) / 2 = 17, not the upper 22 and 18
    results = rows([20, 22, 19, 25], [16, 18, 15, 19])
    results.append({**results[0], "key": "ours_bare", "tool": peers.ROWS["ours_bare"], "sample_runs": [99, 99, 99, 99],
                    "sample_images_per_s": 99.0, "sample_spread": 0.0})  # fmt: skip
    v = peers.verdict(results, "sample")
    assert v["best_peer"] == "diffusers" and v["margin"] == pytest.approx(21 / 17 - 1)
    assert peers.verdict(results, "sample", ours="ours_bare")["margin"] == pytest.approx(99 / 17 - 1)
