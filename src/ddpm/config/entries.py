"""The entry points' own keys, declared once: `TrainKeys` (conf/train.yaml) and `SampleKeys` (conf/sample.yaml).

Each is the typed view its entry point reads (`TrainKeys.of(resolved)` in ddpm.training, `SampleKeys.of(...)` in
ddpm.sampling.run), and the schema the validator checks a config's top-level keys against (ddpm.config.schema):
the same mechanism as a `_target_` node, whose schema is its constructor's signature. The groups (model, data, ...)
are `_target_` nodes, validated from their own constructors. Values, defaults and their comments are the yaml's.

Why pydantic (over Hydra structured configs): the `_target_` nodes are validated from signatures with pydantic, so
the whole tree has one mechanism; OmegaConf's structured configs cannot express `int | Literal["auto"]`,
`bool | <compile mode>` or a whole number written as a float (`num_samples=2e1`), and refuse unknown keys without
naming the closest known one.
"""

from dataclasses import dataclass, fields
from typing import Any, Literal

from pydantic import PositiveInt
from typing_extensions import TypedDict

from ddpm.diffusion.network import SamplingPrecision
from ddpm.precision import CompileMode

Node = dict[str, Any] | None  # a `_target_` node (validated on its own) or null


class Paths(TypedDict, total=False):
    output_dir: str  # the run directory


class Tune(TypedDict, total=False):
    lr_find: Node  # ddpm.tuning.LRRangeTest
    apply: bool  # train with the suggested LR


Metrics = TypedDict(  # `is` is a Python keyword: the functional form
    "Metrics",
    {"fid": bool, "kid": bool, "is": bool, "features": str, "cache_dir": str, "data_root": str | None,
     "batch_size": PositiveInt},
    total=False,
)  # fmt: skip


class Keys:
    """`of(resolved)`: the entry point's own keys of a resolved config."""

    @classmethod
    def of(cls, resolved: dict[str, Any]):
        return cls(**{f.name: resolved.get(f.name) for f in fields(cls) if f.name in resolved})  # type: ignore[call-arg]


@dataclass(frozen=True, kw_only=True)
class TrainKeys(Keys):
    seed: int | None = None
    compile: bool | CompileMode = False  # after `auto` is decided for the device
    ckpt_path: str | None = None
    objective: str = "val/loss"
    resume_dir: str | None = None
    slurm_requeue: bool = True
    overwrite: bool = False
    init_from: str | None = None
    dist_timeout_s: float = 600.0
    paths: Paths | None = None
    tune: Tune | None = None
    callbacks: dict[str, Node] | None = None  # free-form names
    logger: dict[str, Node] | None = None  # free-form names
    model: Node = None
    diffusion: Node = None
    data: Node = None
    optim: Node = None
    trainer: Node = None
    module: Node = None
    ema: Node = None
    hydra: Any = None  # Hydra checks its own
    latent: dict[str, Any] | None = None  # written by train() for a run on latents (ddpm.data.latents), not set


@dataclass(frozen=True, kw_only=True)
class SampleKeys(Keys):
    ckpt: str | None = None
    num_samples: PositiveInt = 64
    batch_size: PositiveInt | Literal["auto"] | None = "auto"
    labels: int | list[int] | None = None
    guidance: float = 0.0
    guidance_interval: tuple[float, float] | None = None
    seed: int = 0
    precision: SamplingPrecision = "auto"
    channels_last: bool = True
    compile: bool = False
    device: str = "auto"
    output_dir: str = "."
    overwrite: bool = False
    vae: str | None = None  # a latent model's VAE folder; None: the one its run recorded
    sampler: Node = None
    metrics: Metrics | None = None
    hydra: Any = None


ENTRIES: dict[str, type[Keys]] = {"train": TrainKeys, "sample": SampleKeys}
