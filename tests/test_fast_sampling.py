"""Fast sampling, same images: precision (bf16 autocast around the network only), compile (one graph, static
shapes), batch_size auto.

Measured on a tiny perturbed-weight UNet (tests' 1x8x8 net, weights + 0.05 N(0, 1)), seed 3, 10 images in
batches of 4 (a partial last batch), against float32 eager on the same seed:
- bf16: DDPM 20 steps: mean |uint8 difference| 0.15, 14% of pixels differ (max 4); DDIM 10 steps with
  guidance 2: mean 0.30, 7.7% differ (max 39: guidance amplifies); bounds asserted: mean < 1.0, fraction < 0.3.
- compiled: identical images (0 differing pixels) with backend eager/aot_eager, and also with inductor
  (checked once by hand, not here: inductor takes minutes on a busy CPU); bound asserted: mean < 0.5, < 5%.
"""

import numpy as np
import pytest
import torch
from helpers import CONF, CPU_KINDS, TINY_RUN, compose, perturbed_unet, sample, train, use_cpu
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from ddpm import precision
from ddpm.config import validate_config
from ddpm.diffusion.denoiser import Denoised
from ddpm.diffusion.gaussian import GaussianDiffusion, eps_and_x0
from ddpm.diffusion.generate import batch_seed, denoiser_for, generate, to_uint8
from ddpm.diffusion.network import StaticBatch, compile_network, network_call, to_channels_last
from ddpm.diffusion.samplers.ddim import DDIMSampler
from ddpm.diffusion.samplers.ddpm import DDPMSampler
from ddpm.diffusion.schedule import alpha_bar_from_betas, linear_betas
from ddpm.precision import fast_bf16
from ddpm.sampling.run import resolve_batch_size
from ddpm.sampling.runtime import default_batch_size, resolve_sampling_precision

BETAS = linear_betas(1000).double()
DIFFUSION = GaussianDiffusion()  # linear schedule (BETAS), T = 1000, eps prediction


def drawing(net, sampler, *, guidance=0.0, num_samples=10, batch_size=4, precision="32", **options):
    """Images as sample.py draws them: the denoiser of denoiser_for (net.num_classes is the null class; options:
    channels_last, compile), labels 0..9 cycled, seed 3."""
    rows = min(batch_size, num_samples)
    d = denoiser_for(net, DIFFUSION, guidance=guidance, precision=precision, rows=rows, **options)
    labels = torch.arange(num_samples) % 10
    return generate(d, sampler, (num_samples, 1, 8, 8), labels=labels, seed=3, batch_size=batch_size).images


class PreviousModel:
    """The float32 path as it was before precision/compile existed (the guided network call of the time, written
    out), for comparison; it finds the timestep of each sigma on its own table."""

    def __init__(self, net, guidance):
        self.net, self.guidance = net, guidance
        self.alpha_bar = alpha_bar_from_betas(BETAS)
        self.sigmas = ((1 - self.alpha_bar) / self.alpha_bar).sqrt()

    def __call__(self, x_t, sigma, y):
        t = (self.sigmas.view(1, -1) - sigma.view(-1, 1)).abs().argmin(1)
        if self.guidance == 0:
            out = self.net(x_t, t, y)
        else:
            both = self.net(torch.cat([x_t, x_t]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, 10)])).float()
            cond, free = both.chunk(2)
            out = (1 + self.guidance) * cond - self.guidance * free
        a = self.alpha_bar[t].float().view(-1, 1, 1, 1)
        eps, x0 = eps_and_x0(out.float(), x_t, a, "eps")
        return Denoised(eps=eps, x0=x0)


def previous_path(net, sampler, *, guidance, num_samples=10, batch_size=4):
    images = []
    labels = torch.arange(num_samples) % 10
    for start in range(0, num_samples, batch_size):
        stop = min(start + batch_size, num_samples)
        generator = torch.Generator().manual_seed(batch_seed(3, start))
        x_T = torch.randn((stop - start, 1, 8, 8), generator=generator)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            previous = PreviousModel(net, guidance)
            x = sampler.sample(previous, x_T, previous.sigmas, labels[start:stop], generator=generator)
        images.append(to_uint8(x))
    return torch.cat(images)


@pytest.mark.parametrize("sampler,guidance", [(DDPMSampler(steps=8), 0.0), (DDIMSampler(steps=5), 2.0)])
def test_precision_32_is_bit_identical_to_the_previous_path(sampler, guidance):
    net = perturbed_unet()
    assert torch.equal(drawing(net, sampler, guidance=guidance, precision="32"),
                       previous_path(net, sampler, guidance=guidance))  # fmt: skip
    assert torch.equal(drawing(net, sampler, guidance=guidance), previous_path(net, sampler, guidance=guidance))


class Probe(nn.Module):
    """A conv network that records, per call, its input dtype and the autocast state it runs under; it takes labels
    0-9 and the null class 10 (and ignores them)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)
        self.calls, self.num_classes = [], 10

    def forward(self, x, t, y):
        self.calls.append((x.dtype, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return 0.1 * self.conv(x)


class Recorded:
    """A denoiser seen through a recorder: the x_t the sampler gives it, the eps/x0 dtypes it gets back."""

    def __init__(self, denoiser):
        self.denoiser, self.seen, self.sigmas = denoiser, [], denoiser.sigmas

    def __call__(self, x, sigma, y):
        d = self.denoiser(x, sigma, y)
        self.seen.append((x.dtype, d.eps.dtype, d.x0.dtype))
        return d


class RecordingSampler(DDIMSampler):
    """DDIM that records every denoiser call's dtypes (the sampler update's inputs) and its output."""

    def sample(self, denoiser, x_T, sigmas, y, *, generator=None):
        self.recorded = Recorded(denoiser)
        self.out = super().sample(self.recorded, x_T, sigmas, y, generator=generator)
        return self.out


@pytest.mark.parametrize("guidance", [0.0, 2.0])
def test_bf16_runs_only_the_network_under_autocast(guidance):
    probe, sampler = Probe(), RecordingSampler(steps=3)
    drawing(probe, sampler, guidance=guidance, num_samples=4, precision="bf16")
    assert probe.calls and all(c == (torch.float32, True, torch.bfloat16) for c in probe.calls)  # x_t float32 in
    assert sampler.recorded.seen and all(
        s == (torch.float32,) * 3 for s in sampler.recorded.seen
    )  # eps, x0 back in float32
    assert sampler.out.dtype == torch.float32
    probe.calls.clear()
    drawing(probe, RecordingSampler(steps=3), guidance=guidance, num_samples=4, precision="32")
    assert all(c[:2] == (torch.float32, False) for c in probe.calls)  # 32: no autocast at all


def test_network_call_casts_the_output_back():
    conv = nn.Conv2d(1, 1, 1)
    call = network_call(lambda x, t, y: conv(x), "bf16")
    out = call(torch.randn(2, 1, 4, 4), torch.zeros(2, dtype=torch.long), None)
    assert out.dtype == torch.float32 and torch.is_autocast_enabled("cpu") is False
    with pytest.raises(ValueError, match="precision"):
        network_call(conv, "fp16")


def differences(a, b):
    d = (a.int() - b.int()).abs().float()
    return d.mean().item(), (d > 0).float().mean().item()


@pytest.mark.parametrize("sampler,guidance", [(DDPMSampler(steps=20), 0.0), (DDIMSampler(steps=10), 2.0)])
def test_bf16_and_compiled_images_are_close_to_float32(sampler, guidance):
    net = perturbed_unet()
    reference = drawing(net, sampler, guidance=guidance)
    mean, fraction = differences(drawing(net, sampler, guidance=guidance, precision="bf16"), reference)
    assert fraction > 0 and mean < 1.0 and fraction < 0.3, (mean, fraction)  # measured 0.15/14%, 0.30/7.7%
    compiled = drawing(compile_network(net, "aot_eager"), sampler, guidance=guidance, compile=True)
    mean, fraction = differences(compiled, reference)
    assert mean < 0.5 and fraction < 0.05, (mean, fraction)  # measured: identical
    torch._dynamo.reset()


@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_channels_last_draws_the_same_images_from_an_nhwc_copy(precision):
    """channels_last: the convolutions run NHWC (their output is channels_last) in a copy of the network; the
    caller's module keeps its layout; the images are within float rounding of the NCHW run's."""
    net = perturbed_unet()
    formats = []
    for conv in (m for m in net.modules() if isinstance(m, nn.Conv2d) and m.out_channels > 1):
        conv.register_forward_hook(lambda m, i, o: formats.append(o.is_contiguous(memory_format=torch.channels_last)))
    reference = drawing(net, DDIMSampler(steps=5), guidance=2.0, precision=precision)
    assert formats and not any(formats)  # NCHW network: NCHW convolutions
    formats.clear()
    nhwc = drawing(net, DDIMSampler(steps=5), guidance=2.0, precision=precision, channels_last=True)
    assert formats and all(formats)  # the copy (its hooks copied with it) ran NHWC convolutions
    assert all(p.is_contiguous() for p in net.parameters())  # the caller's weights keep their layout
    assert nhwc.is_contiguous() and nhwc.dtype == torch.uint8
    mean, fraction = differences(nhwc, reference)
    assert mean < 0.5 and fraction < 0.05, (mean, fraction)  # NHWC kernels add in another order
    with pytest.raises(ValueError, match=r"before torch\.compile"):
        to_channels_last(torch.compile(net))


class CountingBackend:
    """A torch.compile backend that counts the graphs dynamo hands it (each compile or recompile is one) and
    the input shapes of each; runs them eagerly."""

    def __init__(self):
        self.shapes = []

    def __call__(self, gm, example_inputs):
        self.shapes.append(tuple(tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor) and x.dim()))
        return gm.forward


def test_compiled_sampling_compiles_once():
    """Counted: graphs handed to the backend (one per dynamo compile, recompiles included) and dynamo's
    unique_graphs, while drawing with ONE compiled network: 10 images in batches of 4 (4, 4, 2: the last
    padded), DDPM 3 steps then DDPM 5 steps then DDIM 2 steps -> 1 graph; then the same with guidance 2
    ([cond; uncond] = 8 rows, the partial batch's 4 padded to 8) -> 1 more graph (the doubled shape), and
    guidance off/on again -> no more."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    net, backend = perturbed_unet(), CountingBackend()
    compiled = compile_network(net, backend)
    for sampler in (DDPMSampler(steps=3), DDPMSampler(steps=5), DDIMSampler(steps=2)):
        drawing(compiled, sampler, compile=True)
    assert len(backend.shapes) == 1, backend.shapes
    for sampler in (DDPMSampler(steps=3), DDIMSampler(steps=2)):
        drawing(compiled, sampler, guidance=2.0, compile=True)
    assert len(backend.shapes) == 2, backend.shapes
    drawing(compiled, DDIMSampler(steps=2), compile=True)
    drawing(compiled, DDIMSampler(steps=2), guidance=2.0, compile=True)
    assert len(backend.shapes) == 2 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert [s[0][0] for s in backend.shapes] == [4, 8]  # the network's batch: 4 images, 2 x 4 with guidance
    torch._dynamo.reset()


def test_static_batch_pads_and_chunks():
    rows = []
    static = StaticBatch(lambda x, t, y: (rows.append(len(x)), x * 2)[1], rows=4)
    x, t, y = torch.randn(6, 1, 2, 2), torch.arange(6), torch.arange(6)
    assert torch.equal(static(x[:3], t[:3], y[:3]), x[:3] * 2) and torch.equal(static(x, t, None), x * 2)
    assert rows == [4, 4, 4]


@pytest.mark.parametrize(("native", "amx", "bf16"), CPU_KINDS)
def test_auto_sampling_precision_is_bf16_only_where_it_is_faster(monkeypatch, native, amx, bf16):
    """AVX2-only, AVX512-BF16 without AMX (bf16 network calls ran at 0.65x float32 at sample.py's batch there), AMX:
    training's rule (ddpm.precision.fast_bf16, checked against /proc/cpuinfo in test_compile.py); and a bf16 GPU."""
    use_cpu(monkeypatch, native=native, amx=amx)
    assert resolve_sampling_precision("auto", "cpu") == ("bf16" if bf16 else "32")
    monkeypatch.setattr(precision, "native_bf16", lambda device: device == "cuda")
    assert resolve_sampling_precision("auto", "cuda") == "bf16"


def test_precision_and_batch_size_resolution(monkeypatch, tmp_path):
    assert resolve_sampling_precision("auto", "cpu") == ("bf16" if fast_bf16("cpu") else "32")
    assert resolve_sampling_precision(32, "cpu") == "32" and resolve_sampling_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="precision='fp16' must be auto, 32 or bf16"):
        resolve_sampling_precision("fp16", "cpu")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_batch_size("auto", cpu, guided=False) == 64 and resolve_batch_size(None, cpu, guided=True) == 32
    assert default_batch_size(cuda, guided=True) == 256 and resolve_batch_size(100, cpu, guided=True) == 100
    with pytest.raises(ValueError, match=r"batch_size=0 is not"):  # checked once, by the config's schema
        validate_config(compose("sample", ["ckpt=x", "batch_size=0", f"output_dir={tmp_path}"]), entry="sample")


def test_config_keys(tmp_path):
    cfg = compose("sample", ["ckpt=x", f"output_dir={tmp_path}"])
    assert (cfg.batch_size, cfg.precision, cfg.compile, cfg.channels_last) == ("auto", "auto", False, True)
    grid = instantiate(compose("train", [f"paths.output_dir={tmp_path}"]).callbacks.sample_grid)
    assert grid.precision == "auto"
    for name in ("inception", "classifier"):
        assert OmegaConf.load(CONF / "callbacks" / "fid" / f"{name}.yaml").precision == "auto"
    with pytest.raises(ValueError, match=r"callbacks\.sample_grid\.precision='fp16' is not"):  # the schema's check
        validate_config(compose("train", [f"paths.output_dir={tmp_path}", "callbacks.sample_grid.precision=fp16"]),
                        entry="train")  # fmt: skip


@pytest.mark.slow
def test_sample_py_bf16_compiled_guided(tmp_path):
    """sample.py precision=bf16 compile=true (inductor) on a tiny conditional run: 5 images in batches of 4."""
    run = tmp_path / "run"
    train(*TINY_RUN, "model.num_classes=10", "diffusion.p_uncond=0.1", f"hydra.run.dir={run}")
    out = tmp_path / "samples"
    result = sample(f"ckpt={run}/ema.pt", "precision=bf16", "compile=true", "num_samples=5", "batch_size=4",
                    "sampler=ddim", "sampler.steps=4", "guidance=2", "device=cpu", f"output_dir={out}",
                    timeout=900)  # fmt: skip
    assert "precision bf16, channels_last, compiled" in result.stdout
    images = np.load(out / "samples.npz")["images"]
    assert images.shape[0] == 5 and images.dtype == np.uint8
