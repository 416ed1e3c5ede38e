"""torch.compile in place: no recompilation after warm-up, checkpoints interchangeable with eager runs;
precision settings (fp16 warning, TF32), channels_last and activation checkpointing."""

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import CPU_KINDS, compose, tiny_unet, use_cpu
from torch._dynamo.utils import counters

from ddpm import precision, training
from ddpm.callbacks.ema import EMA
from ddpm.data.ram import RAMDataModule
from ddpm.data.sources import DigitsSource
from ddpm.diffusion.gaussian import GaussianDiffusion
from ddpm.module import DiffusionModule
from ddpm.optim import AdamW


def make_module(**kwargs: Any) -> DiffusionModule:
    torch.manual_seed(0)
    return DiffusionModule(net=tiny_unet(), diffusion=GaussianDiffusion(num_timesteps=100), optim=AdamW(lr=1e-3),
                           val_timesteps=4, **kwargs)  # fmt: skip


def perturb(net: torch.nn.Module, std: float = 0.5) -> None:
    """Every weight drawn from N(0, std^2): off the zero init, so outputs are O(1) and depend on every tensor."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * std)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"{unequal[:5]} differ"


def fit(module: DiffusionModule, tmp_path, *, max_steps: int, callbacks: list[pl.Callback] = ()) -> pl.Trainer:
    data = RAMDataModule(source=DigitsSource(), image_size=8, channels=1, batch_size=16, limit=160, val_size=32)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, val_check_interval=2, limit_val_batches=2,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[EMA(decay=0.9), *callbacks],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return trainer


class GraphCounts(pl.Callback):
    """Dynamo's count of distinct compiled graphs after every training batch and every validation."""

    def __init__(self) -> None:
        self.after_batch: list[int] = []
        self.after_val: list[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.after_batch.append(counters["stats"]["unique_graphs"])

    def on_validation_end(self, *args: Any) -> None:
        self.after_val.append(counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_compiled_training_does_not_recompile_after_warm_up(tmp_path):
    """Train steps, validations (eval mode, no_grad, EMA weights copied in and out): graphs stop growing after
    the first train step and the first validation."""
    torch._dynamo.reset()
    counters.clear()
    module = make_module(compile=True, compile_backend="eager")
    graphs = GraphCounts()
    fit(module, tmp_path, max_steps=8, callbacks=[graphs])
    assert module._loss_fn != module._loss  # the loss is compiled; the network module is untouched
    assert len(graphs.after_val) == 4 and graphs.after_val[0] >= 1
    warm = graphs.after_val[0]  # after step 2: the training graph and the validation graph exist
    assert graphs.after_batch[2:] == [warm] * (len(graphs.after_batch) - 2), graphs.after_batch
    assert graphs.after_val == [warm] * 4
    assert counters["recompiles"] == {} or sum(counters["recompiles"].values()) == 0, dict(counters["recompiles"])


def test_checkpoints_move_between_compiled_and_eager(tmp_path):
    """A checkpoint of a compiled run has plain parameter names and loads into an eager model, and back: the
    weights are equal tensor by tensor, and the models (weights off the zero init) give the same O(1) outputs."""
    torch._dynamo.reset()
    compiled = make_module(compile=True, compile_backend="eager")
    perturb(compiled.net)
    trainer = fit(compiled, tmp_path, max_steps=1)
    path = tmp_path / "compiled.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    keys = list(checkpoint["state_dict"]) + list(checkpoint["ema_state_dict"])
    assert not [k for k in keys if "_orig_mod" in k]
    assert_same_weights(checkpoint["state_dict"], compiled.state_dict())
    eager = make_module()
    eager.load_state_dict(checkpoint["state_dict"], strict=True)
    assert_same_weights(eager.state_dict(), checkpoint["state_dict"])
    x, t = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(2)), torch.tensor([3, 70])
    compiled.eval(), eager.eval()
    with torch.no_grad():
        out = eager.net(x, t)
        assert out.abs().mean() > 0.1, "outputs near zero: the comparison below would prove nothing"
        torch.testing.assert_close(compiled.net(x, t), out, rtol=1e-5, atol=1e-6)
    fresh = make_module(compile=True, compile_backend="eager")  # eager weights into a compiled model
    fresh.configure_model()
    assert fresh._loss_fn != fresh._loss
    fresh.load_state_dict(eager.state_dict(), strict=True)
    assert_same_weights(fresh.state_dict(), eager.state_dict())
    noise, steps = torch.randn_like(x), torch.tensor([3, 70])  # the compiled loss against the eager one
    eager.train(), fresh.train()
    torch.testing.assert_close(fresh._loss_fn(x, steps, noise, None), eager._loss(x, steps, noise, None),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_channels_last_trains_with_nhwc_weights_and_inputs(tmp_path):
    """module.channels_last: conv weights and the step's inputs are channels_last; training runs."""
    module = make_module(channels_last=True)
    seen = []
    original = module.net.forward
    module.net.forward = lambda x, t, y=None: (seen.append(x.is_contiguous(memory_format=torch.channels_last)),
                                               original(x, t, y))[1]  # fmt: skip
    fit(module, tmp_path, max_steps=2)
    assert module.net.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert seen and all(seen)


def test_activation_checkpointing_gives_the_same_gradients():
    """model.checkpoint_activations recomputes ResBlocks in backward: same loss and gradients as without."""
    grads = []
    for remat in (False, True):
        torch.manual_seed(0)
        net = tiny_unet(checkpoint_activations=remat)
        for p in net.parameters():  # undo the zero init, so every gradient is non-trivial
            torch.nn.init.normal_(p, std=0.05)
        x, t = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([1, 5, 50, 99])
        net(x, t).square().mean().backward()
        grads.append({k: p.grad.clone() for k, p in net.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], msg=k)


def test_fp16_warns_and_bf16_does_not():
    """16-mixed warns about GroupNorm/softmax in fp16 and recommends bf16; bf16-mixed and 32-true are quiet."""
    with pytest.warns(UserWarning, match=r"bf16-mixed"):
        assert "fp16-warning" in precision.configure_precision("16-mixed")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precision.configure_precision("bf16-mixed")


def test_tf32_turns_on_for_float32_on_ampere_only(monkeypatch):
    """float32 on a capability >= 8.0 GPU sets matmul precision 'high' (TF32); elsewhere nothing changes."""
    before = torch.get_float32_matmul_precision()
    try:
        monkeypatch.setattr(precision, "tf32_capable", lambda: False)
        assert precision.configure_precision("32-true") == []
        assert torch.get_float32_matmul_precision() == before
        monkeypatch.setattr(precision, "tf32_capable", lambda: True)
        assert precision.configure_precision("bf16-mixed") == []
        assert precision.configure_precision("32-true") == ["tf32"]
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def cpu_flags() -> set[str]:
    """The CPU feature flags the kernel reports (/proc/cpuinfo), an independent view of the hardware."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        pytest.skip("no /proc/cpuinfo on this platform")
    line = next((line for line in info.read_text().splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def test_native_bf16_on_cpu_agrees_with_the_cpu_flags():
    """oneDNN runs bf16 natively from AVX512 (core: bw, vl, dq) up; an AVX2-only CPU has no bf16 path."""
    flags = cpu_flags()
    if {"avx512_bf16", "amx_bf16"} & flags:
        assert precision.native_bf16("cpu")
    elif not any(flag.startswith("avx512") for flag in flags):
        assert not precision.native_bf16("cpu")
    else:
        pytest.skip(f"AVX512 without avx512_bf16: oneDNN's choice depends on its version ({sorted(flags)[:5]}...)")


def test_fast_bf16_on_cpu_only_with_amx_per_the_cpu_flags():
    """Training's `auto` rule against the kernel's flags: bf16 beat float32 on an AMX Xeon (1.8x) and lost on an
    AVX512-BF16 Xeon without AMX (0.70-0.75x), so AVX512-BF16 alone does not count."""
    flags = cpu_flags()
    assert precision.fast_bf16("cpu") is ({"amx_tile", "amx_bf16"} <= flags)


@pytest.mark.parametrize(("native", "amx", "bf16"), CPU_KINDS)
def test_auto_precision_is_bf16_only_where_it_trains_faster(monkeypatch, native, amx, bf16):
    use_cpu(monkeypatch, native=native, amx=amx)
    assert precision.resolve_precision("auto", "cpu") == ("bf16-mixed" if bf16 else "32-true")
    for explicit in ("32-true", "16-mixed"):  # python -m ddpm.memory sizes a GPU's 16-mixed run on a CPU
        assert precision.resolve_precision(explicit, "cpu") == explicit
    for fp16 in ("16-mixed", "16"):  # Lightning trained bf16-mixed instead, under a float16 warning and config record
        with pytest.raises(ValueError, match=rf"trainer.precision={fp16} on a CPU: Lightning trains bf16-mixed"):
            training.resolve_config(compose("train", [f"trainer.precision={fp16}", "paths.output_dir=unused"]))
    precision.check_fp16_device("16-mixed", "gpu")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)  # Apple Silicon: Lightning's auto is MPS,
    assert precision.run_device("auto") == "mps"  # where 16-mixed trains in float16
    precision.check_fp16_device("16-mixed", "auto")
    monkeypatch.setattr(precision, "native_bf16", lambda device: device == "cuda")  # an Ampere+ GPU
    assert precision.resolve_precision("auto", "gpu") == "bf16-mixed"


def test_a_torch_without_onednn_has_no_native_bf16_cpu(monkeypatch):
    """Builds without oneDNN (some ARM ones: Apple Silicon, Jetson) register no mkldnn ops: `auto` raised an
    AttributeError in train.py's and sample.py's defaults."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.ops, "mkldnn", SimpleNamespace())
    assert precision.native_bf16("cpu") is False
    assert precision.resolve_precision("auto", "cpu") == "32-true"
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert precision.native_bf16("cpu") is False


def test_explicit_bf16_sampling_on_a_cpu_without_it_warns(monkeypatch):
    """sample.py precision=bf16 where bf16 runs on reference kernels: a warning (its check read a copy of
    native_bf16 that the CPU stand-ins did not reach)."""
    from ddpm.sampling.runtime import resolve_sampling_precision

    use_cpu(monkeypatch, native=False, amx=False)
    with pytest.warns(UserWarning, match=r"precision=bf16 on a cpu without native bfloat16.*precision=32"):
        assert resolve_sampling_precision("bf16", "cpu") == "bf16"
    use_cpu(monkeypatch, native=True, amx=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_sampling_precision("bf16", "cpu") == "bf16"


def test_explicit_bf16_on_a_cpu_without_it_warns_and_names_the_fix(monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    with pytest.warns(UserWarning, match=r"trainer\.precision=auto .* trainer\.precision=32-true"):
        assert precision.resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"  # the user's choice stands
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"


def test_run_device_follows_the_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert [precision.run_device(a) for a in ("auto", None, "cpu", "gpu", "cuda")] == ["cpu"] * 3 + ["cuda"] * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert precision.run_device("auto") == "cuda"


@pytest.mark.parametrize(("native", "amx", "bf16"), CPU_KINDS)
def test_auto_compile_is_on_where_measured_to_pay_off(monkeypatch, native, amx, bf16):
    """compile=auto: on for CUDA and for AMX CPUs (1.37x per step measured in bf16), off on other CPUs (1.00x on
    AVX512-BF16 without AMX); experiment=mnist asks for both autos, and the resolved config (what config.yaml
    records) holds the decisions."""
    use_cpu(monkeypatch, native=native, amx=amx)
    on = "default" if bf16 else False  # inductor's default mode where it pays off
    assert precision.resolve_compile("auto", "cpu") == on
    assert precision.resolve_compile("auto", "gpu") == "default"
    assert precision.resolve_compile(False, "gpu") is False and precision.resolve_compile(True, "cpu") is True
    assert precision.resolve_compile("reduce-overhead", "gpu") == "reduce-overhead"
    with pytest.raises(ValueError, match=r"compile='yes' must be true, false, auto or one of \['default'"):
        precision.resolve_compile("yes", "cpu")
    assert ("mode default" in precision.compile_note("default", "gpu")) and "off" in precision.compile_note(
        False, "cpu"
    )
    assert "CUDA graphs" in precision.compile_note("default", "gpu")
    assert "CUDA graphs" not in precision.compile_note("default", "cpu")  # never on a CPU (uses_cudagraphs)
    resolved = training.resolve_config(compose("train", ["experiment=mnist", "paths.output_dir=unused"]))
    assert resolved["compile"] == on and resolved["module"]["compile"] == on
    assert resolved["trainer"]["precision"] == ("bf16-mixed" if bf16 else "32-true")
    default = training.resolve_config(compose("train", ["paths.output_dir=unused"]))
    assert default["compile"] is False and default["module"]["compile"] is False
