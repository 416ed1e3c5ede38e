"""IDX files (the MNIST format, LeCun et al.): a big-endian header, then the array; gzip or not."""

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


_DAMAGED = (EOFError, gzip.BadGzipFile, zlib.error)  # a truncated, corrupt or not-gzip .gz file


def read_idx_header(path: Path) -> tuple[int, tuple[int, ...]]:
    try:
        with _open(path) as f:
            magic = f.read(4)
            if len(magic) != 4 or magic[:2] != b"\x00\x00" or magic[2] not in _IDX_DTYPES:
                raise ValueError(f"{path} is not an IDX file (bad magic {magic!r}); re-download it")
            ndim = magic[3]
            dims = f.read(4 * ndim)
    except _DAMAGED as error:
        raise ValueError(f"{path} is truncated or corrupt ({error}); re-download it") from error
    if len(dims) != 4 * ndim:
        raise ValueError(f"{path} is truncated inside its header; re-download it")
    return magic[2], struct.unpack(f">{ndim}I", dims)


def read_idx(path: Path) -> np.ndarray:
    """An IDX array (the MNIST file format), gzip or plain."""
    code, shape = read_idx_header(path)
    try:
        with _open(path) as f:
            f.seek(4 + 4 * len(shape))
            data = f.read()
    except _DAMAGED as error:
        raise ValueError(f"{path} is truncated or corrupt ({error}); re-download it") from error
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) != expected:
        state = "truncated" if len(data) < expected else "longer than its header says (not an IDX file, or damaged)"
        raise ValueError(f"{path} is {state}: {len(data)} bytes of data, the header says {expected}; re-download")
    return np.frombuffer(data, dtype=dtype).reshape(shape)
