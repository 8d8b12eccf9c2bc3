"""The layout's rules hold: common/ split by what it imports, twins file for file, the AMP
calls written out one hop from every model, one registry, the loop's contract in code, and a
script that runs the code of its own checkout."""
import ast
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from common import loop, models, profiling, runs
from tests.conftest import REPO

FRAMEWORK_PACKAGES = {"pytorch": {"torch", "common.pytorch"},
                      "tensorflow": {"tensorflow", "keras", "common.tensorflow"}}
EVERY_FRAMEWORK = set().union(*FRAMEWORK_PACKAGES.values())


def imported_packages(path) -> set[str]:
    """What a module imports anywhere, functions included: top-level packages, and
    common.pytorch / common.tensorflow as packages of their own."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                   else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        for module in modules:
            parts = module.split(".")
            names.add(".".join(parts[:2]) if parts[:2] in (["common", "pytorch"], ["common", "tensorflow"])
                      else parts[0])
    return names


def framework_files(side: str) -> list:
    """Everything that may import `side`'s framework: common/<side>/, and the model scripts and
    family steps named for it."""
    return [*sorted((REPO / "common" / side).glob("*.py")), *sorted(REPO.glob(f"*/*_{side}.py")),
            *sorted(REPO.glob(f"*/*/*_{side}.py"))]


def test_common_is_split_by_what_it_imports():
    for path in sorted((REPO / "common").glob("*.py")):
        assert not imported_packages(path) & EVERY_FRAMEWORK, f"{path.name} imports a framework"
    for side, own in FRAMEWORK_PACKAGES.items():
        files = framework_files(side)
        assert {model.script(side) for model in models.MODELS.values()} <= set(files)
        for path in files:
            other = imported_packages(path) & (EVERY_FRAMEWORK - own)
            assert not other, f"{path.relative_to(REPO)} imports {other}"


def test_the_framework_free_modules_load_no_framework_at_run_time():
    """Nothing they import pulls a framework in either (a transitive import would)."""
    names = [f"common.{path.stem}" for path in sorted((REPO / "common").glob("*.py"))]
    code = (f"import importlib, json, sys\nfor name in {names!r}: importlib.import_module(name)\n"
            f"print(json.dumps(sorted(m for m in {sorted(EVERY_FRAMEWORK)!r} if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_every_framework_file_has_its_twin_of_the_same_name():
    names = {side: {p.name for p in (REPO / "common" / side).glob("*.py")} for side in FRAMEWORK_PACKAGES}
    assert names["pytorch"] == names["tensorflow"] and len(names["pytorch"]) >= 10


def calls_in(tree) -> set[str]:
    """The calls a piece of code makes, as written: "torch.autocast", "self.scaler.step", ..."""
    return {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}


def optimizers_in(tree, method: str, on_argument: bool) -> list[str]:
    """The optimizer of every `<x>.method(...)` call: its first argument (scaler.step(opt)) or
    the object it is called on (opt.apply_gradients(...))."""
    return [ast.unparse(node.args[0] if on_argument else node.func.value) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method]


def train_step_of(path) -> ast.FunctionDef:
    steps = [node for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef) and node.name == "train_step"]
    assert len(steps) == 1, f"{path.relative_to(REPO)} has {len(steps)} train_step functions"
    return steps[0]


def step_file(model: models.Model, framework: str):
    """Where the model's training step is: in the script, or in the family's step module the
    script imports (one hop, never further)."""
    script = model.script(framework)
    if "def train_step" in script.read_text():
        return script
    shared = f"{model.family.lower()}_step_{framework}"
    imported = {f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(script.read_text()))
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert any(name.startswith(f"{model.family}.{shared}") for name in imported), f"{script.name} skips its step"
    return REPO / model.family / f"{shared}.py"


# Each call as the framework's docs write it (the object it is called on may have any name).
AMP_CALLS = {"pytorch": [r"^torch\.autocast$", r"scaler\.scale$", r"\.backward$", r"scaler\.unscale_$",
                         r"scaler\.step$", r"scaler\.update$"],
             "tensorflow": [r"^tf\.GradientTape$", r"optimizer\.scale_loss$", r"optimizer\.apply_gradients$"]}
SCALER_CALLS = re.compile(r"scaler\.(scale|unscale_|step|update)$|\.(scale_loss|apply_gradients)$")


@pytest.mark.parametrize("framework", models.FRAMEWORKS)
@pytest.mark.parametrize("name", models.MODELS)
def test_the_amp_step_is_written_out_one_hop_from_every_model(name, framework):
    model = models.MODELS[name]
    step = step_file(model, framework)
    train_step = train_step_of(step)
    calls = calls_in(train_step)
    missing = [call for call in AMP_CALLS[framework] if not any(re.search(call, made) for made in calls)]
    assert not missing, f"{step.relative_to(REPO)}: train_step does not call {missing}"
    # Every optimizer's update goes through the scaler: scaled, unscaled before clipping, stepped.
    if framework == "pytorch":
        stepped = optimizers_in(train_step, "step", on_argument=True)
        assert sorted(optimizers_in(train_step, "unscale_", on_argument=True)) == sorted(stepped)
        assert len(optimizers_in(train_step, "scale", on_argument=True)) == len(stepped)
    else:
        applied = optimizers_in(train_step, "apply_gradients", on_argument=False)
        assert sorted(optimizers_in(train_step, "scale_loss", on_argument=False)) == sorted(applied)
    docstring = ast.get_docstring(ast.parse(model.script(framework).read_text()))
    says = str(step.relative_to(REPO)) if step != model.script(framework) else "train_step below"
    assert says in " ".join(docstring.split()), f"{model.script(framework).name} does not say where its step is"


def test_no_helper_in_common_makes_the_scaler_calls_for_a_step():
    """The scaler's and LossScaleOptimizer's calls belong to the steps; common/ may only read
    the scale (amp.scale_on_device, amp.loss_scale)."""
    for side in FRAMEWORK_PACKAGES:
        for path in sorted((REPO / "common" / side).glob("*.py")):
            wrapped = sorted(call for call in calls_in(ast.parse(path.read_text())) if SCALER_CALLS.search(call))
            assert not wrapped, f"common/{side}/{path.name} calls {wrapped}"


def test_every_model_folder_is_registered_and_its_scripts_exist():
    folders = {str(path.parent.relative_to(REPO)) for path in REPO.glob("*/*/hparams.py")}
    assert folders == {model.folder for model in models.MODELS.values()}
    for model in models.MODELS.values():
        assert all(model.script(framework).is_file() for framework in models.FRAMEWORKS)
        assert model.hparams.DEFAULTS and model.hparams.PIXEL_RANGE
        assert (REPO / model.folder / "__init__.py").is_file(), model.folder  # pip install -e . finds it by it
        for framework in models.FRAMEWORKS:  # a refused flag is one line, not a traceback
            script = model.script(framework)
            (main,) = [node for node in ast.parse(script.read_text()).body
                       if isinstance(node, ast.FunctionDef) and node.name == "main"]
            assert [ast.unparse(decorator) for decorator in main.decorator_list] == ["exit_on_user_error"], script
        for alias in (model.key, *model.aliases):
            assert models.get(alias) is model


def test_every_model_name_is_taken_alike_by_the_parser_and_the_scripts():
    from common.config import parse_args
    from common.errors import UsageError
    from scripts import compare, parity

    assert parse_args("vae", "pytorch", []).model == "vanilla_vae"
    with pytest.raises(UsageError, match="unknown model 'nope'; choose from vanilla_gan, lsgan"):
        models.get("nope")
    for name in models.NAMES:
        key = models.get(name).key
        args, _ = compare.parse(["--model", name])
        assert args.model == key
        networks = [network for network, *_ in parity.networks(name, (28, 28, 1))]
        assert networks == (["encoder", "decoder"] if key == "vanilla_vae" else ["generator", "discriminator"])


# --- the loop's contract ---------------------------------------------------------------------

def members(protocol) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)


CONTRACT = members(loop.Session)
PARTS = {"checkpoints": runs.Checkpoints, "profiler": profiling.Profiler}  # contracts of their own


class OnlyTheContract:
    """An object seen through its protocol (and its parts through theirs): touching anything
    else fails the test."""

    def __init__(self, target, protocol, parts=None):
        self._target, self._members, self._parts = target, members(protocol), parts or {}
        for name in self._members:
            assert hasattr(target, name), f"{type(target).__module__}.{type(target).__name__} lacks {name}"

    def __getattr__(self, name):
        assert name in self._members, f"the loop touched .{name}, which is not in its contract"
        value = getattr(self._target, name)
        return OnlyTheContract(value, self._parts[name]) if name in self._parts else value


@pytest.mark.parametrize("framework", models.FRAMEWORKS)
def test_the_loop_touches_only_the_session_contract(framework, tmp_path, monkeypatch):
    assert {"train_step", "fetch", "precision", "checkpoints", "profiler"} <= CONTRACT
    original = loop.train
    used = []

    def train(cfg, run, session, num_examples, log=print):
        used.append(type(session))
        return original(cfg, run, OnlyTheContract(session, loop.Session, PARTS), num_examples, log)

    monkeypatch.setattr(loop, "train", train)
    script = models.MODELS["vanilla_gan"].module(framework)
    flags = ["--out", str(tmp_path / "run"), "--batch-size", "16", "--data-limit", "64", "--log-every", "8",
             "--iters", "16", "--checkpoint-every", "8"]
    script.main([*flags, "--profile", "--precision-report", "--workers", "1"])
    summary = script.main([*flags, "--iters", "17", "--resume", "--evaluate", "100"])
    assert len(used) == 2 and summary["step"] == 17 and "fid" in summary["metrics"]
    assert (tmp_path / "run" / "profile" / "top_ops.txt").exists()


# --- each run imports its own framework only -------------------------------------------------

RUN_AND_LIST_FRAMEWORKS = """
import json, runpy, sys
sys.argv = sys.argv[1:]  # as if the script itself had been run
script = sys.argv[0]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    print("frameworks: " + json.dumps(sorted(m for m in ("torch", "tensorflow", "keras") if m in sys.modules)))
"""


@pytest.mark.parametrize("framework, allowed", [("pytorch", ["torch"]), ("tensorflow", ["keras", "tensorflow"])])
def test_training_and_scoring_a_run_imports_only_its_framework(framework, allowed, tmp_path):
    def frameworks_loaded(*command):
        result = subprocess.run([sys.executable, "-c", RUN_AND_LIST_FRAMEWORKS, *map(str, command)], cwd=REPO,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout.rsplit("frameworks: ", 1)[1].splitlines()[0])

    run = tmp_path / "run"
    script = models.MODELS["vanilla_gan"].script(framework)
    assert frameworks_loaded(script, "--out", run, "--iters", "2", "--batch-size", "16", "--data-limit", "64",
                             "--log-every", "2", "--evaluate", "100") == allowed
    # scripts/evaluate.py reopens the run with its own script; its own process loads no framework
    assert frameworks_loaded(REPO / "scripts" / "evaluate.py", run, "--samples", "100") == []
    assert "fid" in json.loads((run / "summary.json").read_text())["metrics"]


# --- a script runs the code of its own checkout ---------------------------------------------

IMPORT_EACH_SCRIPT = """
import runpy, sys
scripts = sys.argv[1:]
ours = ("common", "GAN", "VAE", "scripts")
path = list(sys.path)
for script in scripts:
    # as `python SCRIPT` starts: its folder first, then PYTHONPATH (clone A), nothing of ours loaded
    sys.path[:] = [script.rsplit("/", 1)[0], *path]
    for name in [name for name in sys.modules if name.split(".")[0] in ours]:
        del sys.modules[name]
    try:
        runpy.run_path(script, run_name="imported")  # its imports, not its main()
    except ImportError as error:
        print(f"{script}: {error}")
"""


def test_a_script_runs_its_own_checkout_whatever_else_is_on_the_path(tmp_path):
    """Clone B's scripts run B's code although clone A comes first on the path (as an
    editable install of A, or PYTHONPATH, puts it there); A's code would refuse to import.
    Every script's imports in one process (the frameworks load once); one script for real."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for clone in ("a", "b"):
        for folder in ("common", "GAN", "VAE", "scripts"):
            shutil.copytree(REPO / folder, tmp_path / clone / folder, ignore=ignore)
    for package in ("common", "GAN", "VAE", "scripts"):
        (tmp_path / "a" / package / "__init__.py").write_text("raise ImportError('clone A was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "a")}
    copies = [str(tmp_path / "b" / script.relative_to(REPO))
              for script in (*(m.script(f) for m in models.MODELS.values() for f in models.FRAMEWORKS),
                             *sorted((REPO / "scripts").glob("[!_]*.py")))]
    assert len(copies) >= 2 * len(models.MODELS) + 7
    imported = subprocess.run([sys.executable, "-c", IMPORT_EACH_SCRIPT, *copies],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0 and imported.stdout == "", imported.stdout + imported.stderr[-1500:]
    helped = subprocess.run([sys.executable, copies[0], "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "usage:" in helped.stdout, helped.stderr[-1500:]
