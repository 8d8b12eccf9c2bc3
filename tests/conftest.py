import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist, each worker (and every script it starts) runs cores / workers OpenMP
    threads, set before PyTorch loads: two workers' threads on 2 cores had made a PyTorch bfloat16
    step up to 10x slower (DCGAN: 737 ms against 67 at one thread each). The suite took 8 min
    55 s against 9 min 54 (README, "Tests"). TensorFlow's intra-op pool is left as it is: one
    thread there too took 9 min 27 s. A thread count the user set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, available_cores() // workers)))


_share_the_cores_between_workers()


# The caches the suite fills, each given a folder of the test session's own (scripts the tests
# start inherit it): the parsed MNIST, and torch.compile's compiled graphs. The latter start empty,
# as on CI's clean machine; a shared one could hand the tests graphs compiled under another
# ATEN_CPU_CAPABILITY, which PyTorch 2.13's FX graph cache does not tell apart (README, "Tests").
ISOLATED_CACHES = ("AMPGEN_CACHE", "TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture(scope="session", autouse=True)
def _isolated_caches(tmp_path_factory):
    previous = {name: os.environ.get(name) for name in ISOLATED_CACHES}
    for name in ISOLATED_CACHES:
        os.environ[name] = str(tmp_path_factory.mktemp(name.lower()))
    yield
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _float32_keras_policy():
    """A TensorFlow script run in-process under --amp leaves Keras' global policy mixed: a later
    test that builds Keras networks itself (parity, averages) would build them in 16 bits. Under
    float16 it also leaves Grappler's remapper off (common/tensorflow/runtime.py): back on."""
    yield
    if "keras" in sys.modules:
        sys.modules["keras"].mixed_precision.set_global_policy("float32")
    if "tensorflow" in sys.modules:
        sys.modules["tensorflow"].config.optimizer.set_experimental_options({"remapping": True})


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run where PyTorch sees a CUDA GPU and are skipped elsewhere."""
    needs_gpu = [item for item in items if item.get_closest_marker("cuda")]
    if needs_gpu:
        import torch

        if not torch.cuda.is_available():
            for item in needs_gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def cuda_param(*values):
    """A parametrize value that runs only on a CUDA GPU: cuda_param("cuda")."""
    return pytest.param(*values, marks=pytest.mark.cuda, id=str(values[0]))


def checkpoint_arrays(path):
    """Every tensor of a checkpoint as numpy, keyed by name, whichever the framework (a CUDA
    run's tensors read onto the CPU)."""
    import numpy as np

    if path.suffix == ".npz":
        with np.load(path) as stored:
            return {k: stored[k] for k in stored.files if not k.startswith("meta/")}
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    arrays = {}
    for group in ("modules", "optimizers"):
        for name, sub in state[group].items():
            flat = sub if group == "modules" else {
                f"{i}/{k}": v for i, slot in sub["state"].items() for k, v in slot.items()}
            arrays.update({f"{group}/{name}/{k}": v.numpy() for k, v in flat.items()
                           if torch.is_tensor(v)})
    for name, average in state["averages"].items():  # --ema-decay
        arrays.update({f"averages/{name}/{k}": v.numpy() for k, v in average["module"].items()})
        arrays[f"averages/{name}/updates"] = np.array(average["updates"])
    arrays.update({f"scaler/{k}": np.array(v) for k, v in state["scaler"].items()})  # float16's loss scale
    arrays["rng"] = state["rng"]["cpu"].numpy()
    if "cuda" in state["rng"]:
        arrays["rng_cuda"] = state["rng"]["cuda"].numpy()
    return arrays


def runtime_and_data(cfg, value_range):
    """The runtime and the training data of cfg's framework, as its model script's main() makes
    them: for tests that build a trainer and call its train_step directly (eagerly)."""
    if cfg.framework == "pytorch":
        from common.pytorch.data import load_data
        from common.pytorch.runtime import setup
    else:
        from common.tensorflow.data import load_data
        from common.tensorflow.runtime import setup
    runtime = setup(cfg, log=lambda *_: None)
    return runtime, load_data(cfg, runtime, value_range=value_range)


def run_script(relative: str, *args: str, timeout: int = 300, env: dict | None = None):
    """Run a model script as a user would, from the repo root (in `env`, if given)."""
    import subprocess

    return subprocess.run([sys.executable, str(REPO / relative), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


# The data-parallel stop tests (torchrun and tf.distribute): a run that trains until stopped.
UNTIL_STOPPED = ["--iters", "100000", "--data-limit", "512", "--log-every", "5", "--sample-every", "0",
                 "--checkpoint-every", "0", "--no-tensorboard"]


def resume_from_the_only_checkpoint(script: str, run: Path, context: str = "") -> None:
    """A run stopped on every replica left exactly one checkpoint, mid-run, and the script
    continues from it in one process."""
    saved = sorted((run / "checkpoints").glob("step_*.*"))
    assert len(saved) == 1, context
    step = int(saved[0].stem.split("_")[1])
    assert 0 < step < int(UNTIL_STOPPED[1])
    resumed = run_script(script, "--out", str(run), "--resume", *UNTIL_STOPPED[2:], "--iters", str(step + 5))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {saved[0]} at step {step}" in resumed.stdout


def evaluated_in_one_process(run: Path, step: int, capfd) -> None:
    """scripts/evaluate.py reopens a run of two replicas (a ring8 GAN's) with its script in one
    process, without torchrun or --distribute: the checkpoint they wrote is an ordinary one."""
    from scripts import evaluate

    capfd.readouterr()
    assert evaluate.main([str(run), "--samples", "200"]) == 0
    reopened = capfd.readouterr().out  # the run's script, in a process of its own
    assert f"resumed from {run / 'checkpoints' / f'step_{step:06d}'}" in reopened and "2 replicas" not in reopened
    metrics = json.loads((run / "summary.json").read_text())["metrics"]
    assert 0 <= metrics["modes_covered"] <= 8
    assert f"modes_covered {metrics['modes_covered']}," in reopened.splitlines()[-1]


class CodeInAPickle:
    """Unpickled, it would create the file `marker`: what a hostile checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)
