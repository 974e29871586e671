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
import struct
import sys
import tempfile
import zlib
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


# The logo, on a 24 x 24 grid (the GPU chip of the JupyterLab panel's icon): rectangles x0, y0, x1, y1
# and their colour, later ones drawn over earlier ones.
_PINS = (97, 97, 97, 255)
_BODY = (243, 119, 38, 255)  # Jupyter orange
_DIE = (255, 226, 204, 255)
_LOGO: tuple[tuple[float, float, float, float, tuple[int, int, int, int]], ...] = (
    *((x, y, x + 2, y + 3, _PINS) for x in (8, 14) for y in (2, 19)),
    *((x, y, x + 3, y + 2, _PINS) for x in (2, 19) for y in (8, 14)),
    (5, 5, 19, 19, _BODY),
    (8, 8, 16, 16, _DIE),
)


def logo_png(size: int) -> bytes:
    """The kernel's launcher logo as a ``size`` x ``size`` RGBA PNG (4 x 4 samples a pixel)."""
    n = 4
    rows = []
    for py in range(size):
        row = bytearray(b"\0")  # filter: none
        for px in range(size):
            acc = [0, 0, 0, 0]
            for sy in range(n):
                for sx in range(n):
                    u = (px + (sx + 0.5) / n) * 24 / size
                    v = (py + (sy + 0.5) / n) * 24 / size
                    colour = (0, 0, 0, 0)
                    for x0, y0, x1, y1, c in _LOGO:
                        if x0 <= u < x1 and y0 <= v < y1:
                            colour = c
                    for i in range(3):
                        acc[i] += colour[i] * colour[3]
                    acc[3] += colour[3]
            alpha = acc[3] / (n * n)
            rgb = [round(acc[i] / acc[3]) if acc[3] else 0 for i in range(3)]
            row += bytes([*rgb, round(alpha)])
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0)  # 8-bit RGBA
    data = zlib.compress(b"".join(rows), 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def write_spec(path: Path) -> None:
    """Write the kernelspec's files into the directory ``path``: kernel.json and the logos that the
    launcher shows (logo-64x64.png, logo-32x32.png) instead of the language's first letter."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "kernel.json").write_text(json.dumps(kernel_spec(), indent=2))
    for size in (32, 64):
        (path / f"logo-{size}x{size}.png").write_bytes(logo_png(size))


def install(user: bool = False, prefix: str | None = None) -> str:
    """Install the kernelspec; returns the directory it went to."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / KERNEL_NAME
        write_spec(path)
        return str(KernelSpecManager().install_kernel_spec(str(path), KERNEL_NAME, user=user, prefix=prefix))
