"""Numeric precision settings the Trainer's `precision` flag does not cover: TF32 matmuls, fp16 advice.

Plain torch: `configure_precision(trainer.precision)` runs once before the Trainer is built.
"""

import warnings

import torch

FP16_WARNING = (
    "trainer.precision={precision}: float16 autocast runs GroupNorm's statistics and the attention softmax near "
    "fp16's narrow range, which can overflow to inf/NaN in diffusion UNets; prefer trainer.precision=bf16-mixed "
    "on GPUs that support it (Ampere or newer: A100, H100, RTX 30xx+)"
)


def tf32_capable() -> bool:
    """True on CUDA devices of compute capability >= 8.0 (Ampere and newer), which have TF32 tensor cores."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


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
