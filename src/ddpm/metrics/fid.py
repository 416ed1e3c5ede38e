"""FID, KID and IS of generated images against cached reference statistics of the training set.

The statistics are computed by torchmetrics (FrechetInceptionDistance, KernelInceptionDistance,
InceptionScore), fed with features we extract once (`ddpm.metrics.features`), so the same features
serve every metric and every DDP rank can extract its own shard. The reference side (the whole
training split of the run's data source, at the model's resolution) is computed once and cached
in a file keyed by dataset, split, resolution, channels and feature extractor.

Metric names carry the number of generated samples: `fid@10k`, `kid@500`, `is@50k` (and `cfid@N`,
`ckid@N` when the features come from a classifier rather than Inception, so the two never mix).
"""

import dataclasses
import hashlib
import itertools
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ddpm.atomic import atomic_save
from ddpm.data.sources import Source
from ddpm.logs import say
from ddpm.metrics.features import FeatureExtractor, brief

Metric = Literal["fid", "kid", "is"]
METRICS: tuple[str, ...] = ("fid", "kid", "is")
KID_REFERENCE_SIZE = 10_000  # reference features kept for KID (a seeded random subset of the split)
CACHE_FORMAT = 1
IS_SPLITS = 10  # the Inception Score's splits (Salimans et al. 2016): at least as many images
DEFAULT_CACHE_DIR = "~/.cache/lightning-ddpm/reference"


@dataclass(frozen=True)
class FeatureStats:
    """Sufficient statistics of a feature set, in torchmetrics' FID state layout (float64)."""

    num: int
    features_sum: Tensor  # (D,)
    cov_sum: Tensor  # (D, D): sum of f f^T
    kid_features: Tensor  # (M, D) float64, a seeded subset of at most KID_REFERENCE_SIZE rows

    @classmethod
    def of(cls, features: Tensor, *, kid_size: int = KID_REFERENCE_SIZE, seed: int = 0) -> "FeatureStats":
        f = features.double()
        keep = kid_rows(len(f), kid_size=kid_size, seed=seed)
        return cls(num=len(f), features_sum=f.sum(0), cov_sum=f.T @ f, kid_features=f[keep].clone())


def kid_rows(n: int, *, kid_size: int, seed: int = 0) -> Tensor:
    """The rows of n reference features KID keeps: a seeded random subset of at most kid_size, in order."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:kid_size].sort().values


def count_tag(n: int) -> str:
    """10000 -> '10k', 50000 -> '50k', 500 -> '500', 1500 -> '1500'."""
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def quiet(metric_class: type, **kwargs: Any) -> Any:
    """Build a torchmetrics metric without its warning that it keeps every feature (we pass features)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*will save all extracted features.*")
        return metric_class(sync_on_compute=False, **kwargs)


class PassThrough(nn.Module):
    """Hands precomputed features to a torchmetrics metric as its `feature=` network."""

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.num_features = num_features

    def forward(self, features: Tensor) -> Tensor:
        return features


def frechet_distance(reference: FeatureStats, fake: Tensor) -> float:
    """FID = |mu_r - mu_f|^2 + tr(S_r + S_f - 2 (S_r S_f)^(1/2)) (Heusel et al. 2017), by torchmetrics."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    metric = quiet(FrechetInceptionDistance, feature=PassThrough(fake.shape[1]))
    metric.real_features_sum = reference.features_sum.double().clone()
    metric.real_features_cov_sum = reference.cov_sum.double().clone()
    metric.real_features_num_samples = torch.tensor(reference.num, dtype=torch.long)
    metric.update(fake.double(), real=False)
    return float(metric.compute())


def kernel_distance(
    reference: FeatureStats, fake: Tensor, *, subsets: int = 100, subset_size: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """KID (Binkowski et al. 2018): unbiased MMD^2, cubic polynomial kernel, mean and std over subsets."""
    from torchmetrics.image.kid import KernelInceptionDistance

    size = min(subset_size, len(fake), len(reference.kid_features))
    metric = quiet(KernelInceptionDistance, feature=PassThrough(fake.shape[1]), subsets=subsets, subset_size=size)
    metric.update(reference.kid_features.double(), real=True)
    metric.update(fake.double(), real=False)
    with torch.random.fork_rng(devices=[]):  # the subsets come from torch's global RNG: seed it, locally
        torch.manual_seed(seed)
        mean, std = metric.compute()
    return float(mean), float(std)


def inception_score(logits: Tensor, *, splits: int = IS_SPLITS, seed: int = 0) -> tuple[float, float]:
    """IS (Salimans et al. 2016): exp E_x KL(p(y|x) || p(y)), mean and std over `splits` splits of the shuffled set,
    split i holding rows [i N / splits, (i + 1) N / splits) (improved-gan's bounds; torchmetrics' `chunk` made 91
    images 9 splits of 10 and one of 1, whose score is exactly 1). Equal to torchmetrics' where splits divides N."""
    if len(logits) < splits:
        raise ValueError(f"is: {len(logits)} images cannot make {splits} splits; draw at least {splits}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        order = torch.randperm(len(logits))  # torchmetrics' shuffle, drawn the same way
    logits = logits.double()[order]
    prob, log_prob = logits.softmax(dim=1), logits.log_softmax(dim=1)
    bounds = [i * len(logits) // splits for i in range(splits + 1)]
    scores = []
    for lo, hi in itertools.pairwise(bounds):
        marginal = prob[lo:hi].mean(dim=0, keepdim=True)  # p(y) of the split
        scores.append((prob[lo:hi] * (log_prob[lo:hi] - marginal.log())).sum(dim=1).mean().exp())
    score = torch.stack(scores)
    return float(score.mean()), float(score.std())


def compute_metrics(
    names: list[str] | tuple[str, ...],
    *,
    features: Tensor,
    logits: Tensor | None,
    reference: FeatureStats,
    kind: str = "inception",
    labels: Tensor | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """The requested metrics of generated images' features (N, D) (and logits (N, K)), named `<metric>@N`."""
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise ValueError(f"metrics={list(names)}: unknown {unknown}; choose from {list(METRICS)}")
    tag, prefix = count_tag(len(features)), "" if kind == "inception" else "c"
    out: dict[str, float] = {}
    if "fid" in names:
        out[f"{prefix}fid@{tag}"] = frechet_distance(reference, features)
    if "kid" in names:
        out[f"{prefix}kid@{tag}"], out[f"{prefix}kid_std@{tag}"] = kernel_distance(reference, features, seed=seed)
    if logits is not None and "is" in names:
        out[f"{prefix}is@{tag}"], out[f"{prefix}is_std@{tag}"] = inception_score(logits, seed=seed)
    elif "is" in names:
        raise ValueError("metrics: is needs class logits; this feature extractor has no `logits` method")
    if logits is not None and labels is not None and kind != "inception":
        out[f"accuracy@{tag}"] = float((logits.argmax(1).cpu() == labels.cpu()).double().mean())
    return out


# --- the reference statistics cache ---------------------------------------------------------------


def _key_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """A source's fields as the cache key holds them, nested sources too: `root` resolved, `download` left out."""
    out = {k: _key_fields(v) if isinstance(v, dict) else v for k, v in fields.items() if k != "download"}
    if out.get("root"):
        out["root"] = str(Path(out["root"]).expanduser().resolve())
    return out


def content(files: list[Path]) -> str:
    """A digest of the files' paths, sizes and modification times: images added, removed or replaced under the same
    data.root (a folder grown, MNIST's train pair downloaded beside the test pair) change it."""
    listed = [f"{path}|{(stat := path.stat()).st_size}|{stat.st_mtime_ns}" for path in files]
    return hashlib.sha256("\n".join(listed).encode()).hexdigest()[:16]


def reference_key(source: Source, *, image_size: int, channels: int | None, extractor: str) -> dict[str, Any]:
    """What the cached statistics depend on: the source (its class and fields), resolution, extractor (the files'
    digest is kept beside it in the cache: see reference_stats)."""
    fields = _key_fields(dataclasses.asdict(source) if dataclasses.is_dataclass(source) else {})  # type: ignore[arg-type]
    return {
        "format": CACHE_FORMAT,
        "source": type(source).__name__,
        **fields,
        "image_size": image_size,
        "channels": channels,
        "features": extractor,
        "kid_reference_size": KID_REFERENCE_SIZE,
    }


def reference_path(cache_dir: str | os.PathLike, key: dict[str, Any]) -> Path:
    """<cache>/<dataset>-<split>-<S>px-<extractor>-<hash of the whole key>.pt"""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    dataset = key["source"].removesuffix("Source").lower()
    name = f"{dataset}-{key.get('split', 'all')}-{key['image_size']}px-{key['features']}-{digest}.pt"
    return Path(cache_dir).expanduser() / name


def read_cached_stats(path: Path, key: dict[str, Any], files: str | None = None) -> FeatureStats | None:
    """The statistics cached in `path` for `key` and the source's `files` digest (None: not on disk, any digest
    stands); None if they are for another key or other files (stale) or the file is torn or not a cache file (said
    in a warning that names it: it is computed again and replaced, atomically)."""
    try:
        cached = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(cached, dict):
            raise TypeError(f"it holds a {type(cached).__name__}, not a dict")
        if cached.get("key") != key or (files is not None and cached.get("files") != files):  # stale
            return None
        fields = {f: cached[f] for f in ("num", "features_sum", "cov_sum")}
        return FeatureStats(**fields, kid_features=cached["kid_features"].double())
    except Exception as error:  # a torn zip: OSError, RuntimeError (central directory), UnpicklingError, KeyError ...
        warnings.warn(
            f"the reference statistics cache {path} cannot be read ({brief(error)}): "
            "it is torn or not a cache file; computing the statistics again and replacing it",
            stacklevel=3,
        )
        return None


def reference_stats(
    source: Source,
    *,
    image_size: int,
    channels: int | None,
    extractor: FeatureExtractor,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    batch_size: int = 250,
) -> FeatureStats:
    """Statistics of every image of `source` (the whole split, no data.limit), cached under `cache_dir`."""
    key = reference_key(source, image_size=image_size, channels=channels, extractor=extractor.name)
    path = reference_path(cache_dir, key)
    try:
        files = content(source.files())  # images added, removed or replaced under the same root: computed again
    except FileNotFoundError:
        files = None  # the data is not here (moved, or only the cache was copied): the cache stands
    cached = read_cached_stats(path, key, files) if path.is_file() else None
    if cached is not None:
        if files is None:
            warnings.warn(f"the data of {path.name} is not on disk; its cached reference statistics are used",
                          stacklevel=2)  # fmt: skip
        return cached
    if hasattr(source, "kept_files"):  # an image folder (ImageNet): decoded a chunk at a time, never whole
        stats = streamed_stats(source, image_size=image_size, channels=channels, extractor=extractor,
                               batch_size=batch_size, path=path)  # fmt: skip
    else:
        data = source.load(image_size=image_size, channels=channels)
        say(f"reference statistics: {len(data.images)} images through {extractor.name} -> {path}")
        stats = FeatureStats.of(extractor(data.images, batch_size=batch_size)[0])
    # KID's features as float32 (what the extractors compute, so lossless): 82 MB for 10k Inception rows.
    record = {"key": key, "files": files, **dataclasses.asdict(stats), "kid_features": stats.kid_features.float()}
    atomic_save(record, path)
    return stats


def streamed_stats(source: Any, *, image_size: int, channels: int | None, extractor: FeatureExtractor,
                   batch_size: int, path: Path, chunk: int = 2048, seed: int = 0) -> FeatureStats:  # fmt: skip
    """FeatureStats.of the folder's features, its images decoded `chunk` at a time (running sums; KID's seeded rows
    kept as they pass): the whole split in RAM was 1.28M x 3 x 256 x 256 bytes (240 GiB) for ImageNet at 256 px."""
    files = source.kept_files(None)
    say(f"reference statistics: {len(files)} images through {extractor.name}, {chunk} at a time -> {path}")
    keep = kid_rows(len(files), kid_size=KID_REFERENCE_SIZE, seed=seed)
    features_sum, cov_sum, kid = 0.0, 0.0, []
    for start in range(0, len(files), chunk):
        images, _ = source.decode(files[start : start + chunk], image_size=image_size, channels=channels)
        f = extractor(images, batch_size=batch_size)[0].double()
        features_sum, cov_sum = features_sum + f.sum(0), cov_sum + f.T @ f
        kid.append(f[keep[(keep >= start) & (keep < start + len(f))] - start].clone())
    return FeatureStats(num=len(files), features_sum=features_sum, cov_sum=cov_sum, kid_features=torch.cat(kid))
