"""What ``%%gpu_train`` says in a kernel that did not load gpulease's magics (the plain "Python 3
(ipykernel)" card comes first in the launcher): the next step, in one line. Loaded into every
kernel of the environment by ``etc/ipython/ipython_kernel_config.py``; does nothing where the
magics are already there, and ``%load_ext magics`` replaces it."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

HINT = "this kernel has no GPU magics\n  next: Kernel > Change Kernel > 'Python 3 (gpulease)', or %load_ext magics"


# each of gpulease's magics in the kinds it has (magic.py), so that none is left standing beside them
MAGICS = [
    ("line", "gpu_train"),
    ("cell", "gpu_train"),
    ("cell", "gpu_sweep"),
    ("line", "gpu_lease"),
    ("line", "gpu_config"),
]


def _not_here(line: str = "", cell: str | None = None) -> None:
    raise UsageError(HINT)


def load_ipython_extension(ip: Any) -> None:
    loaded = ip.magics_manager.magics
    for kind, name in MAGICS:
        if name not in loaded[kind]:
            ip.register_magic_function(_not_here, kind, name)
