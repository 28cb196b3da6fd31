"""The code stays ruff-clean and mypy-clean (both are test dependencies)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("tool, args", [
    ("ruff", ["check", "."]),
    ("mypy", ["zcollective"]),
])
def test_tool_is_clean(tool, args):
    if shutil.which(tool) is None and not _has_module(tool):
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")
    proc = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _has_module(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_the_api_reference_is_what_the_docstrings_say():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "make_api.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
