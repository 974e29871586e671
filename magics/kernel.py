"""The CPU-only kernelspec "Python 3 (gpulease)" that loads these magics.

The spec and its installer belong to the lease server (:mod:`lease_server.node.kernelspec`), so that
``gpulease kernel install`` needs no import of this package; they are re-exported here for
callers that think of the kernel as part of the magics.
"""

from __future__ import annotations

from lease_server.node.kernelspec import DISPLAY_NAME, EXTENSION, KERNEL_NAME, install, kernel_spec

__all__ = ["DISPLAY_NAME", "EXTENSION", "KERNEL_NAME", "install", "kernel_spec"]
