"""A model's weights on disk: every format this project writes or reads, and one loader for all of them.

Imports flow one way, leaves first (no module imports a later one):

    model.py             LoadedModel, CheckpointError, the run config, rebuilding UNet + schedule from it
    torch_file.py        Lightning `.ckpt` and the small `ema.pt` (torch.load(weights_only=True))
    safetensors_file.py  `ema.safetensors`: weights + the run config in the header, never unpickled
    diffusers_adapter.py our UNet as a diffusers ModelMixin (needs diffusers)
    diffusers_files.py   what diffusers folders share: file names, reading, our schedule as a scheduler config
    unet2d_mapping.py    our UNet's tensors <-> diffusers' UNet2DModel's; a UNet2DModel config -> our arguments
    diffusers_native.py  the folder whose unet is diffusers' own UNet2DModel: write (needs diffusers), read (not)
    diffusers_folder.py  `python -m ddpm.export`'s entry (native, or the adapter folder) and reading the adapter
    loader.py            load_model(path): dispatch by format (a folder by its unet) to the readers above
    init.py              load_init(path, net, model_config): weights only, into a new network (fine-tuning)
    lightning_io.py      AtomicCheckpointIO, the Trainer plugin that writes and reads `.ckpt` through them

`load_model(path)` is what sample.py, export and evaluation call; resume reads `.ckpt` through torch_file;
`load_init` is train.py's init_from. Files are written through ddpm.atomic (temp file + fsync + rename).
"""

from ddpm.weights.loader import load_model
from ddpm.weights.model import CheckpointError, LoadedModel

__all__ = ["CheckpointError", "LoadedModel", "load_model"]
