"""Checkpoints of a PyTorch run: networks, optimizers, averaged weights (--ema-decay), the loss
scaler and the random state, in one file written atomically and read back without unpickling
code (weights_only)."""
from __future__ import annotations

import math
import pickle
import warnings
import zipfile
from pathlib import Path

import torch

from common.errors import CheckpointError, described
from common.runs import atomic_write, check_meta, check_regular_file

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

    def nonfinite(self) -> str | None:
        """Where the state holds inf/NaN, a loss scale of 0 included (restore refuses both)."""
        found = next(filter(None, (first_nonfinite({k: part[k].state_dict() for k in part}, name)
                                   for name, part in (("modules", self.trainer.modules),
                                                      ("optimizers", self.trainer.optimizers),
                                                      ("averages", self.trainer.averages)))), None)
        if found is None and self.runtime.scaler.is_enabled() and not 0 < self.runtime.scaler.get_scale() < math.inf:
            return "scaler/scale"
        return found

    def restore(self, path: Path, model: str) -> dict:
        """Load every piece of the state of a checkpoint of `model`; returns the meta (step,
        skipped_total, model)."""
        check_regular_file(path, "checkpoint")  # its own advice, not "delete it" below
        try:
            state = load_tensors(path)
        except CheckpointError as error:
            raise CheckpointError(f"{error}; delete it to resume from the one before") from None
        try:
            if not isinstance(state, dict) or state.get("format") != FORMAT:
                raise ValueError("not a checkpoint of this repository")
            meta = check_meta(path, state["meta"], model)
            for name, module in self.trainer.modules.items():
                check_same_tensors(state["modules"][name], module.state_dict(), f"modules/{name}")
                module.load_state_dict(state["modules"][name])
            for name, optimizer in self.trainer.optimizers.items():
                live_groups = optimizer.state_dict()["param_groups"]
                saved = dict(state["optimizers"][name])
                saved["param_groups"] = with_live_implementation(saved["param_groups"], live_groups)
                check_like(saved["param_groups"], live_groups, f"optimizers/{name}/param_groups")
                check_same_settings(saved["param_groups"], live_groups, f"optimizers/{name}/param_groups")
                optimizer.load_state_dict(saved)
                check_optimizer_state(optimizer, f"optimizers/{name}/state")
            for name, average in self.trainer.averages.items():
                check_like(state["averages"][name], average.state_dict(), f"averages/{name}")
                average.load_state_dict(state["averages"][name])
            if self.runtime.scaler.is_enabled():  # a disabled scaler's state is {}, which an enabled one refuses
                live = self.runtime.scaler.state_dict()
                check_like(state["scaler"], live, "scaler")
                # The scale and its count of clean steps are the run's state; how the scale moves
                # is this command's flags, as the Keras twin builds its LossScaleOptimizer from
                # them (load_state_dict would bring back the saved --growth-interval). A count
                # past a shorter interval would never equal it again: it grows at the next
                # clean step instead, in both frameworks.
                scaler = {**state["scaler"], **{key: live[key] for key in ("growth_factor", "backoff_factor",
                                                                            "growth_interval")}}
                scaler["_growth_tracker"] = min(scaler["_growth_tracker"], live["growth_interval"] - 1)
                self.runtime.scaler.load_state_dict(scaler)
            check_running_variances(self.trainer)
            scale = torch.tensor(self.runtime.scaler.get_scale(), dtype=torch.float32).item()  # as it will run
            if not 0 < scale < math.inf:  # 0 or inf: every step skipped, the scale stuck there
                raise ValueError(f"scaler/scale is {scale}, not a float32 number above 0")
            # the values as loaded: a float64 1e300 is inf in a float32 weight
            meta["nonfinite"] = self.nonfinite()
            torch.set_rng_state(state["rng"]["cpu"])
            if "cuda" in state["rng"] and self.runtime.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.runtime.device)
            return meta
        except (KeyError, ValueError, RuntimeError, TypeError, AttributeError) as error:
            raise CheckpointError(f"checkpoint {path} does not fit this model ({described(error)})") from None


def load_tensors(path: Path):
    """What a torch.save file holds, read with weights_only=True: tensors and plain values
    only, no code from the file run. A CheckpointError saying why it cannot be read."""
    check_regular_file(path, "checkpoint")
    if damaged := failed_crc(path):
        raise CheckpointError(f"checkpoint {path} is unreadable (damaged: {damaged} fails its CRC check)")
    try:
        with warnings.catch_warnings():  # a pickle of another protocol: a warning over two lines
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # zip/pickle errors have many types; all mean "unreadable"
        raise CheckpointError(f"checkpoint {path} is unreadable ({why_unreadable(error, first_bytes(path))})") from None


def failed_crc(path: Path) -> str | None:
    """The first entry of a torch.save zip whose bytes fail their CRC-32, else None. torch.load
    does not check them: a file with a flipped bit loaded, its weights wrong (np.load, the
    TensorFlow checkpoints' reader, does check). An entry of CRC 0 is not checked: torch.save
    writes those with torch.serialization.set_crc32_options(False). A zip that cannot be opened
    is torch.load's to report."""
    try:
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                if entry.CRC == 0:
                    continue
                try:
                    with archive.open(entry) as data:
                        while data.read(1 << 24):
                            pass
                except zipfile.BadZipFile:  # "Bad CRC-32 for file ..."
                    return entry.filename
    except Exception:  # noqa: BLE001 - a zip's errors have many types; torch.load says which
        return None
    return None


ZIP_MAGIC = b"PK\x03\x04"  # what torch.save's files begin with


def first_bytes(path: Path, count: int = len(ZIP_MAGIC)) -> bytes | None:
    """The file's first `count` bytes; None where it cannot be read."""
    try:
        with open(path, "rb") as file:
            return file.read(count)
    except OSError:
        return None


def why_unreadable(error: Exception, head: bytes | None) -> str:
    """torch.load's reason in a few words, `head` the file's first bytes: torch's own messages
    run to paragraphs, and the weights-only one advises weights_only=False, which would run the
    file's code. A torch.save file cut short failed in as many ways as there are cuts."""
    if head is not None and len(head) < len(ZIP_MAGIC) and ZIP_MAGIC.startswith(head):
        return "empty or cut short"
    if isinstance(error, pickle.UnpicklingError):
        return "it holds more than tensors and plain values, or is damaged; nothing in it was run"
    if head == ZIP_MAGIC:
        return "cut short or damaged"
    return f"not a zip file of torch.save's: {described(error)[:200]}"


# How an optimizer computes its update is this code's choice, not the run's state: checkpoints
# written before make_optimizer asked for `foreach` hold None there (the same bits, common/
# pytorch/optimizers.py), and load_state_dict would put their choice back.
IMPLEMENTATION_OPTIONS = ("foreach", "fused", "capturable", "differentiable")
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")  # Adam's state of squared gradients


def with_live_implementation(saved_groups, live_groups: list) -> list:
    """The saved param groups with the running optimizer's IMPLEMENTATION_OPTIONS; anything
    that is not a list of as many dicts is returned as it is, for check_like to name."""
    if not isinstance(saved_groups, list) or len(saved_groups) != len(live_groups):
        return saved_groups
    return [{**group, **{key: live[key] for key in IMPLEMENTATION_OPTIONS if key in live}}
            if isinstance(group, dict) else group for group, live in zip(saved_groups, live_groups)]


def check_same_settings(saved_groups: list, live_groups: list, where: str) -> None:
    """The saved hyperparameters (rate, betas, epsilon, decay, amsgrad, maximize) are the running
    optimizer's, which this command's flags built and --resume holds to the run's: load_state_dict
    would put the saved ones in their place, and an edited file's (betas of 1, amsgrad without
    its state, a rate of 1e39) trained on to a traceback or in silence. A ValueError naming the
    first that differs."""
    for index, (saved, live) in enumerate(zip(saved_groups, live_groups)):
        # the update's own settings, which every torch version saves (step() raised a KeyError
        # without them); keys other versions add or lack are compared only where both hold them
        if missing := sorted({"lr", "betas", "eps", "weight_decay"} - saved.keys()):
            raise ValueError(f"{where}/{index} has no {missing[0]!r}")
        for key in sorted(saved.keys() & live.keys() - {"params", *IMPLEMENTATION_OPTIONS}):
            as_saved, as_live = (list(value) if isinstance(value, (list, tuple)) else value
                                 for value in (saved[key], live[key]))
            if as_saved != as_live:
                raise ValueError(f"{where}/{index}/{key} is {saved[key]!r}, this run's {live[key]!r}")


# load_state_dict checks the networks' shapes but copies an optimizer's hyperparameters, its
# per-weight state and the loss scaler's numbers as they come: an edited file with a string
# learning rate or a wrongly shaped moment would load and fail mid-training with a traceback.
def check_like(saved, live, where: str) -> None:
    """`saved` is the kind of value `live` (the running state) is, recursively: the same
    type, length, tensor shape. Numbers are finite and non-negative: each one here is a rate,
    a factor or a count. A ValueError naming the first that is not."""
    if isinstance(live, (bool, str)) or live is None:
        fits = type(saved) is type(live)
    elif isinstance(live, (int, float)):
        kinds = (int, float) if isinstance(live, float) else int
        fits = isinstance(saved, kinds) and not isinstance(saved, bool) and math.isfinite(saved) and saved >= 0
    elif isinstance(live, (list, tuple)):
        fits = isinstance(saved, (list, tuple)) and len(saved) == len(live)
        for index, (saved_item, live_item) in enumerate(zip(saved, live) if fits else ()):
            check_like(saved_item, live_item, f"{where}/{index}")
    elif isinstance(live, dict):
        fits = isinstance(saved, dict)
        for key in (live.keys() & saved.keys()) if fits else ():
            check_like(saved[key], live[key], f"{where}/{key}")
    elif torch.is_tensor(live):
        fits = torch.is_tensor(saved) and saved.shape == live.shape
        if fits and (problem := tensor_problem(saved, live)):
            raise ValueError(f"{where} is {problem}, expected {kind_of(live)}")
    else:
        fits = True
    if not fits:
        raise ValueError(f"{where} is {shown(saved)}, expected {kind_of(live)}")


def tensor_problem(saved: torch.Tensor, live: torch.Tensor) -> str | None:
    """Why a tensor of the right shape still cannot take `live`'s place, as the Keras twin's
    restore refuses it: load_state_dict copies a complex tensor's real part (with a warning)
    and a bool one as 0/1, and fails on a sparse or a data-less (meta) one with an error whose
    one shown line names no reason."""
    if saved.layout != torch.strided:
        return f"a {str(saved.layout).removeprefix('torch.')} tensor"
    if saved.is_meta:
        return "a tensor without data (on the meta device)"
    whole_numbers = not (saved.is_floating_point() or saved.is_complex() or saved.dtype == torch.bool)
    fits = (saved.is_floating_point() or whole_numbers) if live.is_floating_point() else whole_numbers
    return None if fits else f"{str(saved.dtype).removeprefix('torch.')} {tuple(saved.shape)}"


def shown(value) -> str:
    """A tensor by its shape, a number as written, anything else by the start of its text."""
    if torch.is_tensor(value):
        return str(tuple(value.shape))
    if isinstance(value, (int, float)):  # bool too
        return repr(value)
    return repr(value[:40] if isinstance(value, str) else str(value)[:40])


def kind_of(live) -> str:
    """What check_like accepts in place of `live`, in words."""
    if isinstance(live, bool):
        return f"True or False, like {live}"
    if isinstance(live, int):
        return f"a whole number, 0 or more, like {live}"
    if isinstance(live, float):
        return f"a finite number, 0 or more, like {live!r}"
    if torch.is_tensor(live):
        kind = "" if live.is_floating_point() else "whole-number "
        return f"a {kind}tensor of shape {tuple(live.shape)}"
    if isinstance(live, (list, tuple)):
        return f"a list of {len(live)}"
    if live is None:
        return "None"
    if isinstance(live, str):
        return f"a string like {shown(live)}"
    return f"a {type(live).__name__}"  # a dict


def check_same_tensors(saved, live: dict, where: str) -> None:
    """`saved` holds a network's tensors by the names and shapes `live` has, as the TensorFlow
    twin checks its groups: load_state_dict's own error lists every key over many lines, of
    which one line would be shown. A ValueError naming the first difference."""
    if not isinstance(saved, dict):
        raise ValueError(f"{where} is a {type(saved).__name__}, not a network's tensors")
    if len(saved) != len(live):
        raise ValueError(f"{where} has {len(saved)} tensors, the model {len(live)}")
    missing = sorted(live.keys() - saved.keys())
    if missing:
        raise ValueError(f"{where} has no {missing[0]!r}")
    check_like(saved, live, where)


def check_running_variances(trainer) -> None:
    """Batch norm's running variances, as loaded, are >= 0: samples and evaluation divide by
    their square root (NaN images, exit 0). A ValueError naming the first that is not."""
    networks = {f"modules/{name}": module for name, module in trainer.modules.items()}
    networks.update({f"averages/{name}/module": average.module for name, average in trainer.averages.items()})
    for where, network in networks.items():
        for key, tensor in network.state_dict().items():
            if key.endswith("running_var") and (tensor < 0).any():
                raise ValueError(f"{where}/{key} holds a negative number, not a variance")


def check_optimizer_state(optimizer: torch.optim.Optimizer, where: str) -> None:
    """Each weight's optimizer state holds floating-point tensors: Adam's moments shaped like
    the weight (a scalar one broadcast into the update's output: a traceback at the next step),
    its step a scalar, a whole number >= 0 (Adam divides by 1 - beta**(step + 1)); the second
    moment is >= 0. A ValueError otherwise."""
    weights = (param for group in optimizer.param_groups for param in group["params"])
    for index, param in enumerate(weights):  # the index the state dict gives the weight
        for key, value in optimizer.state.get(param, {}).items():
            expected = torch.Size([]) if key == "step" else param.shape
            if not torch.is_tensor(value):
                raise ValueError(f"{where}/{index}/{key} is a {type(value).__name__}, not a tensor")
            if not value.is_floating_point():
                raise ValueError(f"{where}/{index}/{key} is {value.dtype}, not floating-point")
            if value.shape != expected:
                raise ValueError(f"{where}/{index}/{key} is {tuple(value.shape)}, not {tuple(expected)}")
            if key == "step" and not (value >= 0 and value == value.floor()):
                raise ValueError(f"{where}/{index}/step is {value.item()}, not a count")
            if key in SECOND_MOMENTS and (value < 0).any():  # Adam takes its square root: NaN
                raise ValueError(f"{where}/{index}/{key} holds a negative number, not a mean of squares")


def first_nonfinite(saved, where: str) -> str | None:
    """Where `saved` (a state dict, or nested ones) holds an inf/NaN floating-point tensor:
    a run resumed from such weights or moments trains on NaN. None when nowhere."""
    if torch.is_tensor(saved):
        return where if saved.is_floating_point() and not bool(torch.isfinite(saved).all()) else None
    items = saved.items() if isinstance(saved, dict) else enumerate(saved) if isinstance(saved, (list, tuple)) else ()
    return next((found for key, value in items if (found := first_nonfinite(value, f"{where}/{key}"))), None)
