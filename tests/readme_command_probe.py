"""Run by tests/test_readme_commands.py: each helper script's command read from stdin (JSON, a
list of [script, [argument, ...]]) goes to the script's own argument parser, as a user's would,
and stops at its first parse: nothing is loaded or trained (a check the script makes after
parsing is not reached). Prints one JSON result per command:
{"parsed": bool, "unknown": [...], "namespace": {...}, "message": "..."}.

    python tests/readme_command_probe.py < commands.json
"""
import argparse
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class Parsed(BaseException):
    """Raised from the parser, so that no script's own error handler (they catch Exception)
    turns it into a message."""


parse_known_args = argparse.ArgumentParser.parse_known_args


def parse_and_stop(self, args=None, namespace=None):
    raise Parsed(parse_known_args(self, args, namespace))


argparse.ArgumentParser.parse_known_args = parse_and_stop  # parse_args calls it too

results = []
for script, arguments in json.load(sys.stdin):
    sys.argv = [script, *arguments]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(REPO / script), run_name="__main__")
        results.append({"parsed": False, "message": "ran without parsing flags"})
    except Parsed as stop:
        namespace, unknown = stop.args[0]
        results.append({"parsed": True, "unknown": unknown, "namespace": vars(namespace), "message": ""})
    except SystemExit:
        results.append({"parsed": False, "message": errors.getvalue().strip()})
print(json.dumps(results, default=str))  # paths as text
