"""Device-dependent speed settings the Trainer's flags do not cover: `auto` precision and compile, TF32, advice.

Plain torch: `resolve_precision(trainer.precision, trainer.accelerator)` turns `auto` into a Lightning value and
`resolve_compile(compile, trainer.accelerator)` into a bool; then `configure_precision(...)` runs once before
the Trainer is built.
"""

import warnings
from typing import Literal, get_args

import torch

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]  # torch.compile's
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # inductor wraps the compiled graphs in CUDA graphs (CUDA only)

FP16_WARNING = (
    "trainer.precision={precision}: float16 autocast runs GroupNorm's statistics and the attention softmax near "
    "fp16's narrow range, which can overflow to inf/NaN in diffusion UNets; prefer trainer.precision=bf16-mixed "
    "on GPUs that support it (Ampere or newer: A100, H100, RTX 30xx+)"
)
SLOW_BF16_WARNING = (
    "trainer.precision={precision} on a {device} without native bfloat16 ({detail}): every bf16 convolution "
    "falls back to a reference kernel (unet_mnist: 28x slower than float32 on an AVX2-only CPU); "
    "use trainer.precision=auto (bf16 only where it is fast) or trainer.precision=32-true"
)


TRUE_HALF = {"bf16-true", "16-true"}
TRUE_HALF_ERROR = (
    "trainer.precision={precision} casts the whole module to {dtype}, the diffusion schedule's buffers included: "
    "alpha_bar rounds to exactly 1 for the first timesteps (t < 10 with the linear schedule in bf16), so those "
    "steps train on images without noise, and the weights lose the small Adam updates. Use "
    "trainer.precision={mixed} ({dtype} compute, float32 weights and schedule) or 32-true"
)


def tf32_capable() -> bool:
    """True on CUDA devices of compute capability >= 8.0 (Ampere and newer), which have TF32 tensor cores."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def run_device(accelerator: str | None) -> str:
    """The device type Lightning will train on: 'cuda', 'mps' or 'cpu' (accelerator auto: a GPU when there is one,
    as Lightning chooses)."""
    name = str(accelerator or "auto").lower()
    if name in {"gpu", "cuda"} or (name == "auto" and torch.cuda.is_available()):
        return "cuda"
    if name == "auto" and torch.backends.mps.is_available():  # Apple Silicon
        return "mps"
    return "cpu" if name in {"auto", "cpu"} else name


def native_bf16(device: str) -> bool:
    """Whether `device` computes bf16 at full speed: CUDA with bf16 support (Ampere+), or a CPU that oneDNN
    runs bf16 on natively (AVX512-BF16 / AMX; AVX512 core at least). False on AVX2-only CPUs."""
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)  # no driver: False
    if device == "cpu":  # builds without oneDNN (some ARM ones) register no mkldnn ops: no native bf16
        supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return torch.backends.mkldnn.is_available() and supported is not None and bool(supported())
    return False


def cpu_amx() -> bool:
    """Whether this CPU has AMX tiles (Xeon Sapphire Rapids and newer), the matrix units oneDNN's bf16
    convolutions run on; AVX512-BF16 alone only has bf16 dot-product instructions."""
    return bool(torch.cpu._is_amx_tile_supported())


def fast_bf16(device: str) -> bool:
    """Where bf16 was measured faster than float32, so `auto` picks it for training and sampling: CUDA with
    native bf16, and CPUs with AMX. unet_mnist, one core: on an AMX Xeon bf16 trained at 1.8x float32 (bf16 +
    compile 2.5x; git show 9d82a62~1:benchmarks/results/throughput_unet_mnist_recipe_cpu.json) and sampled at
    2.2x; on an AVX512-BF16 Xeon without AMX it trained at 0.70-0.75x (throughput_unet_mnist_recipe_cpu.json)
    and sampled at 0.65-0.7x of float32 at the same batch (sampling_mnist_ema_cpu.json)."""
    if device == "cpu":
        return native_bf16("cpu") and cpu_amx()
    return native_bf16(device)


def resolve_precision(precision: str | int | None, accelerator: str | None = "auto") -> str:
    """Lightning's precision for `trainer.precision`: `auto` becomes bf16-mixed where bf16 trains faster than
    float32 (fast_bf16: CUDA with bf16, AMX CPUs) and 32-true elsewhere; any other value passes
    through (warning where bf16 falls back to reference kernels)."""
    name = str(precision)
    device = run_device(accelerator)
    if name in TRUE_HALF:
        dtype, mixed = ("bfloat16", "bf16-mixed") if name.startswith("bf16") else ("float16", "16-mixed")
        raise ValueError(TRUE_HALF_ERROR.format(precision=name, dtype=dtype, mixed=mixed))
    if name in ("64", "64-true", "double"):  # the schedule, samplers and EMA are float32: failed in the sanity check
        raise ValueError(f"trainer.precision={name}: float64 training is not supported; use 32-true, or "
                         "bf16-mixed / auto for speed")  # fmt: skip
    if name == "auto":
        return "bf16-mixed" if fast_bf16(device) else "32-true"
    present = device == "cpu" or torch.cuda.is_available()  # no GPU at all: Lightning's own error says so later
    if name.startswith("bf16") and present and not native_bf16(device):
        detail = torch.backends.cpu.get_cpu_capability() if device == "cpu" else torch.cuda.get_device_name()
        warnings.warn(SLOW_BF16_WARNING.format(precision=name, device=device, detail=detail), UserWarning, stacklevel=2)
    return name


def check_fp16_device(precision: str | int | None, accelerator: str | None = "auto") -> None:
    """A run of 16-mixed on a CPU: Lightning trains bf16-mixed instead (under our float16 warning, config.yaml
    saying 16-mixed). train.py's check; `python -m ddpm.memory` sizes a GPU's 16-mixed run on a CPU."""
    if str(precision) in ("16", "16-mixed") and run_device(accelerator) == "cpu":
        raise ValueError(f"trainer.precision={precision} on a CPU: Lightning trains bf16-mixed instead of float16 "
                         "there; use auto, bf16-mixed (fast on AMX CPUs) or 32-true")  # fmt: skip


def compile_mode(compile: bool | str | None) -> CompileMode | None:
    """A resolved `compile` value as torch.compile's mode: None for false, "default" for true, a mode as given."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return "default"
    if compile not in get_args(CompileMode):
        raise ValueError(f"compile={compile!r} must be true, false, auto or one of {list(get_args(CompileMode))}")
    return compile  # type: ignore[return-value]


def uses_cudagraphs(mode: str | None) -> bool:
    """Whether inductor runs the graphs of `mode` as CUDA graphs (on CUDA inputs; never on the CPU)."""
    return mode in CUDAGRAPH_MODES


def resolve_compile(compile: bool | str, accelerator: str | None = "auto") -> bool | str:
    """`compile: auto` -> the mode measured to pay off for training on this device, or False. CUDA: "default"
    (inductor's fused kernels; the CUDA-graph modes wait for the GPU rows of docs/benchmarks.md). CPUs where `auto`
    trains in bf16 (AMX): "default" (bf16 + compile 1.37x bf16 eager per step on unet_mnist, a cold compile of about
    2.5 min paid back after ~600 steps). False on other CPUs: 1.00x on an AVX512-BF16 Xeon without AMX
    (benchmarks/results/throughput_unet_mnist_compile_cpu.json), 0.87x on an AVX2-only EPYC. true/false and a mode
    pass through (checked)."""
    if isinstance(compile, bool):
        return compile
    if str(compile).lower() != "auto":
        compile_mode(compile)  # refused here, naming the modes, if unknown
        return compile
    device = run_device(accelerator)
    return "default" if device == "cuda" or (device == "cpu" and fast_bf16("cpu")) else False


def compile_note(decided: bool | str, accelerator: str | None = "auto") -> str:
    """The log line of `compile=auto`: what it chose on this device, and why."""
    device = run_device(accelerator)
    if decided is False:
        return (f"compile=auto: off on this {device} (measured not to pay off: 1.00x on AVX512-BF16 without AMX, "
                "0.87x on AVX2; compile=true to force it)")  # fmt: skip
    if device == "cuda":
        return f"compile=auto: mode {decided} on CUDA; compile=reduce-overhead adds CUDA graphs"
    return f"compile=auto: mode {decided} on a CPU with AMX (bf16 + compile 1.37x bf16 eager)"


def precision_note(decided: str, accelerator: str | None = "auto") -> str:
    """The log line of `trainer.precision=auto`: what it chose on this device."""
    return (f"trainer.precision=auto: {decided} on this {run_device(accelerator)} (bf16-mixed where measured faster "
            "than float32: CUDA with bf16, CPUs with AMX)")  # fmt: skip


def configure_precision(precision: str | int | None, *, tf32: bool = True) -> list[str]:
    """Warn about fp16 mixed precision; turn TF32 matmuls/convolutions on for float32 where the GPU has them.

    Returns the actions taken (for logs and tests), e.g. ["tf32"] or ["fp16-warning"].
    """
    actions = []
    name = str(precision)
    if name in {"16", "16-mixed", "16-true"}:
        warnings.warn(FP16_WARNING.format(precision=name), UserWarning, stacklevel=2)
        actions.append("fp16-warning")
    if tf32 and name in {"32", "32-true", "None"} and tf32_capable():
        torch.set_float32_matmul_precision("high")  # TF32 matmuls (10-bit mantissa inputs, fp32 accumulate)
        torch.backends.cudnn.allow_tf32 = True  # TF32 convolutions
        actions.append("tf32")
    return actions
