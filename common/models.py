"""The one registry of models: every script that takes a model name reads it from here.

A model is a folder with `hparams.py` (the one set of hyperparameters both frameworks read)
and one script per framework, `<stem>_pytorch.py` and `<stem>_tensorflow.py`. Adding a model
is adding its folder and one line to MODELS.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from common.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("pytorch", "tensorflow")


@dataclass(frozen=True)
class Model:
    key: str                   # the name on every command line: --model dcgan
    family: str                # "GAN" or "VAE": the family folder, where a step its models share lives
    folder: str                # relative to the repository root
    stem: str                  # <stem>_pytorch.py, <stem>_tensorflow.py (the classic collection's names)
    aliases: tuple[str, ...] = ()
    images_only: str | None = None  # why the model refuses the 2-D mixtures; None: it takes them
    batch_norm: bool = False   # its networks hold batch norm, which --sync-bn synchronises

    def script(self, framework: str) -> Path:
        return REPO / self.folder / f"{self.stem}_{framework}.py"

    def module_name(self, framework: str) -> str:
        return f"{self.folder.replace('/', '.')}.{self.stem}_{framework}"

    def module(self, framework: str) -> ModuleType:
        """The model script as a module: its networks (`build_networks`), losses and main()."""
        return importlib.import_module(self.module_name(framework))

    @property
    def hparams(self) -> ModuleType:
        return importlib.import_module(f"{self.folder.replace('/', '.')}.hparams")


MODELS = {model.key: model for model in (
    Model("vanilla_gan", "GAN", "GAN/vanilla_gan", "gan", aliases=("gan",)),
    Model("lsgan", "GAN", "GAN/least_squares_gan", "lsgan"),
    Model("dcgan", "GAN", "GAN/dcgan", "dcgan", images_only="DCGAN is convolutional", batch_norm=True),
    Model("wgan_gp", "GAN", "GAN/wgan_gp", "wgan_gp", batch_norm=True),  # DCGAN's G
    Model("vanilla_vae", "VAE", "VAE/vanilla_vae", "vae", aliases=("vae",),
          images_only="the VAE models images with a Bernoulli decoder"),
)}
NAMES = (*MODELS, *(alias for model in MODELS.values() for alias in model.aliases))


def get(name: str) -> Model:
    """A model by key or alias; one UsageError line naming the choices otherwise."""
    for model in MODELS.values():
        if name == model.key or name in model.aliases:
            return model
    raise UsageError(f"unknown model {name!r}; choose from {', '.join(NAMES)}")
