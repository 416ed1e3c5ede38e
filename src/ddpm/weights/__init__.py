"""A model's weights on disk: every format this project writes or reads, and one loader for all of them.

Imports flow one way, leaves first (no module imports a later one):

    model.py             LoadedModel, CheckpointError, the run config, rebuilding UNet + schedule from it
    atomic.py            temp file + fsync + rename: a write is whole or absent
    torch_file.py        Lightning `.ckpt` and the small `ema.pt` (torch.load(weights_only=True))
    safetensors_file.py  `ema.safetensors`: weights + the run config in the header, never unpickled
    diffusers_adapter.py our UNet as a diffusers ModelMixin (needs diffusers)
    diffusers_folder.py  the `python -m ddpm.export` folder: write (needs diffusers) and read (does not)
    loader.py            load_model(path): dispatch by format to the three readers above
    lightning_io.py      AtomicCheckpointIO, the Trainer plugin that writes and reads `.ckpt` through them

`load_model(path)` is what sample.py, export and evaluation call; resume reads `.ckpt` through torch_file.
"""

from ddpm.weights.loader import load_model
from ddpm.weights.model import CheckpointError, LoadedModel

__all__ = ["CheckpointError", "LoadedModel", "load_model"]
