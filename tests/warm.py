"""`python train.py ...` for the tests without paying its imports every time: a fork of a warm process.

On these 2 cores a tiny `python train.py` run costs about 10 s of CPU, 6 of them importing Lightning (torchmetrics,
torchvision, dynamo, scipy), and the suite starts about a hundred of them. `run(argv, ...)` sends the command to
one server per pytest process (`python tests/warm.py`, started on first use with the tests' environment), which
has imported what train.py and sample.py import, and forks a child per command. The child takes the command's
working directory, environment, argv, stdin (/dev/null) and output files, runs the script (or `-m` module) as
`__main__` through runpy as `python script` does, runs the atexit handlers and exits with the script's status (a
signal: -signum, as subprocess reports it). The server never runs a command itself: every child starts from the
same freshly imported state, and one command's state never reaches the next.

`eligible(argv, changed)` says which commands may run so: `python train.py`, `python sample.py` and `python -m
ddpm.<module>`; not multi-process runs (DDP re-launches sys.argv; launchers); not where the environment differs from
the server's in a key read at start-up or import (IMPORT_TIME: PYTHONPATH, OMP_NUM_THREADS, TORCH*, ...). The child
gets the command's whole environment, so keys read at run time (W&B, Hydra, PL_GLOBAL_SEED) act as when exec'd.
Everything else (tests/test_docs_commands.py runs the documented commands with shell syntax, make and the
benchmark scripts through bash) and, with DDPM_TESTS_EXEC=1, every command is exec'd.
"""

import atexit
import json
import os
import queue
import re
import runpy
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

# environment read while Python starts or a library is imported: a command changing one is exec'd
IMPORT_TIME = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "HF_",
               "DIFFUSERS_", "LIGHTNING_", "TMPDIR")  # fmt: skip
SINGLE = {"trainer.devices": ("1", "auto"), "trainer.strategy": ("auto",), "trainer.num_nodes": ("1",)}


def eligible(argv: Sequence[str], changed: Mapping[str, str]) -> bool:
    """May `argv` (["python", ...]) run as a fork of the server, its environment differing in `changed`?"""
    if (
        "1" in (os.environ.get("DDPM_TESTS_EXEC"), changed.get("DDPM_TESTS_EXEC"))
        or len(argv) < 2
        or argv[0] != "python"
    ):
        return False
    entry = argv[1] in ("train.py", "sample.py") or (argv[1] == "-m" and argv[2].startswith("ddpm."))
    values = dict(a.split("=", 1) for a in argv if "=" in a)
    multi = (
        "trainer" in values
        or "hydra/launcher" in values
        or any(  # trainer=ddp; launchers start processes
            values.get(key, ok[0]) not in ok for key, ok in SINGLE.items()
        )
    )
    return entry and not multi and not any(k.startswith(IMPORT_TIME) for k in changed)


class Server:
    """The pytest process's side: one server, one command at a time."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=self.env, text=True, bufsize=1)  # fmt: skip
        self.lock = threading.Lock()

    def run(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float, folder: Path
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        out, err = folder / "stdout", folder / "stderr"
        request = {"argv": list(argv), "cwd": str(cwd), "env": dict(env), "stdout": str(out), "stderr": str(err)}
        with self.lock:
            assert self.process.stdin is not None and self.process.stdout is not None
            self.process.stdin.write(json.dumps(request) + "\n")
            pid = json.loads(self.process.stdout.readline())["pid"]
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:
                os.killpg(pid, signal.SIGKILL)  # the child leads its own group: its DataLoader workers die with it
            status = json.loads(self.process.stdout.readline())["status"]
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if not ready:
            raise subprocess.TimeoutExpired(list(argv), timeout, stdout, stderr)
        return subprocess.CompletedProcess(list(argv), status, stdout, stderr)


def plain(line: str) -> list[str]:
    """A command line's words where it is one `python ...` command without shell syntax, else []."""
    return shlex.split(line) if re.fullmatch(r"python [^|&;<>$`\\*?]+", line) else []


class Pool:
    """Servers for commands run from several threads at once: one per thread in use, each started on first need
    (and again if it died)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env, self.idle, self.started = dict(env), queue.Queue(), []

    def run(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        try:
            server = self.idle.get_nowait()
        except queue.Empty:
            server = None
        if server is None or server.process.poll() is not None:  # none idle, or it died: a new one
            server = Server(self.env)
            self.started.append(server)
        try:
            with tempfile.TemporaryDirectory(prefix="warm-") as folder:
                return server.run(argv, cwd=cwd, env=env, timeout=timeout, folder=Path(folder))
        finally:
            self.idle.put(server)

    def close(self) -> None:
        for server in self.started:
            if server.process.poll() is None:
                server.process.stdin.close()
                server.process.wait(timeout=30)


def child(request: dict) -> None:
    """In the fork: become `python <argv>` in the request's folder and environment, run it, exit with its status."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
        opened = os.open(path, flags | (os.O_TRUNC if fd else 0), 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = request["argv"][1:]
    status = 0
    try:
        if args[0] == "-m":
            sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args[0])
            sys.argv, sys.path[0] = [args[0], *args[1:]], os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code is not None and not isinstance(done.code, int):
            print(done.code, file=sys.stderr)
        status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # as the interpreter does: the traceback on stderr, status 1
        traceback.print_exc()
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve() -> None:
    """Import what the entry points import, then fork one child per request line; report its pid and status."""
    import hydra  # noqa: F401

    import ddpm.sampling
    import ddpm.training  # noqa: F401

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing a child prints can reach the replies
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        replies.write(json.dumps({"status": code}) + "\n")


if __name__ == "__main__":
    serve()
