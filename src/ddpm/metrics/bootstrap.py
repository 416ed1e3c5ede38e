"""Bootstrap intervals for FID, KID and accuracy of one generated set (Efron & Tibshirani 1993). Plain torch.

A resample of the N generated images is a vector of counts w (N,), sum w = N (multinomial). Every statistic is
written in terms of w, so no feature matrix is copied per resample and paired comparisons (two sets drawn with the
same seeds and labels, resampled with the same w) come for free:

- FID (Heusel et al. 2017) = |mu_r - mu_w|^2 + tr S_r + tr S_w - 2 tr (S_r^1/2 S_w S_r^1/2)^1/2. With
  G = F S_r^1/2 (N, D) computed once, the non-zero eigenvalues of S_r^1/2 S_w S_r^1/2 are those of the N x N matrix
  diag(sqrt w) (G - 1 m^T)(G - 1 m^T)^T diag(sqrt w) / (N - 1), m = w^T G / N: one N x N eigvalsh per resample
  instead of a D x D matrix square root (N = 500, D = 1024 for the MNIST classifier).
- KID (Binkowski et al. 2018): unbiased MMD^2 with the cubic polynomial kernel k(x, y) = (x.y / D + 1)^3 against a
  fixed reference subset; the fake-fake term averages k over pairs of distinct images (a drawn image paired with its
  own copy is left out, as the unbiased estimator leaves out i = j).
- accuracy: the w-weighted fraction of images the classifier reads as the requested label.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ddpm.metrics.fid import FeatureStats


def _sqrtm_psd(a: Tensor) -> Tensor:
    values, vectors = torch.linalg.eigh(a)
    return (vectors * values.clamp_min(0).sqrt()) @ vectors.T


@dataclass(frozen=True)
class Percentiles:
    """A statistic on the full set and its bootstrap interval (low, high)."""

    value: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class Reference:
    """What every set's statistics need from the reference, computed once: mu_r, S_r^1/2, tr S_r and the KID
    reference features with their kernel's mean over distinct pairs."""

    mu: Tensor  # (D,)
    cov_sqrt: Tensor  # (D, D)
    trace: float
    kid_features: Tensor  # (M, D)
    kid_rr: float

    @classmethod
    def of(cls, reference: FeatureStats, *, kid_reference: int = 2000, seed: int = 0) -> "Reference":
        """`kid_reference` rows of the reference's KID features, a seeded random subset: its first rows were a
        dataset's first images (sorted, kid_features keeps dataset order), e.g. MNIST's first 2,000 test digits,
        whose writers differ from the rest (the floor's ckid read 80e-3 against them, about -10e-3 against random
        subsets)."""
        mu = reference.features_sum / reference.num
        cov = (reference.cov_sum - reference.num * torch.outer(mu, mu)) / (reference.num - 1)
        pick = torch.randperm(len(reference.kid_features), generator=torch.Generator().manual_seed(seed))
        r = reference.kid_features[pick[:kid_reference]].double()
        k_rr, m = _kernel(r, r), len(r)
        kid_rr = float((k_rr.sum() - k_rr.diagonal().sum()) / (m * (m - 1)))
        return cls(mu=mu, cov_sqrt=_sqrtm_psd(cov), trace=float(cov.trace()), kid_features=r, kid_rr=kid_rr)


def _kernel(x: Tensor, y: Tensor) -> Tensor:
    """KID's cubic polynomial kernel (x.y / D + 1)^3."""
    return (x @ y.T / x.shape[1] + 1) ** 3


class SetStatistics:
    """FID, KID and accuracy of one generated set (features (N, D), optional logits (N, K) and labels (N,)) under
    resampling weights w (N,); w = 1 gives the plain statistics (FID equal to metrics.fid.frechet_distance).
    `reference`: FeatureStats, or a Reference made once for many sets."""

    def __init__(
        self,
        reference: FeatureStats | Reference,
        features: Tensor,
        *,
        logits: Tensor | None = None,
        labels: Tensor | None = None,
        kid_reference: int = 2000,
    ) -> None:
        ref = reference if isinstance(reference, Reference) else Reference.of(reference, kid_reference=kid_reference)
        f = features.double().cpu()
        self.n, self.d = f.shape
        self.ref, self.f = ref, f
        g = f @ ref.cov_sqrt  # (N, D): G = F S_r^1/2
        self.gram_g = g @ g.T  # (N, N): G G^T, so a resample costs O(N^2) before its eigvalsh
        self.sq_norms = (f * f).sum(1)  # (N,) |f_i|^2
        self.k_ff = _kernel(f, f)  # (N, N)
        self.k_fr_mean = _kernel(f, ref.kid_features).mean(1)  # (N,)
        self.correct = None
        if logits is not None and labels is not None:
            self.correct = (logits.argmax(1).cpu() == labels.cpu()).double()

    def fid(self, w: Tensor) -> float:
        n = self.n
        mu_w = (w @ self.f) / n
        s = self.gram_g @ w / n  # G m, m = G^T w / n
        centred = self.gram_g - s[:, None] - s[None, :] + (w @ s) / n  # (G - 1 m^T)(G - 1 m^T)^T
        root_w = w.sqrt()
        gram = root_w[:, None] * centred * root_w[None, :] / (n - 1)
        cross = torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().sum()
        trace_w = (float(w @ self.sq_norms) - n * float(mu_w @ mu_w)) / (n - 1)
        return float(((self.ref.mu - mu_w) ** 2).sum()) + self.ref.trace + trace_w - 2 * float(cross)

    def kid(self, w: Tensor) -> float:
        pairs = w.sum() ** 2 - (w**2).sum()
        k_ff = (w @ self.k_ff @ w - (w**2 * self.k_ff.diagonal()).sum()) / pairs
        return float(k_ff) + self.ref.kid_rr - 2 * float(w @ self.k_fr_mean) / self.n

    def accuracy(self, w: Tensor) -> float | None:
        return None if self.correct is None else float(w @ self.correct) / self.n

    def all(self, w: Tensor) -> dict[str, float | None]:
        return {"cfid": self.fid(w), "ckid": self.kid(w), "accuracy": self.accuracy(w)}


def resample_weights(n: int, resamples: int, *, seed: int = 0) -> Tensor:
    """(B, n) float64 counts: how often each of n items is drawn in each of B resamples with replacement."""
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(n, (resamples, n), generator=generator)
    counts = torch.zeros(resamples, n, dtype=torch.float64)
    return counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))


def percentile_interval(value: float, draws: list[float], *, level: float = 0.95) -> Percentiles:
    """The draws' central `level` percentile interval, moved so that their median sits on the full-set value.

    A resample holds about 63% distinct images, so its FID is biased up (FID's small-sample bias grows as 1/N):
    the plain percentile interval of a 500-image FID often lies wholly above the value. Comparing samplers at
    the same N needs the spread of FID@N, not its bias, so the interval keeps the spread and drops the shift. For
    an unbiased statistic (accuracy) the median is the value and this is the plain percentile interval."""
    t = torch.tensor(draws, dtype=torch.float64)
    tail = (1 - level) / 2
    q_lo, q_mid, q_hi = torch.quantile(t, torch.tensor([tail, 0.5, 1 - tail], dtype=torch.float64)).tolist()
    return Percentiles(value=value, low=value - (q_mid - q_lo), high=value + (q_hi - q_mid))


def draws(stats: SetStatistics, weights: Tensor) -> dict[str, Tensor]:
    """Every statistic of `stats` under each resample of `weights` (B, N): {name: (B,) float64}. Computed once per
    set, they serve its own intervals and every paired ratio it takes part in."""
    rows = [stats.all(w) for w in weights]
    return {
        name: torch.tensor([r[name] for r in rows], dtype=torch.float64)
        for name in rows[0]
        if rows[0][name] is not None
    }


def bootstrap(
    stats: SetStatistics, weights: Tensor, *, level: float = 0.95, drawn: dict[str, Tensor] | None = None
) -> dict[str, Percentiles]:
    """Every statistic of `stats` on the full set, with its interval over the resamples `weights` (or `drawn`,
    draws(stats, weights) computed before)."""
    full = stats.all(torch.ones(stats.n, dtype=torch.float64))
    drawn = draws(stats, weights) if drawn is None else drawn
    return {
        name: percentile_interval(value, drawn[name].tolist(), level=level)
        for name, value in full.items()
        if value is not None
    }


def paired_ratio(
    a: SetStatistics,
    b: SetStatistics,
    weights: Tensor,
    *,
    metric: Literal["fid", "kid"] = "fid",
    level: float = 0.95,
    drawn: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None,
) -> Percentiles:
    """metric(a) / metric(b) with a paired interval: both sets resampled with the same counts (their image i
    shares its seed and label), so what the two have in common cancels. `drawn`: (draws(a, weights),
    draws(b, weights)) computed before."""
    name = "c" + metric
    ones = torch.ones(a.n, dtype=torch.float64)
    value = getattr(a, metric)(ones) / getattr(b, metric)(ones)
    drawn_a, drawn_b = (draws(a, weights), draws(b, weights)) if drawn is None else drawn
    return percentile_interval(value, (drawn_a[name] / drawn_b[name]).tolist(), level=level)


def mean_paired_ratio(
    pairs: list[tuple[SetStatistics, SetStatistics]],
    weights: Tensor,
    *,
    metric: Literal["fid", "kid"] = "fid",
    level: float = 0.95,
    drawn: list[tuple[dict[str, Tensor], dict[str, Tensor]]] | None = None,
) -> Percentiles:
    """The mean over K pairs (a_k, b_k) of metric(a_k) / metric(b_k), e.g. K training seeds each against its own
    reference sampler, with one interval: in every resample each pair's ratio is taken as paired_ratio takes it and
    the K ratios are averaged. Every set is resampled with the same counts `weights` (image i of every set shares its
    label and initial noise), so the interval is over the images with the K models held fixed; the spread between
    the models is theirs to report (min-max). `drawn`: each pair's (draws(a_k, weights), draws(b_k, weights)) computed
    before."""
    if not pairs:
        raise ValueError("mean_paired_ratio needs at least one (a, b) pair")
    name = "c" + metric
    ones = torch.ones(pairs[0][0].n, dtype=torch.float64)
    value = sum(getattr(a, metric)(ones) / getattr(b, metric)(ones) for a, b in pairs) / len(pairs)
    drawn = [(draws(a, weights), draws(b, weights)) for a, b in pairs] if drawn is None else drawn
    mean = torch.stack([drawn_a[name] / drawn_b[name] for drawn_a, drawn_b in drawn]).mean(0)
    return percentile_interval(value, mean.tolist(), level=level)
