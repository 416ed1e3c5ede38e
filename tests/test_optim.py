"""ddpm.optim.AdamW's LR schedule against its closed form: linear warm-up, then constant, cosine or linear decay to
min_lr_ratio x lr at the last step, as the optimizer sees it after each step."""

import math

import pytest
import torch

from ddpm.optim import AdamW


def lrs(optim: AdamW, total: int) -> list[float]:
    """The LR of each of `total` optimizer steps, read from the optimizer as training would see it."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer, schedule = optim.build([param], global_batch_size=optim.base_batch_size, total_steps=total)
    seen = []
    for _ in range(total):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return seen


def expected(step: int, *, lr: float, warmup: int, total: int, decay: str, floor: float) -> float:
    warm = 1.0 if warmup == 0 else min(1.0, (step + 1) / warmup)
    p = min(1.0, max(0.0, (step - warmup) / (total - warmup)))
    shape = {"none": 1.0, "cosine": (1 + math.cos(math.pi * p)) / 2, "linear": 1 - p}[decay]
    return lr * warm * (1.0 if decay == "none" else floor + (1 - floor) * shape)


@pytest.mark.parametrize("decay", ["none", "cosine", "linear"])
@pytest.mark.parametrize(("warmup", "floor"), [(0, 0.0), (10, 0.0), (10, 0.1)])
def test_schedule_is_the_closed_form(decay: str, warmup: int, floor: float) -> None:
    total, lr = 50, 1e-3
    seen = lrs(AdamW(lr=lr, warmup_steps=warmup, decay=decay, min_lr_ratio=floor), total)
    for step, value in enumerate(seen):
        assert value == pytest.approx(expected(step, lr=lr, warmup=warmup, total=total, decay=decay, floor=floor))
    if decay != "none":  # the last step reaches the floor, the midpoint of a cosine is halfway
        assert seen[-1] == pytest.approx(
            lr * floor
            + lr
            * (1 - floor)
            * (
                1 / (total - warmup)
                if decay == "linear"
                else (1 + math.cos(math.pi * (total - 1 - warmup) / (total - warmup))) / 2
            )
        )


def test_cosine_is_halfway_at_the_middle_of_the_decay() -> None:
    optim = AdamW(lr=1.0, warmup_steps=0, decay="cosine")
    assert optim.lr_factor(50, 100) == pytest.approx(0.5) and optim.lr_factor(100, 100) == pytest.approx(0.0)


def test_a_decay_needs_the_run_length_and_bad_values_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"optim.decay=cosine .* needs trainer.max_steps"):
        AdamW(decay="cosine").build([torch.nn.Parameter(torch.zeros(1))], global_batch_size=64, total_steps=-1)
    with pytest.raises(ValueError, match=r"optim.decay='step' is unknown"):
        AdamW(decay="step")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"optim.min_lr_ratio=2 must be in \[0, 1\]"):
        AdamW(min_lr_ratio=2)
    AdamW(decay="none").build([torch.nn.Parameter(torch.zeros(1))], global_batch_size=64, total_steps=-1)  # fine
