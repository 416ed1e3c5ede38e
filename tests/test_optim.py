"""ddpm.optim.AdamW's LR schedule against its closed form: linear warm-up, then constant, cosine or linear decay to
min_lr_ratio x lr at the last step, as the optimizer sees it after each step."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from ddpm.config.build import build
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


def test_a_decay_needs_the_run_length_and_bad_values_are_refused_by_argument() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=r"^decay=cosine decays the LR to the last step, so it needs .* total_steps "
                                         r"\(now -1: the Trainer's max_steps\); give it, or decay=none"):  # fmt: skip
        AdamW(decay="cosine").build([param], global_batch_size=64, total_steps=-1)
    with pytest.raises(ValueError, match=r"^decay='step' is unknown; use none, cosine or linear"):
        AdamW(decay="step")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^min_lr_ratio=2 must be in \[0, 1\]"):
        AdamW(min_lr_ratio=2)
    AdamW(decay="none").build([param], global_batch_size=64, total_steps=-1)  # fine


@pytest.mark.parametrize(
    ("bad", "refusal"),
    [
        ({"decay": "step"}, r"^optim\.decay='step' is unknown; use none, cosine or linear"),
        # two arguments in one message; `decay=` inside `weight_decay=` is not an argument of its own
        ({"weight_decay": -0.1}, r"^optim\.weight_decay=-0.1 must be >= 0 and optim\.eps=1e-08 > 0"),
    ],
)
def test_bad_values_built_from_the_config_name_the_key(bad: dict, refusal: str) -> None:
    """Built from a run config's `optim:` node (as train.py builds it), the refusal names the optim.* keys."""
    cfg = OmegaConf.create({"optim": {"_target_": "ddpm.optim.AdamW", **bad}})
    with pytest.raises(ValueError, match=refusal):
        build(cfg.optim)
