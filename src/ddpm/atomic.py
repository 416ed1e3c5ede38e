"""Writes that are whole or absent: a temporary file in the target's folder, fsync, then rename over it.

A process killed at any instant leaves the old file or the new one, never a torn file, and no temporary
file is left behind. Any failure of the write itself is re-raised as `WriteError` (an OSError) naming the
path, the bytes written so far, the free space and what to do: torch's zip writer reports a full disk or a
file-size limit as a RuntimeError ("unexpected pos ..."), which is an OSError underneath.

`atomic_folder` does the same for a folder of files (an export): they are written into a hidden folder beside
the target, fsync'ed, and the two folders swap names (renameat2's RENAME_EXCHANGE, Linux 3.15+; see
renameat2(2)), so the previous folder stays whole until the new one is, and the target name never goes
missing. Where the filesystem cannot swap, the old folder is renamed aside (`.<name>.old-<host>-<pid>`) and the
new one renamed in: a process killed between those two renames leaves no folder under the name, with the old
one whole beside it, and the next write renames it back first. Leftovers of killed writes (hidden
`.<name>.tmp-*` / `.old-*` folders of this host whose process is gone) are removed by the next write.
"""

import ctypes
import errno
import json
import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch


class WriteError(OSError):
    """A file could not be written (full disk, size limit, permissions); the previous file is intact."""


def _megabytes(count: int | None) -> str:
    return "unknown" if count is None else f"{count / 1e6:,.1f} MB"


def _describe_failure(path: Path, tmp: Path, error: BaseException, size: int | None) -> WriteError:
    written = tmp.stat().st_size if tmp.exists() else 0
    try:
        free: int | None = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    code = getattr(error, "errno", None) or errno.EIO
    cause = getattr(error, "strerror", None) or str(error).splitlines()[0][:200]
    kept = "The previous file there is intact." if path.exists() else "No file of that name was there before."
    after = ("; a run that took its last step needs no resume: sample.py and python -m ddpm.export read the EMA "
             "weights from its checkpoints/last.ckpt" if path.name.startswith("ema.") else "")  # fmt: skip
    return WriteError(
        code,
        f"could not write {path} ({cause}): it needs about {_megabytes(size)}, {_megabytes(written)} were written "
        f"before the failure and {_megabytes(free)} are free on its disk (a file-size limit, `ulimit -f`, also "
        f"stops writes). {kept} Free disk space or write elsewhere (callbacks.checkpoint.dirpath for checkpoints, "
        f"hydra.run.dir for a run), then resume with ckpt_path=<run dir>{after}",
    )


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, size: int | None = None) -> Path:
    """Call `write(file)` on a temporary file in the same folder, fsync, then rename: never a torn file.
    `size`: about how many bytes `write` writes (for the error message)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:  # RuntimeError: torch's zip writer on a full disk or size limit
        if isinstance(error, RuntimeError) and not _is_write_failure(error):
            raise
        raise _describe_failure(path, tmp, error, size) from error
    finally:
        tmp.unlink(missing_ok=True)
    sync_folder(path.parent)
    return path


def _is_write_failure(error: RuntimeError) -> bool:
    """torch.save's own I/O failures (PytorchStreamWriter / inline_container.cc), not a bug in `write`."""
    text = str(error)
    return any(s in text for s in ("inline_container", "PytorchStreamWriter", "unexpected pos", "file write failed"))


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """torch.save to `path` atomically (`atomic_write`)."""
    return atomic_write(path, lambda f: torch.save(obj, f), size=tensor_bytes(obj))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """`data` to `path` atomically (`atomic_write`)."""
    return atomic_write(path, lambda f: f.write(data), size=len(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`text` (UTF-8) to `path` atomically (`atomic_write`)."""
    return atomic_write_bytes(path, text.encode())


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in `obj` (nested dicts, lists and tuples): about what torch.save writes."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def sync_folder(folder: Path) -> None:
    """fsync a directory so a rename inside it survives a power cut (a no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- whole folders ---------------------------------------------------------------------------------------------

AT_FDCWD, RENAME_EXCHANGE = -100, 2  # linux/fcntl.h, linux/fs.h


def atomic_folder(
    path: str | os.PathLike, write: Callable[[Path], None], *, size: int, fix: str, files: tuple[str, ...] = ()
) -> Path:
    """Call `write(folder)` on a new hidden folder beside `path`, fsync its files, then put it in `path`'s place;
    a folder already at `path` (the caller decided it may be replaced) stays whole until then. `size`: about how
    many bytes `write` writes; `fix`: what to do when a write fails (the end of the WriteError's message);
    `files`: the files `write` writes, in order (the first one missing or torn is named as the failed write)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{socket.gethostname()}-{os.getpid()}"
    tmp, old = (path.with_name(f".{path.name}.{kind}-{tag}") for kind in ("tmp", "old"))
    clear_leftovers(path)
    try:
        tmp.mkdir()
        write(tmp)
        for file in (p for p in tmp.rglob("*") if p.is_file()):
            sync_file(file)
        for folder in (tmp, *(p for p in tmp.rglob("*") if p.is_dir())):
            sync_folder(folder)
        swap_in(tmp, path, old)
    except BaseException as error:
        failure = _folder_failure(path, tmp, error, size, fix, files) if _is_folder_write_failure(error) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure from error
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # the old folder, after a swap
    shutil.rmtree(old, ignore_errors=True)
    sync_folder(path.parent)
    return path


def swap_in(new: Path, path: Path, old: Path) -> None:
    """`new` takes `path`'s name; the folder that was at `path` ends up at `new` (swapped) or `old` (renamed)."""
    if not path.exists():
        os.rename(new, path)
        return
    if _exchange(new, path):
        return
    os.rename(path, old)  # crash window: until the next line `path` is missing; clear_leftovers renames `old` back
    os.rename(new, path)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two names in one step (renameat2 RENAME_EXCHANGE); False where the OS or filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(b))


def clear_leftovers(path: Path) -> None:
    """Remove the hidden folders a killed atomic_folder(path) left (this host, process gone); if `path` is missing
    and the old folder it renamed aside is there, rename that back first."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-{re.escape(socket.gethostname())}-(\d+)")
    for entry in sorted(path.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if match is None or process_alive(int(match[2])):
            continue
        if match[1] == "old" and not path.exists():
            os.rename(entry, path)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs and may still write: not this process (an earlier call of it failed before
    cleaning up), not gone, not a zombie (killed but not yet reaped: its writes are over)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]  # proc(5): the field after comm
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def sync_file(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_folder_write_failure(error: BaseException) -> bool:
    """An OSError, or a library's wrapped one (safetensors: "I/O error: ... (os error 28)"; torch's zip writer)."""
    if isinstance(error, OSError):
        return True
    text = str(error)
    return isinstance(error, Exception) and ("(os error " in text or "I/O error" in text or "unexpected pos" in text)


def failed_file(folder: Path, files: tuple[str, ...]) -> str | None:
    """The file being written when a write into `folder` failed: the first of `files` (in write order) missing or
    not whole (safetensors deletes its partial file), else any torn JSON or safetensors file."""
    for name in files:
        if not (folder / name).is_file() or not _whole(folder / name):
            return name
    torn = (p for p in sorted(folder.rglob("*")) if p.suffix in (".json", ".safetensors") and not _whole(p))
    return next((str(p.relative_to(folder)) for p in torn), None)


def _whole(file: Path) -> bool:
    try:
        if file.suffix == ".json":
            json.loads(file.read_text())
            return True
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return file.stat().st_size == 8 + length + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def _folder_failure(
    path: Path, tmp: Path, error: BaseException, size: int, fix: str, files: tuple[str, ...]
) -> WriteError:
    failed = failed_file(tmp, files) if tmp.exists() else None
    written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) if tmp.exists() else 0
    try:
        free: int | None = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    wrapped = re.search(r"os error (\d+)", str(error))  # safetensors' Rust I/O errors carry the errno in the text
    code = getattr(error, "errno", None) or (int(wrapped[1]) if wrapped else errno.EIO)
    cause = getattr(error, "strerror", None) or (os.strerror(code) if wrapped else str(error).splitlines()[0][:200])
    which = f"writing {failed} failed" if failed else "a write failed"
    previous = f"The previous {path} is intact" if path.exists() else f"Nothing was written at {path}"
    return WriteError(
        code,
        f"could not write {path}: {which} ({cause}). The folder needs about {_bytes(size)}; {_bytes(written)} were "
        f"written before the failure and {_bytes(free)} are free on its disk (a file-size limit, `ulimit -f`, also "
        f"stops writes). {previous}; nothing else was left behind. {fix}",
    )


def _bytes(count: int | None) -> str:
    if count is None:
        return "an unknown number of bytes"
    shown = f"{count / 1e9:,.1f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB" if count >= 1e6 else ""
    return f"{count:,} bytes" + (f" ({shown})" if shown else "")
