"""ddpm.metrics.bootstrap against independent truth: torchmetrics' FID on explicitly duplicated features, an
unbiased MMD^2 written out pair by pair, and the percentile of a known distribution."""

import itertools

import pytest
import torch

from ddpm.metrics.bootstrap import (
    SetStatistics,
    bootstrap,
    mean_paired_ratio,
    paired_ratio,
    percentile_interval,
    resample_weights,
)
from ddpm.metrics.fid import FeatureStats, frechet_distance


@pytest.fixture(scope="module")
def sets():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2000, 32, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2, 32, dtype=torch.float64)
    fake = torch.randn(120, 32, generator=g, dtype=torch.float64) * 1.1 + 0.2
    return FeatureStats.of(ref), ref, fake


def test_fid_matches_torchmetrics_on_the_full_set_and_on_a_resample(sets):
    reference, _, fake = sets
    stats = SetStatistics(reference, fake)
    assert stats.fid(torch.ones(len(fake), dtype=torch.float64)) == pytest.approx(
        frechet_distance(reference, fake), rel=1e-6
    )
    for w in resample_weights(len(fake), 3, seed=1):
        drawn = torch.repeat_interleave(torch.arange(len(fake)), w.long())  # the resample, written out
        assert stats.fid(w) == pytest.approx(frechet_distance(reference, fake[drawn]), rel=1e-6)


def _mmd2_pairwise(x, y):
    """Unbiased MMD^2 with k(a, b) = (a.b / d + 1)^3, looping over pairs of distinct items."""
    d = x.shape[1]

    def k(a, b):
        return float((a @ b / d + 1) ** 3)

    xx = [k(x[i], x[j]) for i, j in itertools.permutations(range(len(x)), 2)]
    yy = [k(y[i], y[j]) for i, j in itertools.permutations(range(len(y)), 2)]
    xy = [k(a, b) for a in x for b in y]
    return sum(xx) / len(xx) + sum(yy) / len(yy) - 2 * sum(xy) / len(xy)


def test_kid_reference_is_a_random_subset_not_the_datasets_first_images():
    """A reference in dataset order (class a, then class b: a sorted folder, MNIST's test writers) and generated
    features drawn from both: KID against a random 300 of it is near 0 (the unbiased MMD^2 of one distribution).
    Against its first 300 (class a only) it read the distance between the mixture and class a."""
    g = torch.Generator().manual_seed(0)
    ordered = torch.cat([torch.randn(1000, 8, generator=g), torch.randn(1000, 8, generator=g) + 2]).double()
    fake = ordered[torch.randperm(2000, generator=g)[:300]] + 0.01 * torch.randn(300, 8, generator=g).double()
    kid = SetStatistics(FeatureStats.of(ordered), fake, kid_reference=300).kid(torch.ones(300, dtype=torch.float64))
    mixed = _mmd2_pairwise(fake[:100], ordered[:100])  # what a first-rows reference measures: class a vs the mixture
    assert abs(kid) < 0.05 * mixed


def test_kid_is_the_unbiased_mmd2_and_leaves_out_copies_of_one_image(sets):
    _, ref, fake = sets
    reference = FeatureStats.of(ref[:40])
    stats = SetStatistics(reference, fake[:25], kid_reference=40)
    assert stats.kid(torch.ones(25, dtype=torch.float64)) == pytest.approx(
        _mmd2_pairwise(fake[:25], reference.kid_features), rel=1e-9
    )
    # counts 2, 0, 1, 0, ...: the fake-fake pairs of distinct images, each weighted by the product of counts
    w = torch.zeros(25, dtype=torch.float64)
    w[[0, 2, 5]] = torch.tensor([2.0, 1.0, 3.0], dtype=torch.float64)
    d = fake.shape[1]
    k = (fake[:25] @ fake[:25].T / d + 1) ** 3
    pairs = [(a, b) for a in (0, 2, 5) for b in (0, 2, 5) if a != b]
    ff = sum(w[a] * w[b] * k[a, b] for a, b in pairs) / sum(w[a] * w[b] for a, b in pairs)
    fr = ((fake[:25] @ reference.kid_features.T / d + 1) ** 3).mean(1)
    rr = stats.ref.kid_rr
    expected = float(ff) + rr - 2 * float((w * fr).sum() / w.sum())
    # kid() divides the cross term by N, not by sum(w): give it a full-size resample to compare
    w_full = w * (25 / w.sum())
    assert stats.kid(w_full) == pytest.approx(expected, rel=1e-9)


def test_accuracy_and_weights():
    reference = FeatureStats.of(torch.randn(50, 4, dtype=torch.float64))
    logits = torch.eye(4, dtype=torch.float64)[[0, 1, 2, 3]]
    stats = SetStatistics(reference, torch.randn(4, 4), logits=logits, labels=torch.tensor([0, 1, 2, 0]))
    assert stats.accuracy(torch.ones(4, dtype=torch.float64)) == 0.75
    assert stats.accuracy(torch.tensor([0.0, 0.0, 0.0, 4.0], dtype=torch.float64)) == 0.0
    w = resample_weights(7, 500, seed=0)
    assert w.shape == (500, 7) and torch.all(w.sum(1) == 7)
    assert w.mean().item() == pytest.approx(1.0)
    assert w.var(0).mean().item() == pytest.approx(6 / 7, rel=0.1)  # multinomial: n p (1 - p)


def test_percentile_interval_of_a_known_distribution():
    draws = torch.arange(1, 1001, dtype=torch.float64).tolist()
    interval = percentile_interval(500.5, draws)  # value = the draws' median: the plain percentile interval
    assert interval.low == pytest.approx(25.975) and interval.high == pytest.approx(975.025)
    shifted = percentile_interval(400.5, draws)  # draws biased up by 100: the same spread around the value
    assert shifted.low == pytest.approx(-74.025) and shifted.high == pytest.approx(875.025)


def test_intervals_cover_the_value_and_paired_ratio_of_a_set_with_itself_is_one(sets):
    reference, _, fake = sets
    stats = SetStatistics(reference, fake, logits=torch.randn(len(fake), 3), labels=torch.zeros(len(fake)))
    weights = resample_weights(len(fake), 50, seed=0)
    intervals = bootstrap(stats, weights)
    assert set(intervals) == {"cfid", "ckid", "accuracy"}
    fid = intervals["cfid"]
    assert fid.low < fid.value < fid.high
    same = paired_ratio(stats, stats, weights)
    assert same.value == same.low == same.high == 1.0
    shifted = SetStatistics(reference, fake + 0.3)
    ratio = paired_ratio(shifted, stats, weights)
    assert ratio.low > 1.0  # moved further from the reference: larger FID in every resample


def test_mean_paired_ratio_against_resamples_written_out(sets):
    """Two models, each against its own reference sampler: the value is the mean of the two full-set FID ratios
    (torchmetrics' FID), and the interval is the centred percentile interval of that mean over resamples written out
    image by image (the same drawn images in all four sets); one pair gives paired_ratio's interval."""
    reference, _, fake = sets
    g = torch.Generator().manual_seed(3)
    sets4 = [fake[:60] + 0.1 * k + 0.05 * torch.randn(60, 32, generator=g, dtype=torch.float64) for k in range(4)]
    stats = [SetStatistics(reference, f) for f in sets4]
    pairs = [(stats[0], stats[1]), (stats[2], stats[3])]
    weights = resample_weights(60, 40, seed=2)
    pooled = mean_paired_ratio(pairs, weights)

    def ratio(idx):
        return (
            frechet_distance(reference, sets4[0][idx]) / frechet_distance(reference, sets4[1][idx])
            + frechet_distance(reference, sets4[2][idx]) / frechet_distance(reference, sets4[3][idx])
        ) / 2

    assert pooled.value == pytest.approx(ratio(torch.arange(60)), rel=1e-6)
    written = [ratio(torch.repeat_interleave(torch.arange(60), w.long())) for w in weights]
    expected = percentile_interval(pooled.value, written)
    assert (pooled.low, pooled.high) == pytest.approx((expected.low, expected.high), rel=1e-5)
    one = mean_paired_ratio(pairs[:1], weights)
    assert one == paired_ratio(*pairs[0], weights)
    with pytest.raises(ValueError, match="at least one"):
        mean_paired_ratio([], weights)
