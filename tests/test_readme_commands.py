"""The README's commands still parse: each names a script of this repository and flags, with
values, that the script takes. A renamed flag, a narrowed bound or a moved script fails here,
not on a reader's machine. A model script's flags go through its whole parse, the checks across
flags included (common/config.py parse_args); a helper script's through its own parser
(tests/readme_command_probe.py stops it there), and the flags compare.py and benchmark.py hand
on to the model scripts through those scripts' parse. Every script is shown at least once.
Parsing only: nothing is trained or measured."""
import contextlib
import json
import re
import shlex
import subprocess
import sys

import pytest

from common import models
from common.config import parse_args
from common.errors import UsageError
from tests.conftest import REPO

SCRIPT = r"(?:\./)?((?:GAN|VAE|scripts)/[\w${}/]+\.py)"
LAUNCHER = r"(?:\bpython3?(?:\s+-[A-Za-z]+)*|\btorchrun\b.*?)"  # torchrun's options come before the script
COMMAND = re.compile(rf"{LAUNCHER}\s+{SCRIPT}(.*)")
BARE_COMMAND = re.compile(rf"^{SCRIPT}(.*)")  # inline code naming a script without `python`
SHELL_BREAKS = re.compile(r"&&|\|\||[|;&<>]|\s\d?>")  # the next command, a pipe, a redirection
FRAMEWORK_VARIABLES = ("${fw}", "$fw")  # `for fw in pytorch tensorflow` loops
MODEL_SCRIPTS = {str(model.script(framework).relative_to(REPO)): (model.key, framework)
                 for model in models.MODELS.values() for framework in models.FRAMEWORKS}
HELPER_SCRIPTS = {str(path.relative_to(REPO)) for path in (REPO / "scripts").glob("*.py")
                  if path.name != "__init__.py"}


def commands_in(markdown: str) -> list[tuple[str, tuple[str, ...]]]:
    """(script, arguments) of every command in the code blocks and the inline code: lines
    continued with a backslash joined, comments dropped, each command of a line on its own.
    Inline code without `python` counts as a command when it is one of this repository's
    scripts followed by arguments (`scripts/compare.py` alone names the file)."""
    code, prose, in_block = [], [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
        elif in_block:
            code.append(line)
        else:
            prose.append(line)
    code_lines = "\n".join(code).replace("\\\n", " ").splitlines()
    snippets = [re.split(r"(?:^|\s)#", line)[0] for line in code_lines]
    inline = re.findall(r"`([^`]+)`", " ".join(prose))
    found = []
    for snippet, bare in [*((s, False) for s in snippets), *((s, True) for s in inline)]:
        for piece in SHELL_BREAKS.split(snippet):
            match = COMMAND.search(piece) or (BARE_COMMAND.match(piece.strip()) if bare else None)
            if not match:
                continue
            script, rest = match.groups()
            scripts = [script]
            for variable in FRAMEWORK_VARIABLES:
                if variable in script:
                    scripts = [script.replace(variable, framework) for framework in models.FRAMEWORKS]
            if bare and not COMMAND.search(piece) and (
                    not rest.strip() or scripts[0] not in {*MODEL_SCRIPTS, *HELPER_SCRIPTS}):
                continue
            found += [(name, tuple(shlex.split(rest))) for name in scripts]
    return list(dict.fromkeys(found))


def test_commands_are_found_in_blocks_inline_and_under_torchrun():
    """The extractor itself: a change to it that finds nothing would pass every test below."""
    markdown = "\n".join([
        "Run `python GAN/dcgan/dcgan_pytorch.py --amp` and `scripts/evaluate.py --floor`, not",
        "`GAN/dcgan/hparams.py --x` or `scripts/compare.py`.", "```bash",
        "python scripts/evaluate.py runs/x --samples 100 \\", "    --floor   # measure",
        "torchrun --standalone --nproc-per-node 2 GAN/vanilla_gan/gan_pytorch.py --iters 5 | tee log",
        "for fw in pytorch tensorflow; do python VAE/vanilla_vae/vae_${fw}.py --amp; done",
        "python -u ./scripts/parity.py --model dcgan && python3 scripts/compare.py --model vae > out 2>&1",
        "```"])
    assert commands_in(markdown) == [
        ("scripts/evaluate.py", ("runs/x", "--samples", "100", "--floor")),
        ("GAN/vanilla_gan/gan_pytorch.py", ("--iters", "5")),
        ("VAE/vanilla_vae/vae_pytorch.py", ("--amp",)),
        ("VAE/vanilla_vae/vae_tensorflow.py", ("--amp",)),
        ("scripts/parity.py", ("--model", "dcgan")),
        ("scripts/compare.py", ("--model", "vae")),
        ("GAN/dcgan/dcgan_pytorch.py", ("--amp",)),
        ("scripts/evaluate.py", ("--floor",))]


def model_script_error(script: str, arguments, capsys) -> str | None:
    """None when the model script's whole parse takes `arguments`; else its error line."""
    model, framework = MODEL_SCRIPTS[script]
    try:
        with contextlib.redirect_stdout(sys.stderr):  # --help would print
            parse_args(model, framework, list(arguments))
    except UsageError as error:
        return str(error)
    except SystemExit:
        return capsys.readouterr().err.strip() or "exited"
    return None


def forwarded_to_models(script: str, namespace: dict, unknown: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """The model scripts' commands that compare.py and benchmark.py make of the flags they do
    not take themselves."""
    if script == "scripts/compare.py":
        from scripts.compare import parse

        args, flags = parse(list(namespace["argv"]))
        chosen, frameworks = [args.model], models.FRAMEWORKS
    else:
        from scripts.benchmark import PRESETS

        preset = PRESETS.get(namespace["preset"], {})
        flags = [*preset.get("flags", []), *unknown]
        chosen = namespace["models"] if "--models" in namespace["argv"] else preset.get("models", namespace["models"])
        frameworks = namespace["frameworks"]
    return [(str(models.get(model).script(framework).relative_to(REPO)), tuple(flags))
            for model in dict.fromkeys(chosen) for framework in frameworks]


def probe(commands) -> list[dict]:
    result = subprocess.run([sys.executable, str(REPO / "tests" / "readme_command_probe.py")],
                            input=json.dumps(commands), cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def readme_commands():
    return commands_in((REPO / "README.md").read_text())


def test_every_script_is_shown_in_the_readme(readme_commands):
    shown = {script for script, _ in readme_commands}
    assert {*MODEL_SCRIPTS, *HELPER_SCRIPTS} - shown == set()
    assert shown - {*MODEL_SCRIPTS, *HELPER_SCRIPTS} == set()  # a script the README names that is not there


def test_the_checks_catch_what_they_are_for(capsys):
    """A wrong flag, a wrong value and a wrong combination are each caught (else the test below
    could not fail)."""
    assert "unrecognized arguments: --no-such-flag" in model_script_error(
        "GAN/dcgan/dcgan_pytorch.py", ("--no-such-flag",), capsys)
    assert "--xla is TensorFlow's compiler" in model_script_error("GAN/dcgan/dcgan_pytorch.py", ("--xla",), capsys)
    assert "multiple of" in model_script_error("GAN/wgan_gp/wgan_gp_pytorch.py", ("--batch-size", "64"), capsys)
    assert model_script_error("GAN/dcgan/dcgan_tensorflow.py", ("--xla", "--amp"), capsys) is None
    wrong_value = probe([("scripts/evaluate.py", ("--samples", "1e"))])[0]
    assert not wrong_value["parsed"] and "--samples" in wrong_value["message"]


def test_every_readme_command_is_taken_by_its_script(readme_commands, capsys):
    helper_commands = [(script, arguments) for script, arguments in readme_commands if script in HELPER_SCRIPTS]
    model_commands = [(script, arguments) for script, arguments in readme_commands if script in MODEL_SCRIPTS]
    failures = []
    for (script, arguments), result in zip(helper_commands, probe(helper_commands)):
        command = f"python {script} {shlex.join(arguments)}"
        if not result["parsed"]:
            failures.append(f"{command}: {result['message']}")
        elif script in ("scripts/compare.py", "scripts/benchmark.py"):  # they hand the rest on
            model_commands += forwarded_to_models(script, {**result["namespace"], "argv": arguments},
                                                  result["unknown"])
        elif result["unknown"]:
            failures.append(f"{command}: unknown {' '.join(result['unknown'])}")
    assert len(model_commands) > len(MODEL_SCRIPTS)
    for script, arguments in dict.fromkeys(model_commands):
        if error := model_script_error(script, arguments, capsys):
            failures.append(f"python {script} {shlex.join(arguments)}: {error}")
    assert failures == []
