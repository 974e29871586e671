"""Jupyter server extension of gpulease: the JupyterLab GPU board's API under ``/gpulease/``.

It proxies the lease server's API with the lease token from its configuration (so the browser
never sees that token), streams the lease server's events to the page, and releases a kernel's
leases the moment the kernel shuts down, restarts or dies. The front end (``labextension/``) is
built into ``jupyter_ext/labextension`` and installed into ``share/jupyter/labextensions/gpulease``.
"""

from __future__ import annotations

from typing import Any

from lease_server import __version__

__all__ = ["__version__"]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .app import GpuLease

    return [{"module": "jupyter_ext", "app": GpuLease}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    # For `jupyter labextension develop`: the built bundle beside this file, under its npm name.
    return [{"src": "labextension", "dest": "gpulease"}]
