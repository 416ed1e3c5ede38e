"""benchmarks/gpu.py, issue 35's prepared GPU command, on CPU: its --smoke runs every kind of row (our Trainer, the
bare loop, diffusers' UNet2DModel, a preset without one; float32, bf16, a compile mode), the profile and the sampling
part, and writes the JSON the docs describe, and nothing else, into the folder it is given; the deadline skips parts
and still writes one; the GPU profile's arithmetic on known events; the wrapper installs the carried wheels and puts
them and src/ on the path; `make gpu-wheels` pins what pyproject.toml pins."""

import json
import re
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from helpers import REPO, run

SMOKE_GROUPS = [  # every kind of row, in two groups: one with a UNet2DModel twin, one without
    "ddpm_cifar10@128=ours:fp32,bare:fp32,ours:bf16,bare:bf16,diffusers:bf16,ours:bf16+default,bare:bf16+default",
    "seed_mnist@64=ours:bf16,diffusers:bf16",
]
GOALS = {"cifar10_trainer_bf16_images_per_s", "trainer_vs_bare", "trainer_vs_diffusers", "seed_mnist_epoch_s",
         "sampling_50k_s"}  # fmt: skip


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("gpu") / "out"
    groups = [arg for group in SMOKE_GROUPS for arg in ("--group", group)]
    result = run("python", "benchmarks/gpu.py", out, "--smoke", *groups, "--profile-group", "ddpm_cifar10@128",
                 timeout=300)  # fmt: skip
    return json.loads((out / "gpu.json").read_text()), result.stdout, out


@pytest.mark.slow
def test_smoke_measures_every_kind_of_row_and_writes_only_its_json_and_trace(smoke: tuple[dict, str, Path]) -> None:
    report, _, out = smoke
    assert sorted(p.name for p in out.iterdir()) == ["gpu.json", "profile_trace.json.gz"]  # scratch went elsewhere
    assert report["complete"] and report["provenance"]["smoke"] and not report["errors"] and not report["skipped"]
    assert report["plan"] == ["ddpm_cifar10@2", "seed_mnist@1"]  # --smoke: batches / 64
    cifar, seed = report["groups"]
    rows = {r["row"]: r for r in cifar["rows"]}
    assert list(rows) == SMOKE_GROUPS[0].split("=")[1].split(",")
    for name, r in rows.items():
        assert r["images_per_s"] > 0 and r["images_per_s"] * r["ms_per_step"] / 1e3 == pytest.approx(2), name
        assert r["precision"] == ("32-true" if "fp32" in name else "bf16-mixed"), name
        assert (r["compile"], r["compile_s"] is not None) == (("default", True) if "+" in name else (None, False))
        assert r["peak_memory_mib"] is None and r["mfu"] is None and r["flops_per_step"] > 0  # no GPU here
    for key, ratio in cifar["ratios"].items():  # one repeat: the paired ratio is the ratio of the two rows
        ours, other = key.split(" / ")
        assert ratio["median"] == pytest.approx(rows[ours]["images_per_s"] / rows[other]["images_per_s"]), key
    assert set(cifar["ratios"]) == {
        "ours:fp32 / bare:fp32",
        "ours:bf16 / bare:bf16",
        "ours:bf16 / diffusers:bf16",
        "ours:bf16+default / bare:bf16+default",
        "ours:bf16+default / ours:bf16",
    }
    assert cifar["dynamo"] == {"graphs": 1, "graph_breaks": 0}  # the bare compiled row reused the Trainer's graph
    (twinless,) = [r for r in seed["rows"] if r["row"] == "diffusers:bf16"]
    assert "no UNet2DModel twin" in twinless["skipped"] and "downsample" in twinless["skipped"]


@pytest.mark.slow
def test_smoke_profiles_samples_and_states_the_goals(smoke: tuple[dict, str, Path]) -> None:
    report, stdout, _ = smoke
    cifar, seed = report["groups"]
    profile, ours = cifar["profile"], {r["row"]: r for r in cifar["rows"] if r["runner"] == "ours"}
    assert profile["row"] == max(ours, key=lambda name: ours[name]["images_per_s"])
    assert 1 <= len(profile["top"]) <= 15 and profile["events"] > 0 and profile["trace"] == "profile_trace.json.gz"
    assert all(k["calls"] >= 1 and k["total_us"] >= 0 for k in profile["top"])
    sampled = report["sampling"]
    assert (sampled["images"], sampled["batch_size"], sampled["sampler"]["steps"]) == (4, 2, 2)
    assert sampled["sampler"]["_target_"].endswith("DPMSolverSDESampler")  # sample.py's default
    assert sampled["s_per_50k"] == pytest.approx(50_000 / sampled["images_per_s"])
    goals = report["goals"]
    assert set(goals) == GOALS and all(g["value"] is not None for g in goals.values()), goals
    best_bf16 = max(r["images_per_s"] for r in ours.values() if r["precision"] == "bf16-mixed")
    assert goals["cifar10_trainer_bf16_images_per_s"]["value"] == best_bf16
    seed_ours = next(r for r in seed["rows"] if r["row"] == "ours:bf16")
    assert goals["seed_mnist_epoch_s"]["value"] == pytest.approx(60_000 / seed_ours["images_per_s"])
    assert goals["trainer_vs_bare"]["value"] == min(v["median"] for k, v in cifar["ratios"].items() if "/ bare" in k)
    assert stdout.rstrip().splitlines()[-1].startswith("goal: 50,000 unguided")  # the table comes last


def gpu_module(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu

    return gpu


def test_a_passed_deadline_skips_every_part_and_still_writes_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    gpu = gpu_module(monkeypatch)
    report = gpu.main([str(tmp_path), "--smoke", "--deadline-s", "0", "--group", SMOKE_GROUPS[0]])
    written = json.loads((tmp_path / "gpu.json").read_text())
    assert written["complete"] and written["groups"][0]["rows"] == report["groups"][0]["rows"]
    assert all(r["skipped"].startswith("deadline: ") for r in written["groups"][0]["rows"])
    assert written["sampling"] == {"skipped": "deadline"}
    assert all(g["value"] is None and g["met"] is None for g in written["goals"].values())
    assert not written["skipped"]  # no row was built, so no repeat was left out
    assert "not measured" in capsys.readouterr().out.rstrip().splitlines()[-1]


def test_a_group_is_refused_naming_the_form(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = gpu_module(monkeypatch)
    for bad in ("cifar@128=ours:fp32", "unet64@64=peer:bf16", "unet64@64=ours", "unet64=ours:fp32"):
        with pytest.raises(ValueError, match=r"MODEL@BATCH=RUNNER:SETTING|runners are ours, bare and diffusers"):
            gpu.parse_plan([bad])
    for bad in ("unet64@64=ours:fp16", "unet64@64=ours:bf16+nchw+nhwc", "unet64@64=ours:bf16+default+max-autotune"):
        with pytest.raises(ValueError, match=r"fp32 or bf16, then \+<compile mode> and/or \+nchw or \+nhwc"):
            gpu.parse_plan([bad])
    with pytest.raises(ValueError, match=r"compile='nhcw' must be true, false, auto or one of"):
        gpu.parse_plan(["unet64@64=ours:bf16+nhcw"])  # a mistyped layout word is no compile mode either
    (row,) = gpu.parse_plan(["unet64@64=ours:bf16+reduce-overhead"])[0][2].values()
    assert (row.runner, row.precision, row.compile, row.tf32) == ("product", "bf16", "reduce-overhead", None)
    assert row.channels_last is False  # train.py's default layout, NCHW
    (row,) = gpu.parse_plan(["unet64@64=bare:bf16+default+nhwc"])[0][2].values()
    assert (row.runner, row.compile, row.channels_last) == ("bare", "default", True)


def test_a_layout_row_is_paired_with_the_same_setting_in_the_default_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = gpu_module(monkeypatch)
    rows = {"ours:bf16": {"images_per_s_runs": [100.0, 200.0]}, "ours:bf16+nhwc": {"images_per_s_runs": [80.0, 220.0]},
            "ours:bf16+default+nhwc": {"images_per_s_runs": [300.0, 300.0]}}  # fmt: skip
    found = gpu.ratios(rows)
    assert found["ours:bf16+nhwc / ours:bf16"]["runs"] == pytest.approx([0.8, 1.1])  # paired per repeat
    assert found["ours:bf16+default+nhwc / ours:bf16"]["runs"] == pytest.approx([3.0, 1.5])  # compiled / eager
    assert set(found) == {"ours:bf16+nhwc / ours:bf16", "ours:bf16+default+nhwc / ours:bf16"}  # no compiled twin


class Event:
    """A kineto event as the profile summary reads it."""

    def __init__(self, name: str, device: str, start_us: int, end_us: int, annotation: bool = False) -> None:
        import torch

        self._name, self._start, self._end, self._annotation = name, start_us * 1000, end_us * 1000, annotation
        self._device = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU

    def name(self) -> str:
        return self._name

    def device_type(self):
        return self._device

    def start_ns(self) -> int:
        return self._start

    def end_ns(self) -> int:
        return self._end

    def is_user_annotation(self) -> bool:
        return self._annotation


def test_the_profile_summary_ranks_kernels_counts_launches_and_the_idle_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from gpu import kernel_summary

    events = [Event("aten::mm", "cpu", 0, 100), *[Event("cudaLaunchKernel", "cpu", i, i + 1) for i in (1, 2, 3)],
              Event("cudaGraphLaunch", "cpu", 5, 6), Event("kernA", "cuda", 10, 30), Event("kernB", "cuda", 25, 45),
              Event("kernA", "cuda", 40, 50), Event("Memcpy HtoD (Pinned -> Device)", "cuda", 60, 70),
              Event("Event Sync", "cuda", 70, 90),
              Event("Optimizer.step#AdamW.step", "cuda", 0, 100, annotation=True)]  # fmt: skip  # the step's range
    summary = kernel_summary(events)
    assert [(k["name"], k["calls"], k["total_us"]) for k in summary["top"]] == [("kernA", 2, 30), ("kernB", 1, 20)]
    assert (summary["kernels_run"], summary["kernel_launches"], summary["graph_launches"]) == (3, 3, 1)
    # busy: kernels cover 10-50 us (overlaps counted once), the copy 60-70; the sync is a wait and the
    # record_function range (on the GPU's timeline in a real trace) no kernel: 50 of 100 us
    assert summary["gpu_busy_s"] == pytest.approx(50e-6) and summary["gpu_idle_share"] == pytest.approx(0.5)


def fake_wheel(folder: Path) -> None:
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "fakegpu-0.1-py3-none-any.whl", "w") as wheel:
        wheel.writestr("fakegpu/__init__.py", "VALUE = 42\n")
        wheel.writestr("fakegpu-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakegpu\nVersion: 0.1\n")
        wheel.writestr("fakegpu-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                       "Tag: py3-none-any\n")  # fmt: skip
        wheel.writestr("fakegpu-0.1.dist-info/RECORD", "")


def test_the_wrapper_installs_the_wheels_and_runs_gpu_py_on_them_and_src(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "src").mkdir()
    (tree / "benchmarks" / "gpu.sh").write_text((REPO / "benchmarks" / "gpu.sh").read_text())
    (tree / "benchmarks" / "gpu.py").write_text(
        "import json, os, sys\nimport fakegpu\n"
        "print(json.dumps({'argv': sys.argv[1:], 'path': os.environ['PYTHONPATH'], 'value': fakegpu.VALUE}))\n"
    )
    wrapper, env = str(tree / "benchmarks" / "gpu.sh"), {"GPU_SITE": str(tmp_path / "site"), "PYTHON": sys.executable}
    missing = run("bash", wrapper, tmp_path / "out", check=False, extra_env=env)
    assert missing.returncode == 2 and "run 'make gpu-wheels'" in missing.stderr
    fake_wheel(tree / ".whl")
    result = run("bash", wrapper, tmp_path / "out", "--window-s", "1", extra_env=env)
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    assert shown["argv"] == [str(tmp_path / "out"), "--allow-dirty", "--window-s", "1"] and shown["value"] == 42
    assert shown["path"].split(":")[:2] == [str(tmp_path / "site"), str(tree / "src")]
    assert (tmp_path / "out" / "gpu.log").read_text() == result.stdout


def test_make_gpu_wheels_pins_what_pyproject_pins() -> None:
    make = (REPO / "Makefile").read_text().replace("\\\n", " ")
    named = dict(re.findall(r"([A-Za-z0-9_.-]+)==([\w.]+)", " ".join(re.findall(r"^GPU_(?:WHEELS|SDISTS) :=(.*)$",
                                                                                  make, re.M))))  # fmt: skip
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "pydantic", "diffusers"} <= set(named), named
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = [p for group in [project["dependencies"], *project["optional-dependencies"].values()] for p in group]
    pinned = dict(p.split("==") for p in pins if "==" in p)
    assert {n: v for n, v in named.items() if n in pinned} == {n: pinned[n] for n in named if n in pinned}
