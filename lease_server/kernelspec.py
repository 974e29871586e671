"""The CPU-only kernelspec "Python 3 (gpulease)": no GPU visible, the magics preloaded.

The notebook kernel only plots and analyses; training runs on leased GPUs through %%gpu_train.
Hiding every GPU from the kernel (``CUDA_VISIBLE_DEVICES=""``) makes sure it never opens a CUDA
context and so never holds GPU memory while its owner reads charts.

The spec is data: a kernel.json whose argv starts ipykernel with the IPython extension named by
:data:`EXTENSION`. It lives here, not in the notebook package, so that ``gpulease kernel install``
and ``gpulease up`` write it without importing that package (``magics.kernel`` re-exports it).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

KERNEL_NAME = "gpulease"
DISPLAY_NAME = "Python 3 (gpulease)"
EXTENSION = "magics"  # the IPython extension the kernel loads at start: %%gpu_train and friends


def kernel_spec(python: str = sys.executable) -> dict[str, object]:
    return {
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}", f"--ext={EXTENSION}"],
        "display_name": DISPLAY_NAME,
        "language": "python",
        "env": {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"},
        "metadata": {"debugger": True, "gpulease": {"cpu_only": True}},
    }


def install(user: bool = False, prefix: str | None = None) -> str:
    """Install the kernelspec; returns the directory it went to."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / KERNEL_NAME
        path.mkdir()
        (path / "kernel.json").write_text(json.dumps(kernel_spec(), indent=2))
        return str(KernelSpecManager().install_kernel_spec(str(path), KERNEL_NAME, user=user, prefix=prefix))
