"""uint8 image tensors and PIL images: resizing, padding, channel conversion, modes. Plain torch + Pillow.

How each Pillow mode becomes 8-bit "L" or "RGB" (`to_mode`), or is refused with the file named:

- 8-bit modes (1, L, P, RGB, RGBA, RGBa, RGBX, LA, La, PA, CMYK, YCbCr, HSV) by Pillow's `convert`, with
  transparency (an alpha band, or a palette index or colour marked transparent) composited onto white;
  LAB (which Pillow cannot `convert`) to sRGB with Pillow's ImageCms (littleCMS).
- 16-bit grey (I;16, I;16B, I;16L, I;16N): scaled from 0..65535 to 0..255 (x * 255 / 65535, rounded).
- I (32-bit integer) by the file's real range: all values in 0..255 are 8-bit as they are; in 0..65535 are
  scaled as 16-bit; any other range (negative, above 65535) is refused, naming the file and its range.
- F (32-bit float): NaN or inf is refused, naming the file; values in [0, 1] are scaled by 255, values in
  [0, 255] taken as they are (rounded); any other range is refused, naming the file and its range.
- Any other mode is refused naming the file and the mode. The fix for a refused file: convert it, e.g. to
  an 8- or 16-bit PNG.

Decoding is bounded by a pixel count (`open_image(max_pixels=...)`, Pillow's decompression-bomb guard set
as Image.MAX_IMAGE_PIXELS for the call and restored after): a file above it is refused naming the file and
the setting to raise. Pillow itself only warns between 1x and 2x its limit (DecompressionBombWarning) and
refuses above 2x; here both are the same refusal, so the limit means what it says and no oversized decode
slips through as a warning lost in a DataLoader worker's stderr. Every other decoder error names the file.

Every image is decoded upright, as viewers show it (`upright`): an EXIF Orientation tag 2..8 (JPEG, and the eXIf
chunk of PNG, WebP, TIFF) is applied with Pillow's ImageOps.exif_transpose before anything else; 1, a missing tag
or an unreadable EXIF block leave the pixels as stored. Cameras and phones store a portrait photo as landscape
pixels plus orientation 6 or 8; trained as stored, it would teach the model sideways faces.
"""

import io
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

PILLOW_MAX_PIXELS = 89_478_485  # Pillow's default Image.MAX_IMAGE_PIXELS (a 0.25 GB 24-bit image)
EIGHT_BIT_MODES = {"1", "L", "P", "RGB", "RGBA", "RGBa", "RGBX", "LA", "La", "PA", "CMYK", "YCbCr", "HSV", "LAB"}
SIXTEEN_BIT_MODES = {"I;16", "I;16B", "I;16L", "I;16N"}
GREY_MODES = {"1", "L", "LA", "La", "I", "F"} | SIXTEEN_BIT_MODES  # the modes whose natural form is "L"
_CONVERT = "convert the files, e.g. to 8- or 16-bit PNG"


def resize_uint8(images: Tensor, size: int) -> Tensor:
    """(N, C, H, W) uint8 -> (N, C, size, size) uint8, antialiased bilinear, in chunks to bound memory."""
    if images.shape[-2:] == (size, size):
        return images
    out = [
        F.interpolate(chunk.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        .round()
        .clamp(0, 255)
        .to(torch.uint8)
        for chunk in images.split(4096)
    ]
    return torch.cat(out)


def fit_to_size(images: Tensor, size: int, *, pad: bool = False) -> Tensor:
    """Square images to `size`: with `pad`, small ones get a centred zero border (MNIST 28 -> 32, as is standard for
    MNIST only: a photo's black border is no part of it); else resized (centre_crop takes non-square images)."""
    height = images.shape[-1]
    if images.shape[-2] != height:
        raise ValueError(f"fit_to_size takes square images, not {tuple(images.shape[-2:])}: centre_crop them")
    if pad and height < size and (size - height) % 2 == 0 and (size - height) <= height // 4:
        border = (size - height) // 2
        return F.pad(images, (border, border, border, border))
    return resize_uint8(images, size)


def convert_channels(images: Tensor, channels: int | None) -> Tensor:
    """Grey <-> RGB: repeat the grey plane, or ITU-R 601 luma of RGB."""
    have = images.shape[1]
    if channels is None or channels == have:
        return images
    if have == 1 and channels == 3:
        return images.expand(-1, 3, -1, -1).contiguous()
    if have == 3 and channels == 1:
        luma = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
        return (images.float() * luma).sum(1, keepdim=True).round().clamp(0, 255).to(torch.uint8)
    raise ValueError(f"data.channels={channels}: cannot convert {have}-channel images; use 1, 3 or null")


def _grey(array: np.ndarray, full_scale: float):
    """A 2-D array on 0..full_scale -> a mode-L image on 0..255."""
    from PIL import Image

    scaled = np.asarray(array, dtype=np.float64) * (255 / full_scale)
    return Image.fromarray(np.clip(np.round(scaled), 0, 255).astype(np.uint8))


class ImageModeError(ValueError):
    """A decoded image whose mode or values have no stated conversion to 8 bits (the message names the file)."""


def to_eight_bit(image, name: str = "the image"):
    """A PIL image of any mode as one of the 8-bit modes, by the rule in the module docstring (or ImageModeError)."""
    mode = image.mode
    if mode in SIXTEEN_BIT_MODES:
        return _grey(np.asarray(image), 65535)
    if mode in ("I", "F"):
        array = np.asarray(image, dtype=np.float64)
        if not np.isfinite(array).all():
            bad = int((~np.isfinite(array)).sum())
            raise ImageModeError(f"{name}: {bad} of its {array.size} float pixels (mode F) are NaN or inf; {_CONVERT}")
        low, high = array.min(), array.max()
        for full_scale in (1.0, 255.0) if mode == "F" else (255.0, 65535.0):  # the first range that holds it
            if low >= 0 and high <= full_scale:
                return _grey(array, full_scale)
        kind = "32-bit float (mode F) pixels, neither in [0, 1] nor in [0, 255]" if mode == "F" else (
            "32-bit integer (mode I) pixels, neither in 0..255 nor in 0..65535")  # fmt: skip
        raise ImageModeError(f"{name}: {kind}: its range is {low:g}..{high:g}; {_CONVERT}")
    if mode == "LAB":
        from PIL import ImageCms

        lab, srgb = ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB")
        return ImageCms.applyTransform(image, ImageCms.buildTransform(lab, srgb, "LAB", "RGB"))
    if mode == "La":  # premultiplied grey + alpha: Pillow converts it only to LA
        return image.convert("LA")
    if mode not in EIGHT_BIT_MODES:
        raise ImageModeError(f"{name}: Pillow mode {mode!r} has no stated conversion to 8-bit; {_CONVERT}")
    return image


def natural_mode(image) -> str:
    """ "L" for grey modes (with or without alpha, any depth), "RGB" for the others."""
    return "L" if image.mode in GREY_MODES else "RGB"


def to_mode(image, mode: str, name: str = "the image"):
    """A PIL image of any mode as `mode` ("L" or "RGB") by the rule in the module docstring; transparency is
    composited onto white; RGB -> L is ITU-R 601-2 luma (PIL's). Refusals (ImageModeError) name `name`."""
    from PIL import Image

    image = to_eight_bit(image, name)
    if {"A", "a"} & set(image.getbands()) or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return image.convert(mode)


@contextmanager
def pixel_limit(max_pixels: int | None) -> Iterator[None]:
    """Pillow's decompression-bomb limit set to `max_pixels` (None: none), its warning made an error; restored."""
    from PIL import Image

    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


EXIF_ORIENTATION = 0x0112  # the EXIF/TIFF Orientation tag (274): 1 as stored, 2..8 flipped and/or rotated


def upright(image):
    """A PIL image as viewers show it: its EXIF Orientation 2..8 applied (the tag then removed); else itself."""
    from PIL import ImageOps

    if image.getexif().get(EXIF_ORIENTATION, 1) not in range(2, 9):  # no copy for the common case
        return image
    return ImageOps.exif_transpose(image)


def open_image(file: Path | bytes, mode: str | None, *, name: str, max_pixels: int | None, setting: str):
    """Decode `file` (a path or the bytes of one) upright (its EXIF orientation applied) as a loaded PIL image in
    `mode` ("L", "RGB"; None: its natural one). Any failure is a ValueError naming `name`; an image over
    `max_pixels` names `setting`, the key to raise."""
    from PIL import Image

    try:
        with pixel_limit(max_pixels), Image.open(io.BytesIO(file) if isinstance(file, bytes) else file) as image:
            converted = to_mode(upright(image), mode or natural_mode(image), name)
            converted.load()
            return converted
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        found = re.search(r"\((\d+) pixels\)", str(error))  # Pillow: "Image size (N pixels) exceeds limit of ..."
        pixels = int(found.group(1)) if found else None
        size, at_least = (f"has {pixels:,} pixels", str(pixels)) if pixels else ("is too large", "<N>")
        raise ValueError(
            f"{name} {size}, over {setting}={max_pixels} (the decompression-bomb guard: a small file can decode to "
            f"gigabytes); if you trust it set {setting}={at_least} or more ({setting}=null: no limit, only for "
            "trusted files), else remove it"
        ) from error
    except ImageModeError:
        raise
    except Exception as error:  # Pillow raises many types for damaged files (OSError, SyntaxError, EOFError, ...)
        raise ValueError(
            f"{name} is not a readable image ({type(error).__name__}: {error}); remove or replace it"
        ) from error


def centre_crop(image, size: int) -> Tensor:
    """Resize the short side to `size` (bicubic, antialiased), crop the centre square; -> (C, size, size)."""
    from PIL import Image

    scale = size / min(image.size)
    width, height = max(size, round(image.size[0] * scale)), max(size, round(image.size[1] * scale))
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    left, top = (width - size) // 2, (height - size) // 2
    array = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.uint8)
    array = array[:, :, None] if array.ndim == 2 else array
    return torch.from_numpy(array.copy()).permute(2, 0, 1)
