"""benchmarks/throughput.py's rows on the presets of the GPU (`--device cuda`) commands: the default rows reach the
timing on every preset, and a diffusers row on a preset diffusers' UNet2DModel cannot express stops before anything
is timed, naming why; benchmarks/loops.py's step timer on a hand-driven clock."""

from pathlib import Path

import pytest
import torch
from helpers import REPO


class Timing(Exception):
    """Raised where throughput.py would start loading images and timing rows."""


@pytest.fixture
def throughput(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import throughput

    return throughput


@pytest.mark.parametrize(
    ("model", "reason"),
    [("seed_mnist", "model.downsample=[True, True, False]"), ("unet64", "model.num_heads=4 at the attention widths")],
)
def test_a_diffusers_row_on_a_preset_unet2dmodel_cannot_express_is_refused_before_timing(
    model: str, reason: str, tmp_path: Path, throughput, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "t.json"
    argv = ["--model", model, "--rows", "ram_fp32,ram_fp32_diffusers", "--device", "cpu", "--allow-dirty", "--out", out]
    with pytest.raises(SystemExit) as refused:
        throughput.main([str(a) for a in argv])
    assert reason in str(refused.value) and "leave those rows out (the default does)" in str(refused.value)
    assert not out.exists() and "done ram_fp32" not in capsys.readouterr().out  # refused before the first timed row


@pytest.mark.parametrize("model", ["seed_mnist", "ddpm_cifar10", "unet64"])
def test_the_default_rows_of_every_gpu_command_reach_the_timing(model: str, throughput, monkeypatch) -> None:
    # `--model <preset> --device cuda` with no rows: two presets used to die building a diffusers twin they cannot
    # have. Each now gets as far as the images, with no twin built.
    def twin(*args):
        raise AssertionError("the default rows built a diffusers twin")

    def images(base, count):
        raise Timing

    monkeypatch.setattr(throughput.loops, "make_twin", twin)
    monkeypatch.setattr(throughput.loops, "twin_refusal", twin)
    monkeypatch.setattr(throughput.loops, "load_images", images)
    with pytest.raises(Timing):
        throughput.main(["--model", model, "--device", "cpu", "--allow-dirty"])


def test_step_spans_run_from_the_previous_batch_end_and_leave_the_paired_step_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/loops.py's Steps on a hand-driven clock: a span runs from the end of the previous batch (after the
    paired bare step) to the end of its own; its wait to the start of its batch; a window from batch a's end to b's."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import loops

    now = [0.0]
    monkeypatch.setattr(loops.time, "perf_counter", lambda: now[0])

    def tick(seconds: float) -> None:
        now[0] += seconds

    paired, window = (
        loops.Steps(torch.device("cpu"), between=lambda: tick(0.5)),
        loops.Steps(torch.device("cpu"), at=(1, 3)),
    )
    for timer in (paired, window):
        now[0] = 0.0
        for fetch, step in [(1.0, 2.0), (0.1, 3.0), (0.2, 4.0)]:
            tick(fetch)
            timer.on_train_batch_start()
            tick(step)
            timer.on_train_batch_end()
    steps, waits = paired.spans(0)  # batches 2 and 3: ends 6.6 and 11.3, after resuming at 3.5 and 7.1
    assert steps == pytest.approx([3.1, 4.2]) and waits == pytest.approx([0.1, 0.2])
    assert paired.between_s == pytest.approx([0.5, 0.5, 0.5]) and paired.ends[1] - paired.starts[0] == 2.0
    assert window.window == pytest.approx(10.3 - 3.0) and sorted(window.ends) == [1, 3]
