"""benchmarks/peers.py's verdict on hand-made repeats: the row-spread test and the paired per-repeat test."""

import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import peers  # (benchmarks/peers.py: imports no peer package at module level)


def rows(ours: list[float], peer: list[float]) -> list[dict]:
    def row(key: str, runs: list[float]) -> dict:
        median = sorted(runs)[len(runs) // 2]
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
    assert "ahead in 5 of 5" in peers.verdict_line(v)


def test_one_repeat_behind_is_within_the_noise() -> None:
    v = peers.verdict(rows([110, 100, 104], [94, 91, 110]), "sample")
    assert v["ours_first"] and v["ahead_in"] == 2 and v["beyond_noise_paired"] is False
