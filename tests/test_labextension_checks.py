"""The labextension's own checks, run with the suite: ESLint (``npm run lint``) and its unit tests
(Vitest, ``npm test``), in labextension/.

Both need labextension/node_modules, which ``pip install -e .`` makes (its build hook runs
``npm install`` there, devDependencies included). Without it (an install without npm) they skip.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parent.parent / "labextension"
BIN = LAB / "node_modules" / ".bin"
TIMEOUT_S = 300
TAIL_CHARS = 6000


def run_npm_script(script: str, tool: str) -> None:
    """Run ``npm run <script>`` in labextension/ and assert it exits 0, showing its output's tail if not."""
    if not (BIN / tool).exists():
        pytest.skip(f"labextension/node_modules/.bin/{tool} is missing: run npm install in labextension/")
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not on PATH")
    try:
        done = subprocess.run(
            [npm, "run", script],
            cwd=LAB,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"npm run {script} took more than {TIMEOUT_S} s; its output ends:\n{out[-TAIL_CHARS:]}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"npm run {script} exited {done.returncode}; its output ends:\n{output[-TAIL_CHARS:]}"


def test_labextension_lint() -> None:
    """ESLint finds nothing in labextension/src and labextension/test."""
    run_npm_script("lint", "eslint")


def test_labextension_unit_tests() -> None:
    """The labextension's unit tests (Vitest) pass."""
    run_npm_script("test", "vitest")
