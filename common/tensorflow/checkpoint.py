"""Checkpoints of a TensorFlow run: every variable of the networks and optimizers (loss scale
included) and the noise's draw counter, in one .npz written atomically, read back without
pickles, in the order the models create them."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common.errors import CheckpointError
from common.runs import atomic_write

SUFFIX = "npz"
FORMAT = 2  # 1: the noise was a tf.random.Generator, whose state does not fit the counter


def _variables(trainer) -> dict[str, list]:
    groups = {f"module/{k}": m.weights for k, m in trainer.modules.items()}
    groups.update({f"optimizer/{k}": o.variables for k, o in trainer.optimizers.items()})
    groups["rng/noise"] = [trainer.noise.state]
    return groups


class Checkpoints:
    """The `Checkpoints` of common/runs.py for TensorFlow: every variable in one .npz, loaded
    with allow_pickle=False, matched by order and shape."""

    suffix = SUFFIX

    def __init__(self, trainer, runtime):
        self.trainer, self.runtime = trainer, runtime

    def save(self, path: Path, meta: dict):
        arrays = {"format": np.array(FORMAT),
                  "meta/step": np.array(meta["step"]),
                  "meta/skipped_total": np.array(meta["skipped_total"]),
                  "meta/precision": np.array(self.runtime.precision)}
        for group, variables in _variables(self.trainer).items():
            for index, variable in enumerate(variables):
                arrays[f"{group}/{index:04d}"] = variable.numpy()
        atomic_write(path, lambda file: np.savez(file, **arrays))

    def restore(self, path: Path) -> dict:
        """Load every piece of the state; returns the meta (step, skipped_total)."""
        try:
            with np.load(path, allow_pickle=False) as stored:
                arrays = {key: stored[key] for key in stored.files}
        except Exception as error:  # zip/format errors have many types; all mean "unreadable"
            raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__}); "
                                  "delete it to resume from the one before") from None
        if arrays.get("format") is None:
            raise CheckpointError(f"{path} is not a checkpoint of this repository")
        if int(arrays["format"]) != FORMAT:
            raise CheckpointError(f"checkpoint {path} was written in format {int(arrays['format'])}, and this "
                                  f"version reads format {FORMAT}: start the run afresh")
        for group, variables in _variables(self.trainer).items():
            saved = sorted(k for k in arrays if k.startswith(group + "/"))
            if len(saved) != len(variables):
                raise CheckpointError(f"checkpoint {path} does not fit this model: {group} has "
                                      f"{len(saved)} tensors, the model {len(variables)}")
            for key, variable in zip(saved, variables):
                if tuple(arrays[key].shape) != tuple(variable.shape):
                    raise CheckpointError(f"checkpoint {path} does not fit this model: {key} is "
                                          f"{arrays[key].shape}, expected {variable.shape}")
                variable.assign(arrays[key])
        return {"step": int(arrays["meta/step"]), "skipped_total": int(arrays["meta/skipped_total"])}
