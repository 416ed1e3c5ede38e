"""GPU readiness, proven on the CPU: what a GPU step needs that a CPU can check.

- The compiled training step of each preset, through our Trainer (`train()`, as `python train.py` runs it), is one
  graph with no graph break, compiled once: no recompile across an epoch boundary, the dropped last batch,
  validation, checkpoint saves, sample grids and the EMA update, and a resume (in a fresh dynamo cache, as a new
  process has) compiles the same single graph. Dynamo's own counters count them; `error_on_recompile` turns any
  recompile into an error that names its guard.
- A training step that does not log makes no host-device synchronisation: `HostSyncs` counts every operation that
  makes the host wait for the device (`.item()`, `bool(tensor)`, `.tolist()`, `.cpu()`, `.numpy()`, and the ops
  whose output shape depends on the data: `nonzero`, `masked_select`, `unique`, ...), in the whole step: data
  transfer, forward, backward, clipping, the NaN guard, the optimizer, the EMA update and every callback. On the
  CPU every tensor is a host tensor, so the DataLoader's own host-side reads (its seed, the sampler's order) are
  left out by where they run (`HOST_SIDE`): on a GPU they never touch the device.
- The kernels a fast GPU step is built of: fused AdamW, one multi-tensor op for the EMA update, attention through
  `scaled_dot_product_attention`, channels_last kept through GroupNorm, attention and the skip concatenations.

Each detector is shown to catch its fault once (a sync, a graph break, a recompile added on purpose).
"""

import collections
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import compose, tiny_unet
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from ddpm import training
from ddpm.callbacks.ema import EMA
from ddpm.models.unet import UNet

# aten ops that read a device value on the host, or whose output shape depends on the data
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim",
            "unique_consecutive", "repeat_interleave", "is_nonzero"}  # fmt: skip
HOST_READS = ("tolist", "numpy", "cpu")  # Tensor methods that copy to the host without going through an aten op
# Host-side code whose tensors never live on the device: the DataLoader and its sampler, before the batch is moved
HOST_SIDE = ("torch/utils/data/", "ddpm/data/sampler.py")


class HostSyncs(TorchDispatchMode):
    """Counts host-device synchronisations by kind while active; `where` keeps the first stack of each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()
        self.where: dict[str, str] = {}

    def record(self, kind: str) -> None:
        stack = traceback.extract_stack()
        if any(side in frame.filename for frame in stack for side in HOST_SIDE):
            return  # a CPU tensor of the data loader: no device involved
        self.seen[kind] += 1
        self.where.setdefault(kind, "".join(traceback.format_list(stack[-14:-2])))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS or (name in ("index", "index_put", "index_put_") and boolean_index(args)):
            self.record(name)
        return func(*args, **(kwargs or {}))

    @contextmanager
    def active(self) -> Iterator["HostSyncs"]:
        originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

        def counting(name: str):
            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.record(f"Tensor.{name}")
                return originals[name](tensor, *args, **kwargs)

            return read

        for name in HOST_READS:
            setattr(torch.Tensor, name, counting(name))
        try:
            with self:
                yield self
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)


def boolean_index(args: tuple[Any, ...]) -> bool:
    """Whether an index op's indices hold a boolean mask (`x[mask]`: its shape depends on the data)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


Step = tuple[int, bool, HostSyncs]  # (global step after it, whether Lightning logged it, its syncs)


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    """Every training batch of the fits in the test, with its host syncs (the whole of Lightning's `advance`: fetch,
    transfer, step, callbacks' batch-end hooks)."""
    recorded: list[Step] = []
    original = _TrainingEpochLoop.advance

    def advance(self: _TrainingEpochLoop, data_fetcher: Any) -> None:
        logged = bool(self.trainer._logger_connector.should_update_logs)
        with HostSyncs().active() as syncs:
            original(self, data_fetcher)
        recorded.append((self.trainer.global_step, logged, syncs))

    monkeypatch.setattr(_TrainingEpochLoop, "advance", advance)
    return recorded


EVERY = 7  # validation, checkpoint and sample-grid steps: these may sync (they write files and read metrics)


def fit(tmp_path: Path, *overrides: str) -> float | None:
    """train() on the real config (digits, the default experiment) with `overrides`, in this process."""
    cfg = compose("train", [
        "data.limit=200", "data.batch_size=16", "trainer.max_steps=15", "trainer.log_every_n_steps=5",
        f"trainer.val_check_interval={EVERY}", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0",
        f"callbacks.checkpoint.every_n_train_steps={EVERY}", f"callbacks.sample_grid.every_n_steps={EVERY}",
        "callbacks.sample_grid.num_samples=4", "callbacks.sample_grid.sampler.steps=2", "logger=[csv]",
        "optim.warmup_steps=3", f"paths.output_dir={tmp_path}", *overrides,
    ])  # fmt: skip
    return training.train(cfg)


def quiet_steps(steps: list[Step]) -> list[Step]:
    """The steps that must not sync: not the first (it checks its batch once), not logged, no file written."""
    quiet = [s for s in steps[1:] if not s[1] and s[0] % EVERY != 0]
    assert len(quiet) >= 6, f"too few quiet steps to prove anything: {[(s[0], s[1]) for s in steps]}"
    return quiet


def describe(steps: list[Step]) -> str:
    rows = [f"step {step}: {dict(syncs.seen)}" for step, _, syncs in steps if syncs.seen]
    first = next((syncs for _, _, syncs in steps if syncs.seen), None)
    return "\n".join(rows) + ("\nfirst at:\n" + next(iter(first.where.values())) if first else "")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "diffusion"), [("32-true", "linear"), ("bf16-mixed", "edm"), ("32-true", "cosine")]
)
def test_a_step_that_does_not_log_makes_no_host_sync(tmp_path: Path, steps: list[Step], precision: str,
                                                      diffusion: str) -> None:  # fmt: skip
    """The whole product's step: conditional model (labels checked, dropped to the null class), gradient clipping,
    the NaN guard, fused AdamW, the EMA update, the monitor and the progress bar; bf16 autocast, EDM's loss."""
    fit(tmp_path, f"trainer.precision={precision}", f"diffusion={diffusion}", "model.num_classes=10",
        "callbacks.progress_bar.only_on_terminal=false")  # fmt: skip
    quiet = quiet_steps(steps)
    assert all(not syncs.seen for _, _, syncs in quiet), describe(quiet)
    logged = [s for s in steps[1:] if s[1]]
    assert logged and all(syncs.seen for _, _, syncs in logged), "the logged steps should read their metrics"


def add_item(method):  # a sync added on purpose: the detector must see it
    def patched(*args: Any, **kwargs: Any) -> Any:
        torch.ones(1).sum().item()
        return method(*args, **kwargs)

    return patched


@pytest.mark.slow
def test_host_syncs_catches_a_sync_added_to_the_ema_update(tmp_path: Path, steps: list[Step],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(EMA, "update", add_item(EMA.update))
    fit(tmp_path)
    quiet = quiet_steps(steps)
    assert all(syncs.seen["_local_scalar_dense"] == 1 for _, _, syncs in quiet), describe(quiet)
    assert "ema.py" in "".join(s.where["_local_scalar_dense"] for _, _, s in quiet[:1])


def test_host_syncs_counts_each_kind_of_sync() -> None:
    x = torch.tensor([0.0, 1.0, 2.0])
    with HostSyncs().active() as syncs:
        x.sum().item(), bool(x.any()), x.tolist(), x.cpu(), x.numpy(), x.nonzero(), x[x > 0], float(x[1])
        (x * 2 + 1).exp_()  # no sync
    assert syncs.seen["_local_scalar_dense"] >= 3
    assert syncs.seen["nonzero"] >= 1 and syncs.seen["index"] >= 1  # x.nonzero(), x[x > 0]
    assert {f"Tensor.{name}" for name in HOST_READS} <= set(syncs.seen)


# --- compile: one graph, no break, no recompile --------------------------------------------------------------------

PRESETS = {  # preset -> overrides: each model of conf/model on its experiment's diffusion, digits at its size
    "unet_tiny": ["experiment=digits"],
    "unet_mnist": ["experiment=mnist", "data=digits"],  # EDM, FiLM, class-conditional
    "seed_mnist": ["experiment=mnist", "model=seed_mnist", "data=digits"],
    "ddpm_cifar10": ["experiment=cifar10", "data=digits", "trainer=default"],
    "unet64": ["experiment=imagenet64", "data=digits", "trainer=default", "trainer.precision=32-true"],
}
SHORT = [  # two epochs of two batches (5 training images, the last dropped), validation, checkpoints, a grid
    "data.limit=6", "data.val_size=1", "data.batch_size=2", "trainer.accelerator=cpu", "trainer.precision=32-true",
    "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0",
    "trainer.log_every_n_steps=2", "callbacks.checkpoint.every_n_train_steps=2",
    "callbacks.sample_grid.every_n_steps=3", "callbacks.sample_grid.num_samples=2",
    "callbacks.sample_grid.sampler.steps=1", "logger=[csv]", "compile=true",
]  # fmt: skip


def compiled_fit(out: Path, preset: str, backend: str, *overrides: str) -> dict[str, Any]:
    """train() compiled, in a fresh dynamo cache (a new process's); any recompile raises. Dynamo's counts after."""
    torch._dynamo.reset()
    counters.clear()
    cfg = compose("train", [*PRESETS[preset], *SHORT, f"module.compile_backend={backend}", f"paths.output_dir={out}",
                            *overrides])  # fmt: skip
    with torch._dynamo.config.patch(error_on_recompile=True):
        training.train(cfg)
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": dict(counters["graph_break"]),
            "frames": dict(counters["frames"])}  # fmt: skip


ONE_GRAPH = {"graphs": 1, "breaks": {}, "frames": {"total": 1, "ok": 1}}


HALF = ["model.base_channels=32", "callbacks.checkpoint=null"]  # the big presets at a quarter of their FLOPs: the
# same layers, levels, attention and heads (what dynamo traces); no checkpoints of 0.3-1 GB (the small ones save)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "backend", "smaller"),
    # aot_eager also traces the backward (AOT autograd); eager is dynamo alone, which decides breaks and recompiles
    [("unet_tiny", "aot_eager", []), ("unet_mnist", "aot_eager", []), ("seed_mnist", "eager", []),
     ("ddpm_cifar10", "eager", HALF), ("unet64", "eager", HALF)],
)  # fmt: skip
def test_the_compiled_step_is_one_graph_compiled_once_and_again_after_a_resume(
    tmp_path: Path, preset: str, backend: str, smaller: list[str]
) -> None:
    first = compiled_fit(tmp_path / "run", preset, backend, "trainer.max_steps=4", *smaller)
    assert first == ONE_GRAPH
    if smaller:
        return  # the resume path is the same for every model: the small presets prove it
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000002.ckpt"
    resumed = compiled_fit(tmp_path / "resumed", preset, backend, "trainer.max_steps=4", f"ckpt_path={checkpoint}")
    assert resumed == ONE_GRAPH


def graph_break_in(forward):
    def patched(self: UNet, *args: Any, **kwargs: Any) -> torch.Tensor:
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    return patched


@pytest.mark.slow
def test_the_compile_counts_catch_a_graph_break_and_a_recompile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph break added to the UNet shows in the counts; a value that changes every step, read inside the
    compiled loss (here the global step), makes dynamo recompile, which `error_on_recompile` turns into an error."""
    with monkeypatch.context() as patch:
        patch.setattr(UNet, "forward", graph_break_in(UNet.forward))
        broken = compiled_fit(tmp_path / "break", "unet_tiny", "eager", "trainer.max_steps=2")
    assert broken["breaks"] and broken["graphs"] > 1

    from ddpm.module import DiffusionModule

    original = DiffusionModule._loss

    def loss_reading_the_step(self: DiffusionModule, *args: Any) -> torch.Tensor:
        return original(self, *args) * (1 + 0 * self.global_step)  # a Python int: a guard on its value

    monkeypatch.setattr(DiffusionModule, "_loss", loss_reading_the_step)
    with pytest.raises(torch._dynamo.exc.RecompileError, match="global_step"):
        compiled_fit(tmp_path / "recompile", "unet_tiny", "eager", "trainer.max_steps=3")


# --- the kernels of a fast step --------------------------------------------------------------------------------------


def test_adamw_is_fused_on_every_device() -> None:
    """ddpm.optim.AdamW builds torch's fused AdamW (one multi-tensor kernel per step, and the `found_inf` skip the NaN
    guard hands it), on the CPU as on CUDA; its update equals the single-tensor reference's."""
    from ddpm.optim import AdamW

    nets = [tiny_unet() for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    optimizer, _ = AdamW(lr=1e-2, warmup_steps=0).build(list(nets[0].parameters()), global_batch_size=64)
    reference = torch.optim.AdamW(nets[1].parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    assert optimizer.param_groups[0]["fused"] is True
    for step in range(3):
        for net, opt in zip(nets, (optimizer, reference), strict=True):
            for p in net.parameters():
                p.grad = torch.full_like(p, 0.1 * (step + 1))
            opt.step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b)


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_ema_update_is_one_multi_tensor_op() -> None:
    net = tiny_unet()
    ema = EMA(decay=0.9)
    ema.shadow = {k: v.detach().clone() for k, v in net.state_dict().items()}
    with OpNames() as ops:
        ema.update(net)
    assert ops.names == ["_foreach_lerp_"], ops.names


def test_attention_goes_through_scaled_dot_product_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(a[0].shape) or sdpa(*a, **k))
    net = tiny_unet()  # attention at 4x4 and in the middle
    attention_layers = sum(type(m).__name__ == "Attention" for m in net.modules())
    for layout in (torch.contiguous_format, torch.channels_last):
        calls.clear()
        net = net.to(memory_format=layout)
        net(torch.randn(2, 1, 8, 8).contiguous(memory_format=layout), torch.tensor([1, 2]))
        assert len(calls) == attention_layers >= 2  # every attention layer, in both layouts


@pytest.mark.parametrize("in_channels", [1, 3])
def test_channels_last_survives_groupnorm_attention_and_the_skip_concatenations(in_channels: int) -> None:
    """Every GroupNorm and convolution of the UNet takes and gives NHWC tensors when the network and its input are
    channels_last (the first up block's GroupNorm takes the concatenation of h and a skip); the outputs equal the
    NCHW network's."""
    torch.manual_seed(0)
    net = tiny_unet(num_classes=10, in_channels=in_channels)
    for p in net.parameters():  # off the zero init, so the outputs depend on every layer
        torch.nn.init.normal_(p, std=0.1)
    x, t, y = torch.randn(2, in_channels, 8, 8), torch.tensor([1, 50]), torch.tensor([3, 7])
    expected = net(x, t, y)
    net = net.to(memory_format=torch.channels_last)
    nchw: list[str] = []

    def check(name: str):
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            for role, tensor in (("input", inputs[0]), ("output", output)):
                if tensor.shape[1] > 1 and not tensor.is_contiguous(memory_format=torch.channels_last):
                    nchw.append(f"{name} {role}")

        return hook

    layers = [(n, m) for n, m in net.named_modules() if isinstance(m, torch.nn.Conv2d | torch.nn.GroupNorm)]
    for name, module in layers:
        module.register_forward_hook(check(name))
    out = net(x.contiguous(memory_format=torch.channels_last), t, y)
    assert not nchw, nchw
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
