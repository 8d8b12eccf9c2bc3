"""The README's commands still run: each names a script of this repository and flags, with
values, that the script's own parser takes. A renamed flag, a narrowed bound or a moved script
fails here, not on a reader's machine. Every model script and helper script is shown at least
once. (Parsing only: tests/readme_command_probe.py stops each script at its parser.)"""
import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = r"(?:GAN|VAE|scripts)/[\w${}/]+\.py"
LAUNCHER = r"(?:\bpython3?|\btorchrun\b[^`#]*?)"  # torchrun's own options come before the script
COMMAND = re.compile(rf"{LAUNCHER}\s+({SCRIPT})([^`#]*)")
SHELL_END = re.compile(r"\s\d?>|[|;&<>]")  # a pipe, a redirection, the next command
FRAMEWORK_VARIABLES = ("${fw}", "$fw")  # `for fw in pytorch tensorflow` loops


def commands_in(markdown: str) -> list[tuple[str, list[str]]]:
    """(script, arguments) of every command in the code blocks and inline code: continuation
    lines joined, comments and what follows a pipe or a redirection dropped."""
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
    snippets += re.findall(r"`([^`]+)`", " ".join(prose))
    found = []
    for snippet in snippets:
        for script, rest in COMMAND.findall(snippet):
            arguments = shlex.split(SHELL_END.split(rest)[0])
            scripts = [script]
            for variable in FRAMEWORK_VARIABLES:
                if variable in script:
                    scripts = [script.replace(variable, framework) for framework in ("pytorch", "tensorflow")]
            found += [(name, arguments) for name in scripts]
    return list(dict.fromkeys((script, tuple(arguments)) for script, arguments in found))


def test_commands_are_found_in_blocks_inline_and_under_torchrun():
    """The extractor itself: a change to it that finds nothing would pass every test below."""
    markdown = "\n".join([
        "Run `python GAN/dcgan/dcgan_pytorch.py --amp` and", "```bash",
        "python scripts/evaluate.py runs/x --samples 100 \\", "    --floor   # measure",
        "torchrun --standalone --nproc-per-node 2 GAN/vanilla_gan/gan_pytorch.py --iters 5 | tee log",
        "for fw in pytorch tensorflow; do python VAE/vanilla_vae/vae_${fw}.py --amp; done", "```"])
    assert commands_in(markdown) == [
        ("scripts/evaluate.py", ("runs/x", "--samples", "100", "--floor")),
        ("GAN/vanilla_gan/gan_pytorch.py", ("--iters", "5")),
        ("VAE/vanilla_vae/vae_pytorch.py", ("--amp",)),
        ("VAE/vanilla_vae/vae_tensorflow.py", ("--amp",)),
        ("GAN/dcgan/dcgan_pytorch.py", ("--amp",))]


def forwarded_by_compare(arguments) -> list[tuple[str, tuple[str, ...]]]:
    """compare.py hands the flags it does not know to both model scripts: they are checked there."""
    from common import models
    from scripts.compare import parse

    args, flags = parse(list(arguments))
    return [(str(models.get(args.model).script(framework).relative_to(REPO)), tuple(flags))
            for framework in models.FRAMEWORKS]


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
    scripts = {str(path.relative_to(REPO)) for pattern in ("GAN/*/*_*.py", "VAE/*/*_*.py", "scripts/*.py")
               for path in REPO.glob(pattern) if path.name != "__init__.py"}
    assert scripts - shown == set()
    assert shown - scripts == set()  # a script the README names that is not there


def test_every_readme_command_is_taken_by_its_script(readme_commands):
    commands = list(readme_commands)
    for script, arguments in readme_commands:
        if script == "scripts/compare.py":
            commands += forwarded_by_compare(arguments)
    wrong_flag, typo = ("GAN/dcgan/dcgan_pytorch.py", ("--no-such-flag",)), ("scripts/evaluate.py", ("--samples", "1e"))
    results = probe([*commands, wrong_flag, typo])
    assert [r["parsed"] for r in results[-2:]] == [True, False]  # parse_known_args returns unknowns
    assert results[-2]["unknown"] == ["--no-such-flag"] and "--samples" in results[-1]["message"]
    failures = [f"python {script} {shlex.join(arguments)}: {r['message'] or 'unknown ' + ' '.join(r['unknown'])}"
                for (script, arguments), r in zip(commands, results)
                if not r["parsed"] or (r["unknown"] and script != "scripts/compare.py")]
    assert failures == []
