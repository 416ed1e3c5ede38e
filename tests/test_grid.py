"""sample.py's grid (ddpm.sampling.outputs.tile, save_png) against torchvision's make_grid and save_image."""

import io

import pytest
import torch
from PIL import Image
from torchvision.utils import make_grid, save_image

from ddpm.sampling.outputs import save_png, tile


@pytest.mark.parametrize(("n", "channels", "nrow"), [(10, 1, 10), (7, 3, 3), (3, 1, 8), (16, 3, 4), (2, 1, 1)])
def test_tile_is_make_grids_layout(n: int, channels: int, nrow: int) -> None:
    images = torch.randint(0, 256, (n, channels, 5, 6), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    grid = tile(images, nrow=nrow)
    theirs = make_grid(images.float() / 255.0, nrow=nrow, padding=2, pad_value=1.0)  # grey: 3 equal planes
    expected = theirs.mul(255).add(0.5).clamp(0, 255).to(torch.uint8)[:channels]  # save_image's conversion
    assert grid.dtype == torch.uint8 and torch.equal(grid, expected)


@pytest.mark.parametrize("channels", [1, 3])
def test_save_png_writes_the_pixels_save_image_writes(channels: int) -> None:
    images = torch.randint(0, 256, (6, channels, 4, 4), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    ours, theirs = io.BytesIO(), io.BytesIO()
    save_png(tile(images, nrow=3), ours)
    save_image(make_grid(images.float() / 255.0, nrow=3, padding=2, pad_value=1.0), theirs, format="png")
    with Image.open(ours) as a, Image.open(theirs) as b:
        assert a.mode == ("L" if channels == 1 else "RGB") and a.size == b.size
        assert a.convert("RGB").tobytes() == b.convert("RGB").tobytes()


def test_one_image_is_framed_like_many() -> None:
    """make_grid returns a lone image unpadded; tile frames it as it frames every image of a larger grid."""
    image = torch.full((1, 1, 3, 3), 7, dtype=torch.uint8)
    grid = tile(image, nrow=4)
    assert grid.shape == (1, 7, 7) and int(grid[0, 2:5, 2:5].sum()) == 63 and int((grid == 255).sum()) == 49 - 9


@pytest.mark.parametrize(("count", "num_classes", "columns"), [(64, 10, 10), (64, None, 8), (64, 1000, 8),
                                                               (256, 1000, 16), (3, 32, 32)])  # fmt: skip
def test_a_grid_has_a_column_per_class_up_to_32_classes_else_is_square(count, num_classes, columns) -> None:
    """Labels go 0..K-1 in turn, so K columns put a class in each; a 1,000-class model's grid (imagenet256_latent)
    was one row of 256 images, 66,050 pixels wide, which viewers and TensorBoard show badly."""
    from ddpm.sampling.outputs import grid_columns

    assert grid_columns(count, num_classes) == columns
    assert tile(torch.zeros(count, 3, 8, 8, dtype=torch.uint8), nrow=columns).shape[-1] <= 32 * 10 + 2
