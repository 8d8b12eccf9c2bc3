"""Checkpoints of a PyTorch run: networks, optimizers, averaged weights (--ema-decay), the loss
scaler and the random state, in one file written atomically and read back without unpickling
code (weights_only)."""
from __future__ import annotations

from pathlib import Path

import torch

from common.errors import CheckpointError
from common.runs import atomic_write

SUFFIX = "pt"
FORMAT = 1


class Checkpoints:
    """The `Checkpoints` of common/runs.py for PyTorch: the state dicts in one torch.save file,
    read back with weights_only=True (no code from the file runs)."""

    suffix = SUFFIX

    def __init__(self, trainer, runtime):
        self.trainer, self.runtime = trainer, runtime

    def save(self, path: Path, meta: dict):
        state = {
            "format": FORMAT,
            "meta": dict(meta, precision=self.runtime.precision),
            "modules": {k: m.state_dict() for k, m in self.trainer.modules.items()},
            "optimizers": {k: o.state_dict() for k, o in self.trainer.optimizers.items()},
            "averages": {k: a.state_dict() for k, a in self.trainer.averages.items()},
            "scaler": self.runtime.scaler.state_dict(),
            "rng": {"cpu": torch.get_rng_state()},
        }
        if self.runtime.device.type == "cuda":
            state["rng"]["cuda"] = torch.cuda.get_rng_state(self.runtime.device)
        atomic_write(path, lambda file: torch.save(state, file))

    def restore(self, path: Path) -> dict:
        """Load every piece of the state; returns the meta (step, skipped_total)."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # zip/pickle errors have many types; all mean "unreadable"
            raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__}); "
                                  "delete it to resume from the one before") from None
        try:
            if state.get("format") != FORMAT:
                raise ValueError("not a checkpoint of this repository")
            for name, module in self.trainer.modules.items():
                module.load_state_dict(state["modules"][name])
            for name, optimizer in self.trainer.optimizers.items():
                optimizer.load_state_dict(state["optimizers"][name])
            for name, average in self.trainer.averages.items():
                average.load_state_dict(state["averages"][name])
            if self.runtime.scaler.is_enabled():  # a disabled scaler's state is {}, which an enabled one refuses
                self.runtime.scaler.load_state_dict(state["scaler"])
            torch.set_rng_state(state["rng"]["cpu"])
            if "cuda" in state["rng"] and self.runtime.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.runtime.device)
            return state["meta"]
        except (KeyError, ValueError, RuntimeError, TypeError, AttributeError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise CheckpointError(f"checkpoint {path} does not fit this model "
                                  f"({type(error).__name__}: {first_line})") from None
