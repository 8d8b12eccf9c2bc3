import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Parse the embedded MNIST into a cache of the test session's own."""
    previous = os.environ.get("AMPGEN_CACHE")
    os.environ["AMPGEN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if previous is None:
        os.environ.pop("AMPGEN_CACHE", None)
    else:
        os.environ["AMPGEN_CACHE"] = previous


def run_script(relative: str, *args: str, timeout: int = 300, env: dict | None = None):
    """Run a model script as a user would, from the repo root (in `env`, if given)."""
    import subprocess

    return subprocess.run([sys.executable, str(REPO / relative), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
