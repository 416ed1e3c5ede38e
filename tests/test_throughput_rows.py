"""benchmarks/throughput.py's rows on the presets of docs/benchmarks.md's GPU commands: the default rows reach the
timing on every preset, and a diffusers row on a preset diffusers' UNet2DModel cannot express stops before anything
is timed, naming why (a real subprocess, as a user runs it)."""

from pathlib import Path

import pytest
from helpers import REPO, run


@pytest.mark.parametrize(
    ("model", "reason"),
    [("seed_mnist", "model.downsample=[True, True, False]"), ("unet64", "model.num_heads=4 at the attention widths")],
)
def test_a_diffusers_row_on_a_preset_unet2dmodel_cannot_express_is_refused_before_timing(
    model: str, reason: str, tmp_path: Path
) -> None:
    out = tmp_path / "t.json"
    result = run("python", "benchmarks/throughput.py", "--model", model, "--rows", "ram_fp32,ram_fp32_diffusers",
                 "--device", "cpu", "--allow-dirty", "--out", out, check=False)  # fmt: skip
    assert result.returncode != 0 and not out.exists()
    assert reason in result.stderr and "leave those rows out (the default does)" in result.stderr, result.stderr
    assert "done ram_fp32" not in result.stdout  # refused before the first timed row


class Timing(Exception):
    """Raised where throughput.py would start loading images and timing rows."""


@pytest.mark.parametrize("model", ["seed_mnist", "ddpm_cifar10", "unet64"])
def test_the_default_rows_of_every_gpu_command_reach_the_timing(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/benchmarks.md's three `--device cuda` commands name no rows; two of them used to die building a diffusers
    # twin their preset cannot have. Each now gets as far as the images, with no twin built.
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import throughput

    def twin(*args):
        raise AssertionError("the default rows built a diffusers twin")

    def images(base, count):
        raise Timing

    monkeypatch.setattr(throughput, "diffusers_twin", twin)
    monkeypatch.setattr(throughput, "load_images", images)
    with pytest.raises(Timing):
        throughput.main(["--model", model, "--device", "cpu", "--allow-dirty"])
