"""The sampler table (benchmarks/mnist_recipe.py with several samplers): its choice of the fewest-calls sampler within
the noise of the reference, on hand-made rows in the committed table's form and in mnist_recipe's summary form; and
the sampler presets of benchmarks/common.py, composed from conf/sampler/, against the committed sampler table."""

import json
import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import common
import mnist_recipe


def row(config: str, nfe: int, guidance: float, value: float | None = None, low: float | None = None) -> dict:
    ratio = None if value is None else {"value": value, "low": low, "high": value + 0.1}
    return {"config": config, "nfe": nfe, "guidance": guidance, "vs_ddpm1000": ratio}


def fastest(rows: list[dict]) -> tuple:
    return mnist_recipe.fastest_within_noise(rows, name="config", ratio="vs_ddpm1000")


def test_ties_in_calls_go_to_the_lower_unguided_ratio_and_weights_without_ddpm1000_are_not_asked() -> None:
    rows = [
        row("ddpm1000", 1000, 0.0, 1.0, 1.0),
        row("dpm++10", 10, 0.0, 1.18, 1.05),  # fastest, but worse than DDPM-1000 beyond the noise
        row("ddim20", 20, 0.0, 1.08, 0.95),
        row("dpm++sde20", 20, 0.0, 1.01, 0.91),  # as fast as ddim20, closer to DDPM-1000
        row("dpm++sde25", 25, 0.0, 0.96, 0.85),
        *(row(c, n, 0.5) for c, n in [("dpm++10", 10), ("ddim20", 20), ("dpm++sde20", 20)]),  # no DDPM-1000 at 0.5
    ]
    best, ok = fastest(rows)
    assert ok == {0.0: ["ddpm1000", "ddim20", "dpm++sde20", "dpm++sde25"]}
    assert best == "dpm++sde20"


def test_a_guided_ddpm1000_row_is_asked_and_no_unguided_one_chooses_none() -> None:
    rows = [row("ddpm1000", 1000, 0.0, 1.0, 1.0), row("ddim20", 20, 0.0, 1.0, 0.9)]
    rows += [row("ddpm1000", 1000, 3.0, 1.0, 1.0), row("ddim20", 20, 3.0, 1.2, 1.1)]  # ddim20: worse when guided
    assert fastest(rows)[0] == "ddpm1000"
    assert fastest([r for r in rows if r["guidance"] == 3.0])[0] is None


def test_the_summary_form_asks_the_pooled_ratio_and_the_reference_row_needs_none() -> None:
    # mnist_recipe's summary: the reference's own row (drawn for the ratio) has no ratio; the others their pooled one
    rows = [{"sampler": "ddpm1000", "nfe": 1000, "guidance": 0.0},
            {"sampler": "ddim20", "nfe": 20, "guidance": 0.0, "vs_reference_pooled": {"value": 1.2, "low": 1.01}},
            {"sampler": "dpm++sde25", "nfe": 25, "guidance": 0.0, "vs_reference_pooled": {"value": 1.1, "low": 0.9}},
            {"sampler": "dpm++sde25", "nfe": 25, "guidance": 0.5}]  # fmt: skip
    assert mnist_recipe.fastest_within_noise(rows) == ("dpm++sde25", {0.0: ["dpm++sde25"]})


def test_the_committed_table_chooses_sample_py_default() -> None:
    rows = json.loads((REPO / "benchmarks/results/samplers.json").read_text())["rows"]
    assert fastest(rows)[0] == "dpm++sde20"


@pytest.mark.parametrize(
    "row",
    json.loads((REPO / "benchmarks/results/samplers.json").read_text())["rows"],
    ids=lambda r: f"{r['config']}-w{r['guidance']:g}",
)
def test_every_preset_the_committed_table_drew_builds_the_sampler_it_recorded(row: dict) -> None:
    """The table's rows were drawn by hand-written constructors; composed from conf/sampler/ each preset is the
    same class with the same recorded arguments, and the network calls per image the run counted."""
    sampler = common.sampler(row["config"])
    recorded = {k: v for k, v in row.items() if k in vars(sampler)}
    calls = sampler.network_evaluations() if hasattr(sampler, "network_evaluations") else sampler.steps or 1000
    assert type(sampler).__name__ == row["sampler"] and calls == row["nfe"]
    assert recorded and recorded == {k: vars(sampler)[k] for k in recorded}


def test_a_group_takes_steps_and_a_refusal_names_the_key_and_the_choices() -> None:
    built = common.sampler("dpm_solver", 10)
    assert (type(built).__name__, built.steps) == ("DPMSolverSampler", 10)
    with pytest.raises(ValueError, match=r"sampler\.steps=0 must be >= 1"):
        common.sampler("ddim", 0)
    with pytest.raises(ValueError, match=r"a preset \(ddpm1000, .*\) or a group \(ddim, ddpm"):
        common.sampler("ddim_fast")
