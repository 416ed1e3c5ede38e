"""Feature extractors for FID, KID and IS: Inception-v3 (torch-fidelity's weights) or a classifier file.

Every extractor takes generated or real images as saved: (B, C, H, W) uint8 at the model's resolution.

Resize rule (documented, part of the reference cache key):
- `inception`: grey images are repeated to 3 channels, then torch-fidelity's TensorFlow-1.x-compatible
  bilinear resize to 299x299 (no antialiasing: the resize of the original TF FID code, so numbers are
  comparable to published FIDs), pool3 features (2048) for FID/KID and the 1008 logits for IS.
- a classifier file: channels converted to its `in_channels` (grey repeated, or ITU-R 601 luma) and,
  only when the sizes differ, an antialiased bilinear resize to its `image_size`, rounded back to uint8.

A classifier file is either TorchScript (`torch.jit.load`) or a state dict written by
`ddpm.metrics.classifier.save_state`. TorchScript contract: `forward(x)` maps uint8 (B, C, S, S) to
(B, D) float features; optional attributes `image_size`, `in_channels` and an exported `logits(x)`
(B, K) method (enables IS and the conditional accuracy of labelled samples).
"""

import hashlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ddpm.data.images import convert_channels, resize_uint8

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{INCEPTION_FILE}"
INCEPTION_ID = "inception2015-pool3-tf1resize"  # the name in reference cache keys
INCEPTION_SHA256_PREFIX = "6726825d"  # torch hub's naming rule (hub.py): <name>-<first hex digits of sha256>.<ext>


class InceptionWeightsMissing(RuntimeError):
    """The Inception weights are not in torch hub's cache and could not be downloaded."""


class InceptionWeightsCorrupt(RuntimeError):
    """The Inception weights file in torch hub's cache is torn or not the genuine file (the message names it)."""


def inception_weights_path() -> Path:
    """Where torch-fidelity's download lands: <torch hub dir>/checkpoints/<file> ($TORCH_HOME/hub/...)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_FILE


@dataclass(eq=False)
class FeatureExtractor:
    """uint8 images -> features (and logits, when the network has them), batched on one device."""

    net: nn.Module
    name: str  # identifies the network and its resize rule in reference cache keys
    kind: str  # "inception" or "classifier": metric names are fid@N or cfid@N
    image_size: int | None = None  # resize to this before the network (None: the network resizes)
    channels: int | None = None  # convert to this many channels before the network
    has_logits: bool = False
    device: torch.device | str = "cpu"

    def to(self, device: torch.device | str) -> "FeatureExtractor":
        self.net, self.device = self.net.to(device), torch.device(device)
        return self

    def _prepare(self, images: Tensor) -> Tensor:
        images = convert_channels(images, self.channels)
        if self.image_size is not None and images.shape[-1] != self.image_size:
            images = resize_uint8(images.cpu(), self.image_size)
        return images

    @torch.no_grad()
    def __call__(self, images: Tensor, batch_size: int = 250) -> tuple[Tensor, Tensor | None]:
        """(N, C, H, W) uint8 -> features (N, D) float64 on CPU, logits (N, K) float64 or None."""
        if images.dtype != torch.uint8:
            raise ValueError(f"feature extractor {self.name}: images must be uint8 as saved, got {images.dtype}")
        device = torch.device(self.device)
        feats, logits = [], []
        with torch.autocast(device.type, enabled=False):  # float32 features even inside a bf16 run
            for chunk in images.split(batch_size):
                x = self._prepare(chunk).to(device)
                f, lg = self._forward(x)
                feats.append(f.double().cpu())
                if lg is not None:
                    logits.append(lg.double().cpu())
        return torch.cat(feats), (torch.cat(logits) if logits else None)

    def _forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.kind == "inception":
            pool, logits = self.net._torch_fidelity_forward(x)  # type: ignore[operator]
            return pool, logits
        return self.net(x), (self.net.logits(x) if self.has_logits else None)  # type: ignore[operator]


def inception_extractor(key: str = "metrics.features") -> FeatureExtractor:
    """torchmetrics' Inception-v3 (torch-fidelity weights, pool3 + unbiased logits), TF-compatible resize."""
    try:
        from torchmetrics.image.fid import NoTrainInceptionV3
    except ImportError as error:  # pragma: no cover - torch-fidelity is a dependency
        raise ImportError(f"{key}=inception needs torch-fidelity: pip install torch-fidelity") from error
    path = inception_weights_path()
    try:
        net = NoTrainInceptionV3(name="inception-v3-compat", features_list=["2048", "logits_unbiased"], antialias=False)
    except Exception as error:  # URLError, HTTPError, OSError, a torn file in the cache ...
        if not path.is_file():
            raise InceptionWeightsMissing(missing_weights_message(path, error, key)) from error
        digest = file_digest(path)
        if digest.startswith(INCEPTION_SHA256_PREFIX):  # the genuine file: the failure lies elsewhere
            raise
        raise InceptionWeightsCorrupt(corrupt_weights_message(path, digest, error, key)) from error
    return FeatureExtractor(net=net, name=INCEPTION_ID, kind="inception", channels=3, has_logits=True)


def brief(error: BaseException) -> str:
    """'Type: first sentence' of an error (torch's torn-zip error goes on for four more sentences)."""
    text = str(error).strip()
    first = text.splitlines()[0].split(". ")[0] if text else ""
    return f"{type(error).__name__}: {first[:200]}"


def corrupt_weights_message(path: Path, digest: str, error: BaseException, key: str = "metrics.features") -> str:
    return (
        f"the Inception weights file {path} ({path.stat().st_size:,} bytes) cannot be loaded "
        f"({brief(error)}): it is torn (an interrupted copy or download) or not the "
        f"genuine file (its sha256 begins {digest[:8]}, the genuine file's {INCEPTION_SHA256_PREFIX}). Delete it "
        f"so that torch hub downloads it again (on a machine with network):\n    rm {path}\nor put a good copy "
        f"there:\n    curl -L -o {path} {INCEPTION_URL}\n"
        f"or compute an offline FID with {key}=<path to a TorchScript classifier>"
    )


def missing_weights_message(path: Path, error: BaseException, key: str = "metrics.features") -> str:
    return (
        f"the Inception weights {INCEPTION_FILE} are not in {path.parent} (torch hub's checkpoints folder, "
        f"under $TORCH_HOME) and could not be downloaded ({type(error).__name__}: {str(error)[:200]}). "
        f"Fetch them once on a machine with network:\n    mkdir -p {path.parent} && curl -L -o {path} {INCEPTION_URL}\n"
        f"(or copy the file there), or compute an offline FID with {key}=<path to a TorchScript "
        "classifier>, e.g. the one `python benchmarks/mnist_quality.py --save-classifier PATH` writes"
    )


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def classifier_extractor(path: str | os.PathLike, key: str = "metrics.features") -> FeatureExtractor:
    """A TorchScript module or a `save_state` dict from `path` (see the module docstring for the contract)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"{key}={str(path)!r} does not exist; use {key}=inception or the path of a "
            "TorchScript classifier (python benchmarks/mnist_quality.py --save-classifier PATH writes one)"
        )
    try:
        with warnings.catch_warnings():  # torch >= 2.10 marks TorchScript deprecated; it still loads
            warnings.simplefilter("ignore", FutureWarning)
            net = torch.jit.load(str(path), map_location="cpu")
    except Exception as error:  # not TorchScript: a state dict written by ddpm.metrics.classifier.save_state?
        net = state_dict_classifier(path, error, key)
    net.eval()
    return FeatureExtractor(
        net=net,
        name=f"{path.stem}-{file_digest(path)}",
        kind="classifier",
        image_size=_int_attr(net, "image_size"),
        channels=_int_attr(net, "in_channels"),
        has_logits=hasattr(net, "logits"),
    )


def state_dict_classifier(path: Path, jit_error: BaseException, key: str = "metrics.features") -> nn.Module:
    """The classifier of a `save_state` file; a file neither TorchScript nor torch.load can read is named, torn."""
    from ddpm.metrics.classifier import STATE_FORMAT, load_state

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a torn zip: OSError, RuntimeError (central directory), UnpicklingError ...
        errors = brief(error) if brief(error) == brief(jit_error) else f"{brief(jit_error)}; {brief(error)}"
        raise ValueError(
            f"{key}={path} ({path.stat().st_size:,} bytes) cannot be read as TorchScript nor as a state "
            f"dict ({errors}): it is torn (an interrupted copy) or not a classifier file; write it again (python "
            f"benchmarks/mnist_quality.py --save-classifier {path}) or use {key}=inception"
        ) from error
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != STATE_FORMAT:
        raise ValueError(
            f"{key}={path} is neither TorchScript nor a {STATE_FORMAT} state dict (ddpm.metrics.classifier.save_state)"
        ) from None
    return load_state(checkpoint)


def _int_attr(net: nn.Module, name: str) -> int | None:
    value = getattr(net, name, None)
    return int(value) if value is not None else None


def build_extractor(
    features: str, device: torch.device | str = "cpu", key: str = "metrics.features"
) -> FeatureExtractor:
    """`inception` or a classifier file path -> a FeatureExtractor on `device`; refusals name `key`, the setting."""
    extractor = inception_extractor(key) if features == "inception" else classifier_extractor(features, key)
    return extractor.to(device)
