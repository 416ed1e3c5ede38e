"""Writes that are whole or absent: a temporary file in the target's folder, fsync, then rename over it.

A process killed at any instant leaves the old file or the new one, never a torn file, and no temporary
file is left behind. Any failure of the write itself is re-raised as `WriteError` (an OSError) naming the
path, the bytes written so far, the free space and what to do: torch's zip writer reports a full disk or a
file-size limit as a RuntimeError ("unexpected pos ..."), which is an OSError underneath.
"""

import errno
import os
import shutil
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
    return WriteError(
        code,
        f"could not write {path} ({cause}): it needs about {_megabytes(size)}, {_megabytes(written)} were written "
        f"before the failure and {_megabytes(free)} are free on its disk (a file-size limit, `ulimit -f`, also "
        "stops writes). The previous file there is intact. Free disk space or write elsewhere "
        "(callbacks.checkpoint.dirpath for checkpoints, hydra.run.dir for a run), then resume with "
        "ckpt_path=<run dir>",
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
