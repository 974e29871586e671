"""Where the NotebookOS traces are on this machine: one setting for the tests and benches that read them.

This repository ships no trace (docs/simulation.md says where they come from). The folder that
holds them is ``GPULEASE_TRACE_DIR`` when set, else ``traces/notebookos`` in the ``shared/traces``
folder beside the checkout: ``<repo>/../shared/traces/notebookos``, computed from where this file
is (a checkout at ``/work/main`` finds ``/work/shared/traces/notebookos``). A test or bench whose
trace is not there skips, or says so, with the line :func:`missing` gives.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "GPULEASE_TRACE_DIR"
JUNE = "sensei_june_60sec.csv"  # Tiresias-format cells, 1-30 June 2021
ADOBE = "adobe_sensei_june_1-2_2021.json"  # the session-level workload template, 1-2 June 2021

_REPO = Path(__file__).resolve().parents[2]  # lease_server/sim/traces.py -> the checkout


def trace_dir() -> Path:
    """The folder of the NotebookOS traces: ``$GPULEASE_TRACE_DIR``, else beside the checkout."""
    set_to = os.environ.get(ENV, "").strip()
    if set_to:
        return Path(set_to).expanduser()
    return _REPO.parent / "shared" / "traces" / "notebookos"


def trace(name: str) -> Path:
    """The path of trace file ``name`` (``JUNE``, ``ADOBE``) in :func:`trace_dir`; it may not exist."""
    return trace_dir() / name


def missing(name: str) -> str:
    """One line for a test's skip or a bench's exit when ``name`` is absent ("" when it is there)."""
    path = trace(name)
    if path.is_file():
        return ""
    return (
        f"{name} is not in {path.parent}: put the NotebookOS traces there or set {ENV} to their folder "
        "(docs/simulation.md says where they come from)"
    )
