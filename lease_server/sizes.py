"""Durations (``90``, ``90s``, ``10m``, ``1h30m``) and sizes of GPU memory as people write them:
``10GB``, ``10240MB``, ``512M``, ``1.5GiB``, or a fraction of one GPU such as ``0.25``
(``--gpu-mem`` of the CLI, ``gpu_mem=`` of the Python client). The API itself takes seconds and
whole MB (``gpu_mem_mb``); this turns what a person wrote into those.

A GB is 1024 MB here, as GPU memory is counted (an "80GB" A100 has 81920 MiB; ``--simulate
4xA100-80GB`` declares that much)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)\s*$")
_UNITS = {"": None, "mb": 1, "m": 1, "mib": 1, "gb": 1024, "g": 1024, "gib": 1024, "tb": 1024**2, "t": 1024**2}
EXAMPLES = "write a size such as 10GB or 10240MB, or a fraction of one GPU such as 0.25"


@dataclass(frozen=True)
class GpuMem:
    """A slice's size as written: ``mb`` (an absolute size) or ``fraction`` (of one GPU of the pool)."""

    mb: int | None = None
    fraction: float | None = None

    def to_mb(self, gpu_mb: int) -> int:
        """Whole MB, given the memory of one GPU of the pool (a fraction is rounded up)."""
        if self.mb is not None:
            return self.mb
        assert self.fraction is not None
        return max(1, math.ceil(self.fraction * gpu_mb))


def parse_gpu_mem(value: str | int | float) -> GpuMem:
    """What ``value`` asks for, or ValueError with one line that says what would work. An int is MB;
    a number in (0, 1] (or a string of one, with no unit) is a fraction of one GPU."""
    if isinstance(value, bool):
        raise ValueError(f"cannot read GPU memory {value!r}: {EXAMPLES}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"GPU memory must be at least 1 MB, got {value}: {EXAMPLES}")
        return GpuMem(mb=value)
    if isinstance(value, float):
        return _fraction(value, repr(value))
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read GPU memory {value!r}: {EXAMPLES}")
    number, unit = float(m.group(1)), _UNITS[m.group(2).lower()]
    if unit is None:
        return _fraction(number, repr(value))
    mb = math.ceil(number * unit)
    if mb < 1:
        raise ValueError(f"GPU memory must be at least 1 MB, got {value!r}: {EXAMPLES}")
    return GpuMem(mb=mb)


def _fraction(number: float, shown: str) -> GpuMem:
    if not (math.isfinite(number) and 0 < number <= 1):
        raise ValueError(
            f"GPU memory {shown} has no unit, so it is read as a fraction of one GPU, which must be above 0 and "
            f"at most 1: {EXAMPLES}"
        )
    return GpuMem(fraction=number)


FIT_MARGIN = 0.2  # a size that fits a measured peak: the peak and this much more (at least one unit)


def fitting_mb(peak_mb: int, unit_mb: int, margin: float = FIT_MARGIN) -> int:
    """The slice that holds a measured ``peak_mb`` with room: the peak plus ``margin`` of it (at least
    one ``unit_mb``), rounded up to the pool's unit. What ``--gpu-mem auto`` asks for after a cell
    peaked at ``peak_mb``, and what an overrun slice is told would have fit."""
    unit = max(1, int(unit_mb))
    want = peak_mb + max(math.ceil(peak_mb * margin), unit)
    return math.ceil(want / unit) * unit


def show_mb(mb: int | float) -> str:
    """MB as a person reads them: "512 MB", "7.9 GB", "80 GB" (a GB is 1024 MB)."""
    if mb < 1024:
        return f"{mb:.0f} MB"
    gb = mb / 1024
    return f"{gb:.0f} GB" if gb >= 100 or abs(gb - round(gb)) < 0.05 else f"{gb:.1f} GB"


def as_option(mb: int) -> str:
    """MB as ``--gpu-mem`` takes them: "10GB" when whole GB, else "10000MB"."""
    return f"{mb // 1024}GB" if mb % 1024 == 0 else f"{mb}MB"


_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*$")


def ordinal(n: int) -> str:
    """1 -> '1st', 2 -> '2nd', 11 -> '11th': a place in a queue or a ranking."""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def show_duration(seconds: float) -> str:
    """Seconds as a person writes them to ``--wait`` (the inverse of :func:`parse_duration`):
    300 -> '5m', 5400 -> '1h30m', 90 -> '1m30s', 0.5 -> '0.5s'."""
    if seconds < 60:
        return f"{seconds:g}s"
    h, rest = divmod(round(seconds), 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{unit}" for v, unit in ((h, "h"), (m, "m"), (s, "s")) if v)


def show_wait(seconds: float) -> str:
    """A wait or an end in a few words, as estimates say it: '12 s', '4 min', '1.5 h'."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def parse_duration(text: str | float | int | None, allow_zero: bool = False) -> float | None:
    """'90', '90s', '10m', '1h30m' -> seconds (``%%gpu_train --wait``, ``gpulease acquire --wait``).
    None stays None; 0 only with ``allow_zero`` (a wait of 0: do not queue)."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m or not any(m.groups()):
            raise ValueError(f"cannot read duration {text!r}: write e.g. 90, 90s, 10m or 1h30m")
        h, mins, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = h * 3600 + mins * 60 + s
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError(f"a duration must be positive, got {text!r}")
    return seconds
