"""Checkpoints of a TensorFlow run: every variable of the networks and optimizers (loss scale
included), the averaged weights (--ema-decay) and the noise's draw counter, in one .npz
written atomically, read back without pickles, in the order the models create them."""
from __future__ import annotations

from pathlib import Path

import keras
import numpy as np

from common.data import read_npz_arrays
from common.errors import CheckpointError, described
from common.runs import atomic_write, check_meta, check_regular_file

SUFFIX = "npz"
FORMAT = 2
# Format 1 held a tf.random.Generator's state where format 2 holds the noise's draw counter:
# it still loads (evaluate.py, compare.py and --resume reopen old runs), its noise restarting.
OLD_NOISE_FORMAT = 1


def _variables(trainer) -> dict[str, list]:
    groups = {f"module/{k}": m.weights for k, m in trainer.modules.items()}
    groups.update({f"optimizer/{k}": o.variables for k, o in trainer.optimizers.items()})
    groups.update({f"average/{k}": a.variables for k, a in trainer.averages.items()})
    groups["rng/noise"] = [trainer.noise.draws]
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
                  "meta/nonfinite_streak": np.array(meta.get("nonfinite_streak", 0)),
                  "meta/precision": np.array(self.runtime.precision)}
        if "model" in meta:
            arrays["meta/model"] = np.array(meta["model"])
        for group, variables in _variables(self.trainer).items():
            for index, variable in enumerate(variables):
                arrays[f"{group}/{index:04d}"] = variable.numpy()
        atomic_write(path, lambda file: np.savez(file, **arrays))

    def nonfinite(self) -> str | None:
        """Where the state holds inf/NaN, a loss scale of 0 included (restore refuses both)."""
        found = next((f"{group}/{index:04d}" for group, variables in _variables(self.trainer).items()
                      for index, variable in enumerate(variables)
                      if (value := variable.numpy()).dtype.kind == "f" and not np.isfinite(value).all()), None)
        scales = [(name, float(o.dynamic_scale.numpy())) for name, o in self.trainer.optimizers.items()
                  if isinstance(o, keras.optimizers.LossScaleOptimizer)]
        return found or next((f"optimizer/{name}: the loss scale" for name, scale in scales
                              if not 0 < scale < np.inf), None)

    def restore(self, path: Path, model: str) -> dict:
        """Load every piece of the state of a checkpoint of `model`; returns the meta (step,
        skipped_total, model)."""
        check_regular_file(path, "checkpoint")
        try:
            arrays = read_npz_arrays(path)
        except Exception as error:  # zip/format errors have many types; all mean "unreadable"
            raise CheckpointError(f"checkpoint {path} is unreadable ({described(error)[:200]}); "
                                  "delete it to resume from the one before") from None
        if not is_integer(arrays.get("format")):
            raise CheckpointError(f"{path} is not a checkpoint of this repository")
        found = int(arrays["format"])
        if found not in (OLD_NOISE_FORMAT, FORMAT):
            raise CheckpointError(f"checkpoint {path} was written in format {found}, and this version reads "
                                  f"formats {OLD_NOISE_FORMAT} and {FORMAT}: train with --overwrite or another --out")
        meta = {key: arrays[f"meta/{key}"].item() if is_integer(arrays.get(f"meta/{key}")) else None
                for key in ("step", "skipped_total")}
        if "meta/nonfinite_streak" in arrays:  # older checkpoints record none: the loop takes 0
            streak = arrays["meta/nonfinite_streak"]
            meta["nonfinite_streak"] = streak.item() if is_integer(streak) else None
        if "meta/model" in arrays:  # older checkpoints record no model
            recorded = arrays["meta/model"]
            meta["model"] = str(recorded) if recorded.dtype.kind == "U" and recorded.shape == () else None
        meta = check_meta(path, meta, model)
        groups = _variables(self.trainer)
        second_moments = {id(variable) for optimizer in self.trainer.optimizers.values()
                          for variable in getattr(optimizer, "inner_optimizer", optimizer)._velocities}
        if found == OLD_NOISE_FORMAT:
            groups.pop("rng/noise")
            self.trainer.noise.draws.assign(0)
        for group, variables in groups.items():
            saved = sorted(k for k in arrays if k.startswith(group + "/"))
            if len(saved) != len(variables):
                raise CheckpointError(f"checkpoint {path} does not fit this model: {group} has "
                                      f"{len(saved)} tensors, the model {len(variables)}")
            for key, variable in zip(saved, variables):
                if tuple(arrays[key].shape) != tuple(variable.shape):
                    raise CheckpointError(f"checkpoint {path} does not fit this model: {key} is "
                                          f"{arrays[key].shape}, expected {variable.shape}")
                # numbers of the variable's kind or a narrower one (float64 into float32, not
                # strings or floats into an integer counter), which assign() would fail on
                expected = variable.numpy().dtype  # Keras' dtype is a name, tf.Variable's a DType
                if not np.can_cast(arrays[key].dtype, expected, "same_kind"):
                    raise CheckpointError(f"checkpoint {path} does not fit this model: {key} holds "
                                          f"{arrays[key].dtype}, expected {expected}")
                # checked as the variable will hold it: a float64 1e300 is inf in float32, a
                # uint64 2**64 - 1 is -1 in int64
                with np.errstate(over="ignore", invalid="ignore"):
                    value = arrays[key].astype(expected)
                # counts (Adam's iterations, the noise's draws) >= 0: Adam divides by
                # 1 - beta**(iterations + 1)
                if value.dtype.kind in "iu" and (value < 0).any():
                    raise CheckpointError(f"checkpoint {path} is damaged: {key} holds a negative count")
                if id(variable) in second_moments and (value < 0).any():  # Adam takes its square root: NaN
                    raise CheckpointError(f"checkpoint {path} is damaged: {key}, an Adam second moment, "
                                          "holds a negative number")
                # samples and evaluation divide by its square root: NaN images, exit 0
                if variable.name == "moving_variance" and (value < 0).any():
                    raise CheckpointError(f"checkpoint {path} is damaged: {key}, a batch norm's running "
                                          "variance, holds a negative number")
                # the rate is this command's --lr, which --resume holds to the run's: an edited
                # one (3e38) trained on to NaN, as the PyTorch twin's param groups are checked
                if group.startswith("optimizer/") and variable.name == "learning_rate" \
                        and not np.array_equal(value, live := variable.numpy()):
                    shown, run = (f"{value.item():g}", f"{live.item():g}")
                    if shown == run:  # apart in digits :g leaves out
                        shown, run = repr(value.item()), repr(live.item())
                    raise CheckpointError(f"checkpoint {path} does not fit this model: {key}, a learning rate, "
                                          f"is {shown}, this run's {run}")
                variable.assign(value)
        for optimizer in self.trainer.optimizers.values():
            if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                scale = float(optimizer.dynamic_scale.numpy())
                if not 0 < scale < np.inf:  # 0 or inf: every step skipped, the scale stuck there
                    raise CheckpointError(f"checkpoint {path} does not fit this model: the loss scale is "
                                          f"{scale}, not a float32 number above 0")
                # its scale grows when the count of clean steps equals --growth-interval - 1: a
                # count past a shorter interval than the run's grows at the next clean step
                # instead of never, as the PyTorch twin's
                limit = optimizer.dynamic_growth_steps - 1
                optimizer.step_counter.assign(min(int(optimizer.step_counter.numpy()), limit))
        meta["nonfinite"] = self.nonfinite()  # inf/NaN, as loaded, the loop refuses to train on
        if found == OLD_NOISE_FORMAT:
            meta["warning"] = (f"warning: {path} predates the counted noise (format 1): its noise restarts, so "
                               "training on from it does not end as an uninterrupted run would")
        return meta


def is_integer(array) -> bool:
    """A stored scalar integer: the format and the meta's counts (an edited file may hold a
    string, a float or an array there)."""
    return isinstance(array, np.ndarray) and array.shape == () and array.dtype.kind in "iu"
