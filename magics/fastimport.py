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
import importlib.abc
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


class _WhenImported(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` the moment module ``name`` has been imported, once (see :func:`when_imported`)."""

    def __init__(self, name: str, then: Any, key: str) -> None:
        self.name, self.then, self.key = name, then, key

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                setattr(spec.loader, "exec_module", self._then(spec.loader.exec_module))  # noqa: B010
            if spec is not None:
                return spec
        return None

    def _then(self, exec_module: Any) -> Any:
        def run(module: Any) -> None:
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self.then(module)

        return run


def when_imported(name: str, then: Any, key: str) -> None:
    """``then(module)`` now if ``name`` is imported already, else the moment it is (torch's, in a
    worker: its memory limit, its process-group guard). ``key``: one hook per key is ever waiting."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    elif not any(isinstance(f, _WhenImported) and f.key == key for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported(name, then, key))
