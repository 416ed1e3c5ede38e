"""benchmarks/samplers.py's choice of the fastest sampler within the noise of DDPM-1000, on hand-made rows; and the
sampler presets of benchmarks/common.py, composed from conf/sampler/, against the committed sampler table."""

import json
import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import common
import pytest
import samplers


def row(config: str, nfe: int, guidance: float, value: float | None = None, low: float | None = None) -> dict:
    ratio = None if value is None else {"value": value, "low": low, "high": value + 0.1}
    return {"config": config, "nfe": nfe, "guidance": guidance, "vs_ddpm1000": ratio}


def test_ties_in_calls_go_to_the_lower_unguided_ratio_and_weights_without_ddpm1000_are_not_asked() -> None:
    rows = [
        row("ddpm1000", 1000, 0.0, 1.0, 1.0),
        row("dpm++10", 10, 0.0, 1.18, 1.05),  # fastest, but worse than DDPM-1000 beyond the noise
        row("ddim20", 20, 0.0, 1.08, 0.95),
        row("dpm++sde20", 20, 0.0, 1.01, 0.91),  # as fast as ddim20, closer to DDPM-1000
        row("dpm++sde25", 25, 0.0, 0.96, 0.85),
        *(row(c, n, 0.5) for c, n in [("dpm++10", 10), ("ddim20", 20), ("dpm++sde20", 20)]),  # no DDPM-1000 at 0.5
    ]
    best, ok = samplers.fastest_within_noise(rows)
    assert ok == {0.0: ["ddpm1000", "ddim20", "dpm++sde20", "dpm++sde25"]}
    assert best == "dpm++sde20"


def test_a_guided_ddpm1000_row_is_asked_and_no_unguided_one_chooses_none() -> None:
    rows = [row("ddpm1000", 1000, 0.0, 1.0, 1.0), row("ddim20", 20, 0.0, 1.0, 0.9)]
    rows += [row("ddpm1000", 1000, 3.0, 1.0, 1.0), row("ddim20", 20, 3.0, 1.2, 1.1)]  # ddim20: worse when guided
    assert samplers.fastest_within_noise(rows)[0] == "ddpm1000"
    assert samplers.fastest_within_noise([r for r in rows if r["guidance"] == 3.0])[0] is None


@pytest.mark.parametrize(
    "row",
    json.loads((REPO / "benchmarks/results/samplers.json").read_text())["rows"],
    ids=lambda r: f"{r['config']}-w{r['guidance']:g}",
)
def test_every_preset_the_committed_table_drew_builds_the_sampler_it_recorded(row: dict) -> None:
    """The table's rows were drawn by hand-written constructors; composed from conf/sampler/ each preset is the
    same class with the same recorded arguments and network calls per image."""
    sampler = common.sampler(row["config"])
    recorded = {k: v for k, v in row.items() if k in vars(sampler)}
    assert type(sampler).__name__ == row["sampler"] and common.calls(sampler) == row["nfe"]
    assert recorded and recorded == {k: vars(sampler)[k] for k in recorded}


def test_a_group_takes_steps_and_a_refusal_names_the_key_and_the_choices() -> None:
    assert (type(common.sampler("dpm_solver", 10)).__name__, common.sampler("dpm_solver", 10).steps) == (
        "DPMSolverSampler",
        10,
    )
    with pytest.raises(ValueError, match=r"sampler\.steps=0 must be >= 1"):
        common.sampler("ddim", 0)
    with pytest.raises(ValueError, match=r"a preset \(ddpm1000, .*\) or a group \(ddim, ddpm"):
        common.sampler("ddim_fast")
