"""`ddpm.memory`: saved-tensor accounting against a layer whose saved tensors are known, and the CLI."""

import pytest
import torch
from helpers import REPO, run, tiny_unet
from torch import nn

from ddpm.memory import estimate, saved_tensor_bytes


def test_saved_tensor_bytes_counts_what_autograd_keeps():
    """Linear -> Sigmoid keeps the input (B, 8) and the sigmoid output (B, 4), not the Linear's weight."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    x = torch.randn(16, 8, requires_grad=True)
    saved = saved_tensor_bytes(lambda: torch.sigmoid(layer(x)).sum(), exclude=list(layer.parameters()))
    assert saved == (16 * 8 + 16 * 4) * 4
    assert layer.weight.grad is not None  # backward ran, freeing the graph


def test_estimate_counts_parameters_and_scales_activations_with_the_batch():
    """Parameters, gradients and the EMA's average: 4 bytes each; AdamW: 8; activations at batch 8 = 2x batch 4's."""
    torch.manual_seed(0)
    net = tiny_unet()
    count = sum(p.numel() for p in net.parameters())

    def loss(model, x, y):
        return model(x, torch.zeros(len(x), dtype=torch.long)).square().mean()

    sizes = [estimate(net, loss, batch_size=b, image_shape=(1, 8, 8), num_classes=None, measure_batch=b)
             for b in (4, 8)]  # fmt: skip
    assert sizes[0]["parameters"] == sizes[0]["gradients"] == 4 * count and sizes[0]["optimizer"] == 8 * count
    assert sizes[0]["ema"] == 4 * count  # the EMA callback's float32 average (the UNet has no buffers)
    assert sizes[0]["activations"] > 0
    ratio = sizes[1]["activations"] / sizes[0]["activations"]
    assert 1.9 < ratio < 2.1, ratio


def test_bf16_weight_copies_are_counted_once_not_per_image():
    """Under bf16-mixed autocast saves a bf16 copy of each weight for backward, once whatever the batch: scaling
    the whole measurement by batch / measure_batch counted it that many times (the estimate fell as measure_batch
    grew). Truth: the estimate does not depend on measure_batch."""
    torch.manual_seed(0)
    net = tiny_unet()

    def loss(model, x, y):
        return model(x, torch.zeros(len(x), dtype=torch.long)).square().mean()

    sizes = [estimate(net, loss, batch_size=64, image_shape=(1, 8, 8), num_classes=None, measure_batch=m,
                      precision="bf16-mixed")["activations"] for m in (1, 2, 4)]  # fmt: skip
    assert max(sizes) - min(sizes) <= 0.001 * max(sizes), sizes


def test_cli_prints_the_breakdown():
    """`python -m ddpm.memory model=unet_tiny data.batch_size=32` prints every line of the estimate."""
    result = run("python", "-m", "ddpm.memory", "model=unet_tiny", "data.batch_size=32", "--measure-batch", "2",
                 timeout=120)  # fmt: skip
    for word in ("parameters", "gradients", "optimizer", "activations", "total", "batch 32"):
        assert word in result.stdout, result.stdout


def test_seed_mnist_preset_layout_and_size():
    """conf/model/seed_mnist.yaml: 28 -> 14 -> 7 (fourth level stays 7), widths 32-64-128-256, 4-head attention
    at every size, 128-d embedding; (B, 1, 28, 28) in and out. Its size with this UNet's layout is 13.3M
    (the design notes say 10.2M: their up path differs; see the README's scaling notes)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from ddpm.models.layers import Attention, ResBlock

    net = instantiate(OmegaConf.load(REPO / "conf/model/seed_mnist.yaml"))
    count = sum(p.numel() for p in net.parameters())
    assert abs(count - 13.30e6) / 13.30e6 < 0.01, count
    assert net.time_embed.mlp[-1].out_features == 128
    assert sorted({m.conv2.out_channels for m in net.modules() if isinstance(m, ResBlock)}) == [32, 64, 128, 256]
    assert {m.num_heads for m in net.modules() if isinstance(m, Attention)} == {4}
    sizes = []
    hooks = [m.register_forward_hook(lambda m, i, o: sizes.append((o.shape[1], o.shape[-1])))
             for m in net.modules() if isinstance(m, Attention)]  # fmt: skip
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        out = net(x, torch.tensor([0, 999]), torch.tensor([3, 7]))
    assert out.shape == x.shape
    assert sorted(set(sizes)) == [(32, 28), (64, 14), (128, 7), (256, 7)]
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize(
    ("override", "refusal"),
    [("data.batch_size=1.5", r"data.batch_size=1.5 is not int"), ("data.batch_size=0", r"data.batch_size=0 must be"),
     ("+optim.lrr=1", r"optim.lrr: did you mean optim.lr\?")],
)  # fmt: skip
def test_the_estimate_checks_its_overrides_as_train_py_does(override: str, refusal: str) -> None:
    """1.5 was int()ed to a batch of 1 (exit 0), 0 divided by zero, and an unknown key was ignored."""
    from ddpm.memory import main

    with pytest.raises(ValueError, match=refusal):
        main([override])


def test_the_estimate_needs_no_data_path() -> None:
    """experiment=imagenet64 (data=image_folder, data.root ???): refused as unset once the overrides were checked;
    the estimate reads no data."""
    from ddpm.memory import main

    assert main(["experiment=imagenet64", "data.batch_size=2"])["batch_size"] == 2
