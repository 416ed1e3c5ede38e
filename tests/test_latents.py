"""Encoding a data set into a VAE's latents (`python -m ddpm.data.encode`) and training data of them
(`data=latents`): a tiny random diffusers AutoencoderKL saved to a folder, scikit-learn's digits at 16x16."""

import io
import json
import multiprocessing
import os
import shutil
import signal
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddpm.data.encode import main as encode
from ddpm.data.latent_shards import HEADER, read_header
from ddpm.data.latents import LatentDataModule, latent_record
from ddpm.data.make_shards import write_shards
from ddpm.data.sources import DigitsSource
from ddpm.models.vae import VAE, folder_identity

pytest.importorskip("diffusers")

TINY_VAE = dict(in_channels=1, out_channels=1, down_block_types=["DownEncoderBlock2D"] * 2,
                up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
                latent_channels=2, norm_num_groups=4, sample_size=16)  # fmt: skip  # 1x16x16 -> 2x8x8
COUNT, PER_SHARD = 200, 64  # digits encoded by the shared folder: 4 shards, the last one partial


def save_vae(folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    VAE.from_config(TINY_VAE).autoencoder.save_pretrained(folder)
    return folder


def encode_args(vae: Path, out: Path, *extra: str) -> list[str]:
    return [f"vae={vae}", f"out={out}", "data.image_size=16", f"data.limit={COUNT}",
            f"samples_per_shard={PER_SHARD}", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def vae(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_vae(tmp_path_factory.mktemp("vae") / "vae", seed=0)


@pytest.fixture(scope="module")
def encoded(vae: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first COUNT digits encoded with `vae` (read-only: tests that change it work on a copy)."""
    out = tmp_path_factory.mktemp("latents") / "digits"
    encode(encode_args(vae, out))
    return out


def digits(count: int = COUNT) -> tuple[torch.Tensor, torch.Tensor]:
    data = DigitsSource().load(image_size=16, channels=1)
    return data.images[:count], data.labels[:count]


def test_encode_stores_the_vae_posterior_and_says_what_it_holds(vae: Path, encoded: Path) -> None:
    meta = LatentDataModule(root=str(encoded)).meta
    assert meta["count"] == COUNT and meta["shards"] == [f"latents-{i:06d}.tar" for i in range(4)]
    assert (meta["latent_shape"], meta["image_shape"], meta["num_classes"]) == ([2, 8, 8], [1, 16, 16], 10)
    assert meta["vae"] == str(vae.resolve()) and meta["vae_identity"] == folder_identity(vae)
    assert (meta["scaling_factor"], meta["shift_factor"]) == (0.18215, 0.0)  # AutoencoderKL's defaults
    assert meta["data"]["source"]["_target_"] == "ddpm.data.sources.DigitsSource" and meta["data"]["limit"] == COUNT
    with tarfile.open(encoded / meta["shards"][3]) as tar:  # a shard alone says what it holds
        names = tar.getnames()
    assert names[:4] == [HEADER, "00000192.mean.npy", "00000192.logvar.npy", "00000192.cls"] and len(names) == 25
    assert read_header(encoded / meta["shards"][3]) == {k: v for k, v in meta.items() if k not in ("count", "shards")
                                                        } | {"first": 192, "samples": 8}  # fmt: skip

    dm = LatentDataModule(root=str(encoded), val_size=1)
    dm.setup("fit")
    images, labels = digits()
    mean, logvar = VAE.load(vae).encode(images)
    moments = dm.train_set.images  # (N, 2c, h, w): every latent, RAM-preloaded
    assert moments.dtype == torch.float16 and moments.shape == (COUNT, 4, 8, 8)
    torch.testing.assert_close(moments.float(), torch.cat([mean, logvar], 1), atol=2e-3, rtol=1e-3)  # float16
    assert torch.equal(dm.labels, labels)
    assert latent_record(dm.meta["data"]) is None and latent_record({"_target_": "x.Y"}) is None
    record = latent_record({"_target_": "ddpm.data.latents.LatentDataModule", "root": str(encoded)})
    kept = ("vae", "vae_identity", "scaling_factor", "shift_factor", "latent_shape", "image_shape")
    assert record == dm.latent == {k: meta[k] for k in kept} | {"data": record["data"]}
    assert record["data"] == {
        k: v
        for k, v in meta["data"].items()
        if k not in ("batch_size", "num_workers", "pin_memory", "val_size", "split_seed", "hflip", "max_ram_fraction")
    }  # the images' keys
    assert record["data"]["source"] == meta["data"]["source"]  # sample.py's metrics read their reference there
    assert (dm.image_size, dm.channels, type(dm.source)) == (16, 1, DigitsSource)  # pixels, for FID


def test_a_rerun_skips_whole_shards_and_rewrites_a_torn_one(
    vae: Path, encoded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = shutil.copytree(encoded, tmp_path / "out")
    whole = {p.name: p.read_bytes() for p in out.iterdir()}
    torn = out / "latents-000001.tar"
    torn.write_bytes(whole[torn.name][: len(whole[torn.name]) // 2])
    (out / "meta.json").write_text("{")  # damaged (an interrupted encode leaves none: it is written last)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("latents-*.tar") if p != torn}
    encode(encode_args(vae, out))
    printed = capsys.readouterr()
    assert "encoded 64 images" in printed.out and f"{COUNT - 64} were encoded already" in printed.out
    assert f"rewriting {torn}" in printed.err and "torn" in printed.err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == whole  # the torn shard rewritten, meta.json back
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("latents-*.tar") if p != torn} == stamps  # untouched


def test_a_rerun_with_serving_keys_changed_and_the_vae_moved_encodes_nothing_again(
    vae: Path, encoded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """data.num_workers and data.val_size decide how batches are served, not which images are encoded, and a VAE
    copied to another folder is the same VAE (before: every shard was encoded again). A meta.json write killed
    midway leaves its temporary file, which the rerun removes (before: refused as a foreign file). The folder is
    then read through a data.root with `~` (before: meta.json was found, the shards were not)."""
    out = shutil.copytree(encoded, tmp_path / "out")
    moved = shutil.copytree(vae, tmp_path / "moved_vae")
    (out / ".meta.json.tmp-999999").write_text("{")  # no process 999999: a killed write's
    shards = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("latents-*.tar")}
    encode(encode_args(moved, out, "data.num_workers=2", "data.val_size=0.2"))
    assert "encoded 0 images" in capsys.readouterr().out
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("latents-*.tar")} == shards
    assert not list(out.glob(".*.tmp-*"))
    monkeypatch.setenv("HOME", str(tmp_path))
    for stream in (False, True):
        dm = LatentDataModule(root="~/out", val_size=8, batch_size=8, stream=stream)
        dm.setup("fit")
        assert next(iter(dm.train_dataloader()))[0].shape == (8, 4, 8, 8)  # moments: mean and logvar
    assert dm.meta["vae"] == str(moved.resolve()) and dm.meta["data"]["num_workers"] == 2


def test_an_out_of_another_vae_or_data_set_is_refused(vae: Path, encoded: Path, tmp_path: Path) -> None:
    other = save_vae(tmp_path / "other_vae", seed=1)
    out = shutil.copytree(encoded, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="holds latents of the VAE") as error:
        encode(encode_args(other, out))
    for name in (str(vae.resolve()), folder_identity(vae), str(other.resolve()), folder_identity(other)):
        assert name in str(error.value)
    (out / "meta.json").unlink()  # the shards alone say it too
    with pytest.raises(ValueError, match=r"holds latents of the data .*'limit': 200.*'limit': 100"):
        encode([*encode_args(vae, out), "data.limit=100"])
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "meta.json"} == {
        k: v for k, v in before.items() if k != "meta.json"}  # fmt: skip


def test_a_vae_folder_is_refused_unless_its_weights_fit_and_an_export_keeps_its_identity(
    vae: Path, tmp_path: Path
) -> None:
    """Before: a folder whose weight names did not fit (a prefix), or a UNet's folder, loaded with random weights in
    their place; the identity hashes every *.safetensors and *.bin, but an export copied only the .safetensors, so a
    folder holding both (as a hub snapshot does) refused its own export and a .bin-only VAE could not be exported."""
    from diffusers import AutoencoderKL, UNet2DModel
    from safetensors.torch import load_file, save_file

    from ddpm.weights.diffusers_folder import add_vae

    prefixed = shutil.copytree(vae, tmp_path / "prefixed")
    weights = prefixed / "diffusion_pytorch_model.safetensors"
    save_file({f"first_stage_model.{k}": v for k, v in load_file(weights).items()}, weights)
    with pytest.raises(ValueError, match=r"weights do not fit its config.json .*missing keys: .*unexpected keys"):
        VAE.load(prefixed)
    UNet2DModel(sample_size=8, block_out_channels=(8, 8), down_block_types=("DownBlock2D",) * 2,
                up_block_types=("UpBlock2D",) * 2, norm_num_groups=4).save_pretrained(tmp_path / "unet")  # fmt: skip
    with pytest.raises(ValueError, match="holds a diffusers UNet2DModel, not an AutoencoderKL"):
        VAE.load(tmp_path / "unet")
    (prefixed / weights.name).unlink()
    with pytest.raises(FileNotFoundError, match="holds no AutoencoderKL weights"):
        VAE.load(prefixed)

    pickled = tmp_path / "pickled"
    AutoencoderKL.from_pretrained(vae).save_pretrained(pickled, safe_serialization=False)  # .bin only
    both = shutil.copytree(vae, tmp_path / "both")
    shutil.copy(pickled / "diffusion_pytorch_model.bin", both)
    assert len({folder_identity(both), folder_identity(vae), folder_identity(pickled)}) == 3  # every weights file
    for source in (both, pickled):
        export = tmp_path / f"export_{source.name}"
        (export / "scheduler").mkdir(parents=True)
        (export / "model_index.json").write_text("{}")
        (export / "scheduler" / "scheduler_config.json").write_text("{}")
        add_vae(export, {"vae": str(source), "vae_identity": folder_identity(source)})
        assert VAE.load(export / "vae").identity == folder_identity(source)  # sample.py accepts its own export


def test_encode_settings_are_refused_naming_the_key(vae: Path, tmp_path: Path) -> None:
    out = f"out={tmp_path / 'out'}"
    refusals = {
        "vae is not set": [out],
        r"unknown key\(s\) \['samples'\]": [f"vae={vae}", out, "+samples=3"],
        "samples_per_shard=0 must be an integer >= 1": [f"vae={vae}", out, "samples_per_shard=0"],
        "device='tpu' must be auto, cpu or cuda": [f"vae={vae}", out, "device=tpu"],
        "data.channels=3 but the VAE .* encodes 1-channel images; set data.channels=1": [f"vae={vae}", out,
                                                                                          "data.channels=3"],
        "data.image_size: .*15 is not a multiple of the VAE's downsampling factor 2": [f"vae={vae}", out,
                                                                                       "data.image_size=15"],
        "data=latents is already encoded": [f"vae={vae}", out, "data=latents", "data.root=x"],
    }  # fmt: skip
    for message, args in refusals.items():
        with pytest.raises(ValueError, match=message):
            encode(args)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written


def encode_killed_after(shards: int, args: list[str]) -> None:
    """A forked process's target: the encode command in a process group of its own, whose writes SIGKILL the whole
    group (this process and its workers) once `shards` shards are whole, halfway into the next one's temporary
    file: where a kill at that instant leaves atomic_write (ddpm.atomic)."""
    from ddpm.data import latent_shards

    write = latent_shards.atomic_write_bytes

    def write_until_killed(path: Path, data: bytes) -> Path:
        if len(list(path.parent.glob("latents-*.tar"))) >= shards:
            path.with_name(f".{path.name}.tmp-{os.getpid()}").write_bytes(data[: len(data) // 2])
            os.killpg(0, signal.SIGKILL)
        return write(path, data)

    os.setsid()
    torch.set_num_threads(1)
    latent_shards.atomic_write_bytes = write_until_killed  # this process and the workers it forks
    encode(args)


@pytest.mark.slow
def test_an_interrupted_encode_is_finished_by_the_same_command(vae: Path, tmp_path: Path) -> None:
    """An encode with devices=2 worker processes, killed mid-run (SIGKILL to its whole process group); the same
    command, run again, writes the missing shards; the folder then equals an uninterrupted single-process
    encode's, byte for byte. The killed encode runs in a forked process: no second start-up of torch and diffusers."""
    args = [f"vae={vae}", "data.image_size=16", "data.limit=400", "samples_per_shard=8", "batch_size=1"]
    out = tmp_path / "killed"
    process = multiprocessing.get_context("fork").Process(
        target=encode_killed_after, args=(4, [*args, f"out={out}", "devices=2"])
    )
    process.start()
    process.join(timeout=300)
    written = sorted(p.name for p in out.glob("latents-*.tar"))
    assert process.exitcode == -signal.SIGKILL and 4 <= len(written) < 50, (process.exitcode, written)
    assert list(out.glob(".latents-*.tmp-*")) and not (out / "meta.json").exists()  # meta.json: written last
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker of the killed run: the same arithmetic, the same bytes
    try:
        encode([*args, f"out={out}"])
        encode([*args, f"out={tmp_path / 'whole'}"])
    finally:
        torch.set_num_threads(threads)
    files = {p.name: p.read_bytes() for p in out.iterdir()}  # the killed write's temporary file is gone
    assert len(files) == 51 and files == {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}


def test_ram_and_streamed_latents_give_the_same_samples(encoded: Path) -> None:
    ram = LatentDataModule(root=str(encoded), batch_size=19, val_size=0.05)
    stream = LatentDataModule(root=str(encoded), batch_size=19, val_size=0.05, stream=True, shuffle_buffer=50)
    ram.setup("fit")
    stream.setup("fit")

    def rows(loader) -> tuple[torch.Tensor, torch.Tensor]:
        batches = list(loader)
        return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])

    for split in ("val_dataloader", "train_dataloader"):
        (a, a_labels), (b, b_labels) = rows(getattr(ram, split)()), rows(getattr(stream, split)())
        assert len(a) == {"val_dataloader": 10, "train_dataloader": 190}[split]
        if split == "val_dataloader":  # one ordered pass: the same order
            assert torch.equal(a, b) and torch.equal(a_labels, b_labels)
        key = lambda m, y: sorted(zip(m.flatten(1).tolist(), y.tolist(), strict=True))  # noqa: E731
        assert key(a, a_labels) == key(b, b_labels)  # the same images, each once per epoch
    workers = LatentDataModule(root=str(encoded), batch_size=4, val_size=0.05, stream=True, num_workers=2)
    workers.setup("fit")  # two worker slots split the shards: still every validation image once
    assert key(*rows(workers.val_dataloader())) == key(*rows(ram.val_dataloader()))


def rewrite_shard(path: Path, keep: int, header: dict | None = None) -> None:
    """`path` with its first `keep` samples only, cut at a member boundary (a half-copied file), and `header`."""
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(path, "w") as tar:
        for member, data in members[: 1 + 3 * keep]:  # __meta__.json, then mean, logvar, cls per sample
            data = json.dumps(header).encode() if header is not None and member.name == HEADER else data
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


@pytest.mark.parametrize("stream", [False, True])
def test_a_torn_shard_or_one_of_another_vae_is_refused_streamed_as_preloaded(
    encoded: Path, tmp_path: Path, stream: bool
) -> None:
    """The preload checked every shard's header and count; the stream read a shard cut at a sample's end (13 of 16
    validation images, no error) and a shard of another VAE without a word."""
    from ddpm.data.latent_shards import LatentShardError

    for name, keep, change in [("torn", 5, {}), ("other", PER_SHARD, {"vae_identity": "another"})]:
        folder = shutil.copytree(encoded, tmp_path / f"{name}_{stream}")
        shard = folder / "latents-000001.tar"
        rewrite_shard(shard, keep, read_header(shard) | change)
        dm = LatentDataModule(root=str(folder), batch_size=8, val_size=0.05, stream=stream)
        with pytest.raises(LatentShardError, match=f"{shard} (holds 5 of its 64 samples|holds another encoding)"):
            dm.setup("fit")
            list(dm.train_dataloader())


def test_a_resumed_latent_stream_draws_a_fresh_order_from_every_shard(encoded: Path) -> None:
    """As for pixel shards (tests/test_webdataset.py): the order also depends on the step the fit starts at, so a
    resume does not replay the first epochs; the rank-1-of-2 slot draws from every shard, not only its part."""

    def first_epoch(global_step: int, rank: int = 0) -> list:
        dm = LatentDataModule(root=str(encoded), batch_size=5, val_size=0.05, stream=True, shuffle_buffer=0)
        dm.trainer = SimpleNamespace(global_step=global_step, world_size=2, global_rank=rank)
        dm.setup("fit")
        return [row.flatten().tolist() for moments, _ in dm.train_dataloader() for row in moments]

    assert first_epoch(0) == first_epoch(0) and first_epoch(300) != first_epoch(0)
    seen = {tuple(row) for step in range(0, 800, 100) for row in first_epoch(step)}  # rank 0's epochs: half the data
    assert len(seen) == 190  # every training latent, not only a fixed part of the shards


def test_latent_epochs_shorter_than_a_pass_go_on_where_the_last_one_stopped(encoded: Path) -> None:
    """As for pixel shards: epochs of 10 batches of 5 (a quarter of a pass) from one slot's stream, kept across
    epochs: 19 epochs hold the first 950 draws, 5 whole passes, so every training latent comes 5 times (each epoch
    began a new pass before: only the first 50 of every pass's order)."""
    dm = LatentDataModule(root=str(encoded), batch_size=5, val_size=0.05, stream=True, shuffle_buffer=0)
    dm.setup("fit")
    dm.train_set.batches_per_epoch = 10
    counts: dict[tuple, int] = {}
    for _ in range(19):
        for moments, _ in dm.train_dataloader():
            for row in moments:
                counts[tuple(row.flatten().tolist())] = counts.get(tuple(row.flatten().tolist()), 0) + 1
    assert len(counts) == 190 and set(counts.values()) == {5}


def test_batches_are_posterior_samples_on_the_device(encoded: Path) -> None:
    dm = LatentDataModule(root=str(encoded), batch_size=8)
    dm.setup("fit")
    moments, labels = next(iter(dm.train_dataloader()))
    mean, logvar = moments.float().chunk(2, dim=1)
    vae = SimpleNamespace(scale=dm.meta["scaling_factor"], shift=dm.meta["shift_factor"])
    torch.manual_seed(3)
    z, y = dm.on_after_batch_transfer((moments, labels), 0)  # no trainer: training
    torch.manual_seed(3)
    expected = VAE.to_diffusion(vae, mean, logvar, torch.randn_like(mean))  # the VAE's own formula
    assert z.dtype == torch.float32 and z.shape == (8, 2, 8, 8) and y is labels
    torch.testing.assert_close(z, expected)
    assert not torch.allclose(z, VAE.to_diffusion(vae, mean, logvar))  # a sample, not the mean
    dm.trainer = SimpleNamespace(training=False)  # validation: the posterior mean, noise-free
    torch.testing.assert_close(dm.on_after_batch_transfer((moments, labels), 0)[0], VAE.to_diffusion(vae, mean, logvar))


def test_a_model_of_another_shape_is_refused_naming_both(encoded: Path) -> None:
    dm = LatentDataModule(root=str(encoded))
    dm.check_model(in_channels=2, image_size=8)
    for in_channels, image_size in ((1, 16), (2, 16), (4, 8)):
        with pytest.raises(ValueError, match="are 2x8x8") as error:
            dm.check_model(in_channels=in_channels, image_size=image_size)
        message = str(error.value)
        assert f"model.in_channels={in_channels} and model.image_size={image_size}" in message
        assert "set model.in_channels=2 model.image_size=8" in message
    with pytest.raises(FileNotFoundError, match=r"data.root=.* has no meta.json: not an encoded folder"):
        LatentDataModule(root=str(encoded.parent / "nothing"))


def test_labels_are_checked_and_bad_images_refused_by_name(vae: Path, encoded: Path, tmp_path: Path) -> None:
    dm = LatentDataModule(root=str(encoded))
    dm.setup("fit")
    dm.check_labels(10)
    dm.check_labels(None)
    with pytest.raises(ValueError, match=r"have labels outside 0..4.*span \[0, 9\].*set model.num_classes=10"):
        dm.check_labels(5)
    streamed = LatentDataModule(root=str(encoded), stream=True)
    streamed.setup("fit")
    with pytest.raises(ValueError, match="hold 10 classes"):
        streamed.check_labels(5)

    images, _ = digits(8)  # an unlabelled image folder: labels -1, refused for a conditional model
    root = tmp_path / "folder"
    write_shards(images, torch.zeros(8), tmp_path / "pngs", samples_per_shard=8)
    (root / "a").mkdir(parents=True)
    with tarfile.open(tmp_path / "pngs" / "shard-000000.tar") as tar:
        tar.extractall(root / "a", filter="data")
    for label in (root / "a").glob("*.cls"):
        label.unlink()
    folder = ["data=image_folder", f"data.root={root}", "data.source.conditional=false"]
    encode([f"vae={vae}", f"out={tmp_path / 'unlabelled'}", "data.image_size=16", *folder])
    unlabelled = LatentDataModule(root=str(tmp_path / "unlabelled"), val_size=1, batch_size=4)
    unlabelled.setup("fit")
    assert unlabelled.num_classes is None and unlabelled.labels.tolist() == [-1] * 8
    unlabelled.check_labels(None)
    with pytest.raises(ValueError, match="has no labels"):
        unlabelled.check_labels(10)

    (root / "a" / "00000003.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=f"{root / 'a' / '00000003.png'} is not a readable image"):
        encode([f"vae={vae}", f"out={tmp_path / 'bad'}", "data.image_size=16", *folder])


@pytest.mark.slow
def test_streamed_pixel_shards_encode_as_their_source(vae: Path, encoded: Path, tmp_path: Path) -> None:
    images, labels = digits()
    paths = write_shards(images, labels, tmp_path / "pngs", samples_per_shard=50)
    urls = f"data.urls=[{','.join(str(p) for p in paths)}]"
    out = tmp_path / "from_shards"
    encode([f"vae={vae}", f"out={out}", "data=webdataset", urls, "data.image_size=16",
            f"samples_per_shard={PER_SHARD}", "data.num_classes=10"])  # fmt: skip
    from_shards, from_source = LatentDataModule(root=str(out)), LatentDataModule(root=str(encoded))
    for dm in (from_shards, from_source):
        dm.setup("fit")
    assert from_shards.meta["count"] == COUNT and from_shards.source is None  # no pixel source to rebuild
    from ddpm.callbacks.fid import FID
    from ddpm.diffusion.samplers.ddim import DDIMSampler

    trainer = SimpleNamespace(datamodule=from_shards)  # callbacks.fid on such latents: refused, naming why
    with pytest.raises(ValueError, match=r"this run.s data has no source .*leave callbacks.fid out"):
        FID(sampler=DDIMSampler(steps=2)).on_fit_start(trainer, None)  # before: AttributeError on None
    torch.testing.assert_close(from_shards.train_set.images, from_source.train_set.images)
    assert torch.equal(from_shards.labels, from_source.labels)

    with tarfile.open(paths[1], "a") as tar:  # a sample whose image is damaged: refused naming shard and key
        info = tarfile.TarInfo("99999999.png")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
        info = tarfile.TarInfo("99999999.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(ValueError, match=rf"shard {paths[1]}, sample '99999999': image 99999999.png is not a readable"):
        encode([f"vae={vae}", f"out={tmp_path / 'bad'}", "data=webdataset", urls, "data.image_size=16"])
    with tarfile.open(paths[2]) as tar:
        cut = tar.getmembers()[20].offset  # after 10 samples: such a shard was encoded short, silently
    paths[2].write_bytes(paths[2].read_bytes()[:cut])
    with pytest.raises(ValueError, match=rf"shard {paths[2]} cannot be read after sample .*end-of-archive marker"):
        encode([f"vae={vae}", f"out={tmp_path / 'cut'}", "data=webdataset", urls, "data.image_size=16"])


def test_latents_beyond_float16_are_refused_before_a_shard_is_written(tmp_path: Path) -> None:
    """A VAE whose means pass 65504 (its quant_conv scaled up): the encode stored inf and reported success; the
    diffusion's loss was NaN from the first step."""
    folder = save_vae(tmp_path / "loud", seed=0)
    vae = VAE.load(folder)
    with torch.no_grad():
        vae.autoencoder.quant_conv.weight.mul_(1e7)
    vae.autoencoder.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"posterior means of magnitude up to .* not finite in float16"):
        encode(encode_args(folder, tmp_path / "out"))
    assert not list((tmp_path / "out").glob("latents-*.tar"))


def test_a_bf16_vae_encodes_and_decodes() -> None:
    """A VAE trained with trainer.precision=bf16-true has bf16 weights (its run's exports encode the scaling
    images with it): encode casts its input as decode does (before: float32 input against bf16 weights)."""
    vae = VAE.from_config(TINY_VAE)
    vae.autoencoder.to(torch.bfloat16)
    mean, logvar = vae.encode(digits(4)[0])
    assert mean.dtype == torch.float32 and mean.shape == (4, 2, 8, 8)
    assert vae.decode(vae.to_diffusion(mean, logvar)).shape == (4, 1, 16, 16)


def test_an_image_folder_is_encoded_in_a_shuffled_order_decoding_only_the_shards_it_writes(
    vae: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Class sub-folders list the images class by class: in that order each shard held one class, and streamed
    latents (a shuffle buffer of about a shard) gave batches of a few classes. The folder was also decoded whole
    into RAM before the first shard, and again by a rerun that had nothing left to encode."""
    from PIL import Image

    from ddpm.data.image_folder import ImageFolderSource
    from ddpm.data.latent_shards import read_shard

    images, labels = digits(120)
    root = tmp_path / "folder"
    for i, (image, label) in enumerate(zip(images, labels.tolist(), strict=True)):
        (root / f"class_{label}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0].numpy()).save(root / f"class_{label}" / f"{i:04d}.png")
    decoded = []
    real_decode = ImageFolderSource.decode
    monkeypatch.setattr(ImageFolderSource, "decode", lambda self, files, **kw: decoded.append(len(files)) or
                        real_decode(self, files, **kw))  # fmt: skip
    args = [f"vae={vae}", f"out={tmp_path / 'out'}", "data=image_folder", f"data.root={root}", "data.image_size=16",
            "data.channels=1", "samples_per_shard=24"]  # fmt: skip
    with pytest.warns(UserWarning, match=r"data.hflip=true: the latents are of the images as they are"):
        meta = encode(args)  # image_folder's default flips: not in the latents
    assert meta["order"] == "shuffled (seed 0)" and meta["count"] == 120 and decoded == [24] * 5
    shards = [read_shard(path, read_header(path)) for path in (tmp_path / "out" / name for name in meta["shards"])]
    assert all(len(set(shard[1].tolist())) >= 6 for shard in shards)  # 24 images of 10 classes each
    mean = torch.cat([shard[0][:, :2] for shard in shards]).float()  # the folder's images, each once, in a new order
    theirs, _ = VAE.load(vae).encode(images)
    match = torch.cdist(mean.flatten(1), theirs.flatten(1)).argmin(1)
    assert sorted(match.tolist()) == list(range(120)) and match.tolist() != list(range(120))
    assert torch.equal(torch.cat([shard[1] for shard in shards]), labels[match])
    decoded.clear()
    encode([*args, "data.hflip=false"])
    assert decoded == [] and "encoded 0 images" in capsys.readouterr().out
    next(root.glob("class_0/*.png")).unlink()  # as an unreadable image's refusal advises: 119 files, another order
    with pytest.raises(ValueError, match=r"holds another encoding \(files: '120 files, sha256 \w+' there, '119 files"):
        encode([*args, "data.hflip=false"])  # it skipped the old order's shards: images twice, others lost
    monkeypatch.setenv("HOME", str(tmp_path))  # a root under ~ (the files come expanded): listed as well
    assert (
        encode([*args[:1], f"out={tmp_path / 'home'}", *args[2:3], "data.root='~/folder'", *args[4:]])["count"] == 119
    )
