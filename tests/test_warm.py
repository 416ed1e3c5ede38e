"""tests/warm.py: a command forked from the warm server is the command exec'd (same files, bytes and status)."""

import hashlib
from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN, run
from warm import eligible


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_forked_run_writes_what_an_execd_run_writes(tmp_path: Path) -> None:
    """The same tiny train.py run, exec'd (DDPM_TESTS_EXEC=1) and forked: the same EMA weights bit for bit, the same
    samples from sample.py, the same messages in train.log (each shown once on the console); a bad value exits 1
    naming the key, in train.log too."""
    weights, samples, logs = {}, {}, {}
    for how, extra in (("exec", {"DDPM_TESTS_EXEC": "1"}), ("warm", {})):
        argv = ["python", "train.py", *TINY_RUN, f"hydra.run.dir={tmp_path / how}"]
        assert eligible(argv, extra) == (how == "warm")
        shown = run(*argv, extra_env=extra)
        assert (shown.stdout + shown.stderr).count("`Trainer.fit` stopped") == 1, shown.stderr[-2000:]
        assert "litlogger" not in shown.stdout + shown.stderr + (tmp_path / how / "train.log").read_text()  # the ad
        logs[how] = [line.split("] - ", 1)[1] for line in (tmp_path / how / "train.log").read_text().splitlines()
                     if "] - " in line and "[py.warnings]" not in line]  # fmt: skip  # without times; warnings: once
        weights[how] = torch.load(tmp_path / how / "ema.pt", map_location="cpu", weights_only=True)["ema_state_dict"]
        sampled = tmp_path / how / "samples"
        run("python", "sample.py", f"ckpt={tmp_path / how / 'ema.pt'}", "num_samples=4", "sampler.steps=3",
            f"output_dir={sampled}", extra_env=extra)  # fmt: skip
        samples[how] = digest(sampled / "samples.npz")
    bad = run("python", "train.py", "data.limit=0", f"hydra.run.dir={tmp_path / 'bad'}", check=False)
    assert bad.returncode == 1 and "data.limit=0" in bad.stderr, bad.stderr[-2000:]  # as exec'd: the key, status 1
    assert "data.limit=0" in (tmp_path / "bad" / "train.log").read_text().split("[ddpm][ERROR] - failed: ")[1]
    assert logs["exec"] == [line.replace(str(tmp_path / "warm"), str(tmp_path / "exec")) for line in logs["warm"]]
    assert logs["exec"][0] == "Seed set to 42" and "`Trainer.fit` stopped: `max_steps=" in logs["exec"][-2], logs
    assert logs["exec"][-1] == f"EMA weights: {tmp_path / 'exec' / 'ema.pt'} (and ema.safetensors)", logs  # ours
    assert weights["exec"].keys() == weights["warm"].keys() and samples["exec"] == samples["warm"]
    assert all(torch.equal(value, weights["warm"][key]) for key, value in weights["exec"].items())


@pytest.mark.parametrize(
    ("argv", "changed", "forked"),
    [
        (["python", "train.py", "trainer.max_steps=2"], {}, True),
        (["python", "-m", "ddpm.export", "ckpt=x"], {"WANDB_MODE": "offline"}, True),
        (["python", "train.py", "trainer.devices=1", "trainer.strategy=auto", "trainer.accelerator=cpu"], {}, True),
        (["python", "train.py", "trainer.devices=2"], {}, False),
        (["python", "train.py", "trainer=ddp", "trainer.devices=2"], {}, False),  # Lightning re-launches sys.argv
        (["python", "train.py", "-m", "hydra/launcher=submitit_local"], {}, False),
        (["python", "train.py"], {"OMP_NUM_THREADS": "2"}, False),  # read when torch is imported
        (["python", "train.py"], {"PYTHONPATH": "/elsewhere"}, False),
        (["python", "-c", "print(1)"], {}, False),
        (["python", "benchmarks/throughput.py", "--smoke"], {}, False),
    ],
)
def test_only_single_process_entry_points_with_a_runtime_environment_are_forked(argv, changed, forked) -> None:
    assert eligible(argv, changed) is forked
