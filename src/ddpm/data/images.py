"""uint8 image tensors and PIL images: resizing, padding, channel conversion, modes. Plain torch + Pillow."""

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F


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


def fit_to_size(images: Tensor, size: int) -> Tensor:
    """Pad small square images with a centred zero border (MNIST 28 -> 32, as is standard), else resize."""
    height = images.shape[-1]
    if height < size and (size - height) % 2 == 0 and (size - height) <= height // 4:
        pad = (size - height) // 2
        return F.pad(images, (pad, pad, pad, pad))
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


def to_mode(image, mode: str):
    """A PIL image of any mode as `mode` ("L" or "RGB"): transparency (RGBA, LA, PA, palette with a transparent
    index) is composited onto white, 16/32-bit grey (I;16, I) scaled from 0..65535 to 0..255, palettes expanded;
    RGB -> L is ITU-R 601-2 luma (PIL's)."""
    from PIL import Image

    if image.mode.startswith("I"):  # 16-bit greyscale PNG/TIFF: keep the range, not the low byte
        scaled = np.asarray(image, dtype=np.float64) * (255 / 65535)
        image = Image.fromarray(np.clip(np.round(scaled), 0, 255).astype(np.uint8))  # 2-D uint8: mode L
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return image.convert(mode)


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
