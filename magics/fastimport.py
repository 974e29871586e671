"""Keep slow imports that a notebook's kernel and its Ray workers do not use off their start.

``import ray`` imports jsonschema, and jsonschema imports ``rfc3987_syntax`` (when installed, as
jupyter-server's ``jsonschema[format-nongpl]`` does) for its "iri" format check; that module builds a
Lark grammar at import: 1.6 of the 2.2 CPU-seconds of ``import ray`` on a 2-core machine. Here it is
replaced, before anything imports it, by a stand-in whose ``is_valid_syntax`` imports the real
module on its first call: jsonschema's check still works wherever something uses it, and nobody
else pays for it. Installed in the kernel (``magics``) and, through ``magics/_boot/sitecustomize.py``,
in every Ray worker the kernel starts. Self-contained: the workers load this file by path.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

DEFERRED = "rfc3987_syntax"


class _Deferred(types.ModuleType):
    """Stands in for a module until anything of it is used; then the real one is imported."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # the import system asks for __path__, __spec__, ...: not a use
            raise AttributeError(name)
        return getattr(_real(self.__name__), name)


def _real(name: str) -> types.ModuleType:
    stub = sys.modules.get(name)
    if isinstance(stub, _Deferred):
        del sys.modules[name]
        try:
            real = importlib.import_module(name)
        except BaseException:
            sys.modules[name] = stub
            raise
        return real
    return sys.modules[name] if name in sys.modules else importlib.import_module(name)


def _is_valid_syntax(*args: Any, **kwargs: Any) -> Any:
    return _real(DEFERRED).is_valid_syntax(*args, **kwargs)


def defer_slow_imports() -> bool:
    """Put the stand-in in place, unless the module is imported already or not installed. Returns
    whether it did."""
    if DEFERRED in sys.modules or importlib.util.find_spec(DEFERRED) is None:
        return False
    stub = _Deferred(DEFERRED, "gpulease: imported on first use (magics/fastimport.py)")
    stub.is_valid_syntax = _is_valid_syntax  # type: ignore[attr-defined]
    sys.modules[DEFERRED] = stub
    return True
