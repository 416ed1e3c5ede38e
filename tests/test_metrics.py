"""FID, KID and IS against independent truth; the reference cache; the missing-weights message; sharding."""

import shutil
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import Tensor, nn

from ddpm.data.sources import DigitsSource
from ddpm.metrics import features as features_module
from ddpm.metrics.classifier import SmallClassifier, save_state, save_torchscript
from ddpm.metrics.evaluate import shard
from ddpm.metrics.features import INCEPTION_FILE, INCEPTION_URL, FeatureExtractor, classifier_extractor
from ddpm.metrics.fid import (
    FeatureStats,
    compute_metrics,
    count_tag,
    frechet_distance,
    inception_score,
    kernel_distance,
    reference_key,
    reference_path,
    reference_stats,
)


def features_with_moments(mean: Tensor, cov: Tensor, n: int, seed: int) -> Tensor:
    """(n, D) float64 whose sample mean is exactly `mean` and unbiased sample covariance exactly `cov`."""
    z = torch.randn(n, len(mean), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    z = z - z.mean(0)
    whiten = torch.linalg.cholesky(z.T @ z / (n - 1))
    z = torch.linalg.solve_triangular(whiten, z.T, upper=False).T  # sample covariance: identity
    return z @ torch.linalg.cholesky(cov).T + mean


def random_cov(d: int, seed: int) -> Tensor:
    a = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return a @ a.T / d + 0.1 * torch.eye(d, dtype=torch.float64)


def closed_form_fid(mu1: Tensor, s1: Tensor, mu2: Tensor, s2: Tensor) -> float:
    """|mu1 - mu2|^2 + tr(S1 + S2 - 2 (S1 S2)^(1/2)), with scipy's matrix square root."""
    covmean = scipy.linalg.sqrtm(s1.numpy() @ s2.numpy()).real
    return float(((mu1 - mu2) ** 2).sum()) + float(np.trace(s1.numpy() + s2.numpy() - 2 * covmean))


def test_fid_matches_the_closed_form_of_two_gaussians() -> None:
    """Feature sets with exactly known means and covariances: FID equals the Frechet distance formula."""
    d = 8
    mu1, mu2 = torch.zeros(d, dtype=torch.float64), torch.linspace(-1, 1, d, dtype=torch.float64)
    s1, s2 = random_cov(d, 1), random_cov(d, 2)
    real, fake = features_with_moments(mu1, s1, 500, 3), features_with_moments(mu2, s2, 300, 4)
    expected = closed_form_fid(mu1, s1, mu2, s2)
    assert frechet_distance(FeatureStats.of(real), fake) == pytest.approx(expected, rel=1e-6)
    # Diagonal covariances: tr((S1 S2)^(1/2)) = sum sqrt(a_i b_i), by hand.
    a, b = torch.linspace(0.5, 2, d, dtype=torch.float64), torch.linspace(3, 1, d, dtype=torch.float64)
    real, fake = features_with_moments(mu1, torch.diag(a), 400, 5), features_with_moments(mu1, torch.diag(b), 400, 6)
    by_hand = float((a + b - 2 * (a * b).sqrt()).sum())
    assert frechet_distance(FeatureStats.of(real), fake) == pytest.approx(by_hand, rel=1e-6)


def test_fid_from_cached_stats_equals_torchmetrics_fid_on_the_same_features() -> None:
    """Our stats path (sums cached, fed to the metric) gives torchmetrics' own two-sided FID."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    real = torch.randn(400, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    fake = 0.8 * torch.randn(200, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.3

    class Identity(nn.Module):
        num_features = 16

        def forward(self, x: Tensor) -> Tensor:
            return x

    metric = FrechetInceptionDistance(feature=Identity())
    metric.update(real, real=True)
    metric.update(fake, real=False)
    assert frechet_distance(FeatureStats.of(real), fake) == pytest.approx(float(metric.compute()), rel=1e-9)


def numpy_kid(x: np.ndarray, y: np.ndarray) -> float:
    """Unbiased MMD^2 with k(a, b) = (a.b / d + 1)^3 (Binkowski et al. 2018, eq. 4), written independently."""
    d = x.shape[1]
    kxx, kyy, kxy = (x @ x.T / d + 1) ** 3, (y @ y.T / d + 1) ** 3, (x @ y.T / d + 1) ** 3
    m, n = len(x), len(y)
    xx = (kxx.sum() - np.trace(kxx)) / (m * (m - 1))
    yy = (kyy.sum() - np.trace(kyy)) / (n * (n - 1))
    return float(xx + yy - 2 * kxy.mean())


def test_kid_matches_an_independent_unbiased_mmd() -> None:
    """One subset holding every sample: KID is exactly the unbiased polynomial-kernel MMD^2."""
    real = torch.randn(120, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    fake = torch.randn(120, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 1.3 + 0.2
    mean, _ = kernel_distance(FeatureStats.of(real), fake, subsets=1, subset_size=120)
    assert mean == pytest.approx(numpy_kid(real.numpy(), fake.numpy()), rel=1e-9)
    # Several random subsets: torchmetrics draws them; seeded here, so the same call gives the same value.
    runs = [kernel_distance(FeatureStats.of(real), fake, subsets=5, subset_size=50, seed=3) for _ in range(2)]
    assert runs[0] == runs[1]
    # The same subsets, drawn as torchmetrics draws them (per subset: randperm of the real rows, then of the fake
    # rows, from the global RNG seeded with `seed`), each scored by the independent MMD^2: mean and (biased) std.
    generator = torch.Generator().manual_seed(3)
    scores = []
    for _ in range(5):
        rows_real, rows_fake = (
            torch.randperm(120, generator=generator)[:50],
            torch.randperm(120, generator=generator)[:50],
        )
        scores.append(numpy_kid(real[rows_real].numpy(), fake[rows_fake].numpy()))
    assert runs[0][0] == pytest.approx(float(np.mean(scores)), rel=1e-9)
    assert runs[0][1] == pytest.approx(float(np.std(scores)), rel=1e-9)
    assert len(set(scores)) == 5  # five different subsets, not one subset five times


def test_inception_score_splits_are_equal_where_the_count_is_not_a_multiple_of_them() -> None:
    """torchmetrics' `chunk` split 91 images into 9 splits of 10 and one of 1 (a score of exactly 1 in the mean and
    std); split i now holds rows [i N / 10, (i + 1) N / 10) of the same shuffle: torchmetrics' own values where 10
    divides N, and a float64 numpy computation with those bounds otherwise. Fewer images than splits are refused."""
    from torchmetrics.image.inception import InceptionScore

    from ddpm.metrics.fid import PassThrough, quiet

    logits = 3 * torch.randn(100, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    metric = quiet(InceptionScore, feature=PassThrough(10), splits=10)
    metric.update(logits)
    torch.manual_seed(0)  # torchmetrics' shuffle draws from the global generator
    expected = [float(v) for v in metric.compute()]
    assert inception_score(logits) == pytest.approx(expected, rel=1e-12)
    few = logits[:91]
    order = torch.randperm(91, generator=torch.Generator().manual_seed(0)).numpy()
    p = np.exp(few.numpy()[order]) / np.exp(few.numpy()[order]).sum(1, keepdims=True)
    scores = []
    for i in range(10):
        part = p[i * 91 // 10 : (i + 1) * 91 // 10]
        scores.append(np.exp((part * (np.log(part) - np.log(part.mean(0)))).sum(1).mean()))
    assert inception_score(few) == pytest.approx((np.mean(scores), np.std(scores, ddof=1)), rel=1e-10)
    with pytest.raises(ValueError, match="9 images cannot make 10 splits"):
        inception_score(logits[:9])


@pytest.mark.filterwarnings("ignore:std\\(\\)")  # one split: no spread
def test_inception_score_of_confident_uniform_predictions_is_the_class_count() -> None:
    """Sharp predictions spread evenly over K classes: IS = exp(log K) = K; one class only: IS = 1."""
    logits = 50.0 * torch.eye(10, dtype=torch.float64).repeat(20, 1)  # 200 samples, 20 of each class
    score, _ = inception_score(logits, splits=1)
    assert score == pytest.approx(10.0, rel=1e-6)
    assert inception_score(50.0 * torch.eye(10, dtype=torch.float64)[[3] * 50], splits=1)[0] == pytest.approx(1.0)


def test_metric_names_carry_the_sample_count_and_the_feature_kind() -> None:
    assert [count_tag(n) for n in (500, 1000, 10_000, 50_000, 1500)] == ["500", "1k", "10k", "50k", "1500"]
    real = torch.randn(300, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(200, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    labels = logits.argmax(1)
    labels[::4] = (labels[::4] + 1) % 10  # every 4th label disagrees with the prediction: accuracy 150/200
    out = compute_metrics(["fid", "kid", "is"], features=real[:200], logits=logits, reference=FeatureStats.of(real),
                          kind="classifier", labels=labels)  # fmt: skip
    assert set(out) == {"cfid@200", "ckid@200", "ckid_std@200", "cis@200", "cis_std@200", "accuracy@200"}
    assert out["accuracy@200"] == 0.75
    with pytest.raises(ValueError, match="choose from"):
        compute_metrics(["fld"], features=real, logits=None, reference=FeatureStats.of(real))


class MeanPool(nn.Module):
    """A stand-in feature extractor: per-channel means and quadrant means of uint8 images."""

    def forward(self, images: Tensor) -> Tensor:
        x = images.float() / 255
        return torch.nn.functional.adaptive_avg_pool2d(x, 2).flatten(1)


class CountingPool(MeanPool):
    """MeanPool that counts its calls, and raises while `armed` (a path that must not extract features)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.armed = 0, False

    def forward(self, images: Tensor) -> Tensor:
        if self.armed:
            raise AssertionError("the feature extractor ran on a path that must read the cache")
        self.calls += 1
        return super().forward(images)


def test_reference_stats_are_cached_per_dataset_resolution_and_extractor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Second call reads the file (neither the data nor the extractor is touched); another size or extractor is
    another file; a stale key is recomputed."""
    net = CountingPool()
    extractor = FeatureExtractor(net=net, name="meanpool", kind="classifier")
    source = DigitsSource()
    first = reference_stats(source, image_size=8, channels=1, extractor=extractor, cache_dir=tmp_path)
    assert first.num == 1797 and net.calls > 0  # the whole split, through the extractor
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("digits-all-8px-meanpool-")
    net.armed = True
    with monkeypatch.context() as patch:
        patch.setattr(DigitsSource, "load", lambda *a, **k: pytest.fail("the cached path read the data source"))
        again = reference_stats(source, image_size=8, channels=1, extractor=extractor, cache_dir=tmp_path)
    assert again.num == first.num and torch.equal(again.features_sum, first.features_sum)
    assert torch.equal(again.cov_sum, first.cov_sum) and torch.equal(again.kid_features, first.kid_features)
    net.armed = False
    calls = net.calls
    reference_stats(source, image_size=16, channels=1, extractor=extractor, cache_dir=tmp_path)
    assert net.calls > calls  # another size: computed, not read
    other = FeatureExtractor(net=MeanPool(), name="other", kind="classifier")
    reference_stats(source, image_size=8, channels=1, extractor=other, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 3
    key = reference_key(source, image_size=8, channels=1, extractor="meanpool")
    assert reference_path(tmp_path, key) == files[0]
    assert reference_key(source, image_size=8, channels=3, extractor="meanpool") != key
    # A file whose stored key disagrees (e.g. written by an older format) is recomputed, not trusted.
    stored = torch.load(files[0], weights_only=True)
    torch.save({**stored, "key": {**key, "format": -1}, "num": 5}, files[0])
    calls = net.calls
    assert reference_stats(source, image_size=8, channels=1, extractor=extractor, cache_dir=tmp_path).num == 1797
    assert net.calls > calls


def test_reference_stats_follow_the_files_under_the_same_root(tmp_path: Path) -> None:
    """The cache key named data.root but not what it holds: a folder grown by 30 images (and a class) kept its
    statistics of the first 10. The files' digest (paths, sizes, times) is kept with the statistics now."""
    from PIL import Image

    from ddpm.data.image_folder import ImageFolderSource

    def add(folder: str, count: int, value: int) -> None:
        (tmp_path / "images" / folder).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.new("L", (8, 8), value + i).save(tmp_path / "images" / folder / f"{i}.png")

    add("a", 10, 0)
    source = ImageFolderSource(root=str(tmp_path / "images"))
    extractor = FeatureExtractor(net=MeanPool(), name="meanpool", kind="classifier")
    stats = lambda: reference_stats(source, image_size=8, channels=1, extractor=extractor, cache_dir=tmp_path / "c")  # noqa: E731
    assert stats().num == 10
    add("b", 30, 100)
    assert stats().num == stats().num == 40  # computed once more, then read
    assert len(list((tmp_path / "c").iterdir())) == 1  # the same key: replaced
    shutil.rmtree(tmp_path / "images")  # the data gone (only the cache copied here): the cache stands, said so
    with pytest.warns(UserWarning, match="not on disk; its cached reference statistics are used"):
        assert stats().num == 40


def test_an_image_folders_reference_statistics_are_those_of_the_whole_set_decoded_a_chunk_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reference_stats loaded the whole split (ImageNet at 256 px: 240 GiB) before its features; an image folder is
    now decoded a chunk at a time, with running sums and KID's seeded rows kept as they pass: the same statistics."""
    from PIL import Image

    from ddpm.data.image_folder import ImageFolderSource
    from ddpm.metrics import fid

    for i in range(25):
        (tmp_path / "images" / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.new("L", (8, 8), 7 * i).save(tmp_path / "images" / f"c{i % 3}" / f"{i}.png")
    source = ImageFolderSource(root=str(tmp_path / "images"))
    extractor = FeatureExtractor(net=MeanPool(), name="meanpool", kind="classifier")
    whole = FeatureStats.of(extractor(source.load(image_size=8, channels=1).images)[0], kid_size=10)
    decoded, decode = [], ImageFolderSource.decode
    monkeypatch.setattr(ImageFolderSource, "decode", lambda self, files, **k: decoded.append(len(files))
                        or decode(self, files, **k))  # fmt: skip
    monkeypatch.setattr(fid, "KID_REFERENCE_SIZE", 10)
    streamed = fid.streamed_stats(source, image_size=8, channels=1, extractor=extractor, batch_size=4,
                                  path=tmp_path / "c.pt", chunk=7)  # fmt: skip
    assert decoded == [7, 7, 7, 4] and streamed.num == whole.num == 25
    torch.testing.assert_close(streamed.features_sum, whole.features_sum, rtol=1e-12, atol=0)
    torch.testing.assert_close(streamed.cov_sum, whole.cov_sum, rtol=1e-12, atol=0)
    assert torch.equal(streamed.kid_features, whole.kid_features)


def test_missing_inception_weights_fail_with_the_file_the_folder_and_the_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No weights under $TORCH_HOME and no network (download made to fail at once): the message says what to do."""
    import torch_fidelity.feature_extractor_inceptionv3 as tf_inception

    def no_network(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("no network (simulated)")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)
    monkeypatch.setattr(tf_inception, "load_state_dict_from_url", no_network)
    with pytest.raises(features_module.InceptionWeightsMissing) as error:
        features_module.build_extractor("inception")
    message = str(error.value)
    assert INCEPTION_FILE in message and INCEPTION_URL in message
    assert str(tmp_path / "hub" / "checkpoints") in message and "metrics.features=" in message


def test_inception_extractor_feeds_grey_uint8_images_to_torch_fidelity_inception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real network path with random weights (the true ones cannot be fetched here): grey 16x16 uint8
    images become 3-channel 299x299 inputs, giving pool3 features (2048) and logits (1008) for IS."""
    import torch_fidelity.feature_extractor_inceptionv3 as tf_inception

    monkeypatch.setattr(tf_inception, "load_state_dict_from_url", lambda *a, **k: {})
    monkeypatch.setattr(tf_inception.FeatureExtractorInceptionV3, "load_state_dict", lambda self, state: None)
    extractor = features_module.build_extractor("inception")
    assert extractor.name == features_module.INCEPTION_ID and extractor.kind == "inception"
    features, logits = extractor(torch.randint(0, 256, (2, 1, 16, 16), dtype=torch.uint8))
    assert features.shape == (2, 2048) and logits is not None and logits.shape == (2, 1008)
    assert torch.isfinite(features).all()


def test_classifier_files_load_as_torchscript_and_as_state_dict(tmp_path: Path) -> None:
    """Both file kinds give the same features and logits; the name carries the file's digest."""
    torch.manual_seed(0)
    net = SmallClassifier(in_channels=1, num_classes=10).eval()
    scripted = classifier_extractor(save_torchscript(net, tmp_path / "clf.pt", image_size=32))
    plain = classifier_extractor(save_state(net, tmp_path / "clf_state.pt", image_size=32))
    images = torch.randint(0, 256, (5, 1, 16, 16), dtype=torch.uint8)  # resized to 32 by the extractor
    f1, l1 = scripted(images)
    f2, l2 = plain(images)
    assert f1.shape == (5, 1024) and l1 is not None and l1.shape == (5, 10)
    torch.testing.assert_close(f1, f2)
    torch.testing.assert_close(l1, l2)
    assert scripted.name.startswith("clf-") and scripted.kind == "classifier"
    with pytest.raises(FileNotFoundError, match=r"metrics\.features"):
        classifier_extractor(tmp_path / "missing.pt")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize(("num_samples", "batch_size"), [(10, 3), (1000, 256), (5, 8), (64, 64)])
def test_shards_are_disjoint_batch_aligned_and_cover_every_index(num_samples: int, batch_size: int,
                                                                 world_size: int) -> None:  # fmt: skip
    ranges = [shard(num_samples, batch_size, world_size, rank) for rank in range(world_size)]
    indices = [i for first, count in ranges for i in range(first, first + count)]
    assert indices == list(range(num_samples))  # disjoint, in rank order, covering
    assert all(first % batch_size == 0 for first, count in ranges if count)
    counts = [-(-count // batch_size) for _, count in ranges]
    assert max(counts) - min(counts) <= 1  # balanced to within one batch


def _gather_on(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from ddpm.ranks import all_gather_rows

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mine = torch.zeros((0, 4, 8, 8), dtype=torch.uint8) if rank == 0 else torch.arange(48, dtype=torch.uint8)
    gathered = all_gather_rows(mine.reshape(-1, 1, 4, 4) if rank else mine)
    torch.save(gathered, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_a_rank_without_rows_takes_the_others_trailing_shape(tmp_path: Path) -> None:
    """sample.py under torchrun with fewer batches than ranks: an empty rank's placeholder has the latent shape
    (4, 8, 8), the others decoded pixels (1, 4, 4); the gather sized each rank's buffer from its own rows (gloo:
    'Received data size doesn't match', or, with equal element counts, rank 0 writing latents as images)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    mp.spawn(_gather_on, args=(port, str(tmp_path)), nprocs=2)
    expected = torch.arange(48, dtype=torch.uint8).reshape(3, 1, 4, 4)
    for rank in (0, 1):
        assert torch.equal(torch.load(tmp_path / f"{rank}.pt"), expected)
