"""Our UNet as a diffusers model: `DDPMUNet2DModel`, a ModelMixin/ConfigMixin around ddpm.models.unet.UNet.

It is what `python -m ddpm.export` puts in a pipeline folder's `unet/` for the models diffusers' own UNet2DModel
cannot express (model_index.json names it `["ddpm.weights.diffusers_adapter", "DDPMUNet2DModel"]`; every other
model is exported as a native UNet2DModel, diffusers_native.py). Its config is our UNet's constructor arguments (plus
`sample_size`, which diffusers' pipelines read, always equal to `image_size`); its weights are the UNet's,
under the prefix `net.`. It is called as diffusers' UNet2DModel is:

    unet(sample, timestep, class_labels=None).sample      # eps or v, as the run was trained; eps for EDM

An EDM model (diffusion=edm) carries its preconditioning in the config (`edm_sigma_data`, and `edm_sigmas`: sigma_t
of each timestep): the adapter calls our UNet on c_in x and turns its output F into eps (ddpm.diffusion.precond),
so diffusers' DDPM/DDIM schedulers with the exported betas (alpha_bar_t = 1 / (1 + sigma_t^2)) sample it.

`timestep` is a 0-dim tensor, a Python number or a (B,) tensor; `class_labels` (B,) int64 or None, where None
(all that DDPMPipeline / DDIMPipeline pass) is the null class `num_classes` of a class-conditional model:
they draw unconditional samples. For guidance, see `ddpm.export`.

diffusers imports no module just because a model_index.json names it (diffusers 0.42's
`_get_library_or_raise`: libraries other than diffusers/transformers are taken from `sys.modules`), so
`import ddpm.weights.diffusers_adapter` before `DDPMPipeline.from_pretrained(folder)`.
"""

from dataclasses import dataclass

import torch
from diffusers import ConfigMixin, ModelMixin  # ModelMixin must be a name of this module: diffusers looks it up here
from diffusers.configuration_utils import register_to_config
from diffusers.utils import BaseOutput

from ddpm.diffusion import precond
from ddpm.models.unet import UNet

__all__ = ["ConfigMixin", "DDPMUNet2DModel", "DDPMUNet2DOutput", "ModelMixin"]


@dataclass
class DDPMUNet2DOutput(BaseOutput):
    """sample: (B, C, H, W), the network's eps or v prediction (as UNet2DOutput)."""

    sample: torch.Tensor


class DDPMUNet2DModel(ModelMixin, ConfigMixin):
    """diffusers-loadable wrapper of our UNet; `self.net` is the plain UNet (its state dict, prefixed `net.`)."""

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        image_size: int = 32,
        base_channels: int = 128,
        channel_mult: tuple[int, ...] = (1, 2, 2, 2),
        num_res_blocks: int = 2,
        attention_resolutions: tuple[int, ...] = (16,),
        num_heads: int = 1,
        dropout: float = 0.1,
        num_classes: int | None = None,
        norm_groups: int = 32,
        scale_shift: bool = False,
        emb_dim: int | None = None,
        downsample: tuple[bool, ...] | None = None,
        sample_size: int | None = None,  # diffusers' name of image_size (pipelines read it); must equal it
        edm_sigma_data: float | None = None,  # an EDM model's sigma_data (None: the network outputs eps or v)
        edm_sigmas: list[float] | None = None,  # an EDM model's sigma_t, t = 0..T-1
    ) -> None:
        super().__init__()
        if (edm_sigma_data is None) != (edm_sigmas is None):
            raise ValueError("edm_sigma_data and edm_sigmas come together (an EDM model) or not at all")
        sigmas = torch.tensor(edm_sigmas or [], dtype=torch.float64)
        self.register_buffer("sigma_table", sigmas, persistent=False)  # from the config, not the weights
        if sample_size is not None and sample_size != image_size:
            raise ValueError(f"sample_size={sample_size} must equal image_size={image_size} (H = W of the images)")
        self.register_to_config(sample_size=image_size)
        self.net = UNet(
            in_channels=in_channels,
            image_size=image_size,
            base_channels=base_channels,
            channel_mult=channel_mult,
            num_res_blocks=num_res_blocks,
            attention_resolutions=attention_resolutions,
            num_heads=num_heads,
            dropout=dropout,
            num_classes=num_classes,
            norm_groups=norm_groups,
            scale_shift=scale_shift,
            emb_dim=emb_dim,
            downsample=downsample,
        )

    @property
    def null_class(self) -> int | None:
        """The label of the unconditional (null) class, num_classes; None for an unconditional model."""
        return self.config.num_classes

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        class_labels: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> DDPMUNet2DOutput | tuple[torch.Tensor]:
        """sample (B, C, H, W); timestep 0-dim, number or (B,); class_labels (B,) int64 or None (the null class)."""
        t = torch.as_tensor(timestep, device=sample.device)
        t = t.long() if not t.is_floating_point() else t
        if t.ndim == 0:
            t = t.expand(sample.shape[0])
        if class_labels is not None:
            if self.config.num_classes is None:
                raise ValueError("class_labels were given, but this model is unconditional (num_classes: null)")
            class_labels = torch.as_tensor(class_labels, device=sample.device).long()
            if class_labels.ndim == 0:
                class_labels = class_labels.expand(sample.shape[0])
        out = self._edm(sample, t, class_labels) if self.config.edm_sigma_data else self.net(sample, t, class_labels)
        return DDPMUNet2DOutput(sample=out) if return_dict else (out,)

    def _edm(self, sample: torch.Tensor, t: torch.Tensor, class_labels: torch.Tensor | None) -> torch.Tensor:
        """eps of an EDM model: F at c_in x, then eps = (x - c_skip x - c_out F) / sigma (float64 coefficients)."""
        sigma = self.sigma_table.to(sample.device)[t.long()].view(-1, 1, 1, 1)
        network = lambda x: self.net(x, t, class_labels)  # noqa: E731
        return precond.denoise(network, sample, sigma, self.config.edm_sigma_data)[0]
