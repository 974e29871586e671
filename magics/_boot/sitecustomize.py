"""Run at the start of every Ray worker process of gpulease (its directory leads PYTHONPATH in the
workers' runtime environment, set by ``magics.session``): defer what ``import ray`` need not pay.

``import ray`` imports jsonschema, which imports ``rfc3987_syntax`` when installed (jupyter-server's
``jsonschema[format-nongpl]`` installs it), and that builds a Lark grammar at import: 1.6 of the
2.2 CPU-seconds ``import ray`` takes. A worker never checks the "iri" format; if anything does,
the real module loads then (``magics.fastimport``). Then the next ``sitecustomize`` on the path, if
any, runs as it would have.
"""

import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("_gpulease_fastimport", os.path.join(_here, "..", "fastimport.py"))
if _spec is not None and _spec.loader is not None:
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    _mod.defer_slow_imports()

for _entry in sys.path:
    if _entry and os.path.abspath(_entry) != _here and os.path.isfile(os.path.join(_entry, "sitecustomize.py")):
        _next = importlib.util.spec_from_file_location("_next_sitecustomize", os.path.join(_entry, "sitecustomize.py"))
        if _next is not None and _next.loader is not None:
            _next.loader.exec_module(importlib.util.module_from_spec(_next))
        break
