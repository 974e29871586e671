"""What a sweep tries: a grid of values, or random draws from ranges.

    grid(lr=[1e-3, 3e-3, 1e-2], batch=[32, 64])                 # 6 configurations
    sample(8, lr=loguniform(1e-4, 1e-1), batch=[32, 64], seed=0)  # 8 random ones

and the text form of ``%%gpu_sweep --over "lr=[1e-3, 3e-3]; batch=[32, 64]"``
(:func:`parse_over`). A configuration is a plain dict of names to values.
"""

from __future__ import annotations

import ast
import builtins
import itertools
import math
import random
from collections import ChainMap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Range", "choice", "draw", "grid", "loguniform", "parse_over", "randint", "sample", "uniform"]


@dataclass(frozen=True)
class Range:
    """A range to draw from with :func:`sample` (``--samples N``); a grid cannot enumerate it."""

    kind: str  # uniform | loguniform | randint | choice
    args: tuple[Any, ...]

    def draw(self, rng: random.Random) -> Any:
        if self.kind == "uniform":
            return rng.uniform(*self.args)
        if self.kind == "loguniform":
            lo, hi = self.args
            return math.exp(rng.uniform(math.log(lo), math.log(hi)))
        if self.kind == "randint":
            return rng.randint(*self.args)
        return rng.choice(self.args)

    def __repr__(self) -> str:
        return f"{self.kind}({', '.join(map(repr, self.args))})"


def uniform(low: float, high: float) -> Range:
    """A float drawn evenly from [low, high]."""
    if not low < high:
        raise ValueError(f"uniform({low!r}, {high!r}): low must be below high")
    return Range("uniform", (float(low), float(high)))


def loguniform(low: float, high: float) -> Range:
    """A float whose logarithm is drawn evenly: as likely in [1e-4, 1e-3] as in [1e-3, 1e-2]."""
    if not 0 < low < high:
        raise ValueError(f"loguniform({low!r}, {high!r}): needs 0 < low < high")
    return Range("loguniform", (float(low), float(high)))


def randint(low: int, high: int) -> Range:
    """A whole number from low to high, both included."""
    if int(low) != low or int(high) != high or low > high:
        raise ValueError(f"randint({low!r}, {high!r}): needs whole numbers, low <= high")
    return Range("randint", (int(low), int(high)))


def choice(*values: Any) -> Range:
    """One of ``values``, each as likely."""
    if len(values) == 1 and isinstance(values[0], (list, tuple, range)):
        values = tuple(values[0])
    if not values:
        raise ValueError("choice() needs at least one value")
    return Range("choice", tuple(values))


_RANGES = {"uniform": uniform, "loguniform": loguniform, "randint": randint, "choice": choice}


def _values(name: str, value: Any) -> list[Any]:
    """A grid axis: a list, tuple, range or array is its values; anything else is one value."""
    if isinstance(value, Range):
        raise ValueError(
            f"{name}={value!r} is a range, which a grid cannot list: draw configurations from it with "
            "--samples N (sample(n, ...)), or give a list of values"
        )
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        return [value]
    values = [v.item() if hasattr(v, "item") and callable(v.item) else v for v in value]
    if not values:
        raise ValueError(f"{name} has no values")
    return values


def grid(**axes: Any) -> list[dict[str, Any]]:
    """Every combination of the axes' values, the first axis changing slowest:
    ``grid(lr=[1, 2], batch=[32, 64])`` -> lr=1 batch=32, lr=1 batch=64, lr=2 batch=32, ..."""
    if not axes:
        raise ValueError("a grid needs at least one name, e.g. lr=[1e-3, 1e-2]")
    lists = {name: _values(name, v) for name, v in axes.items()}
    return [dict(zip(lists, combo, strict=True)) for combo in itertools.product(*lists.values())]


def sample(n: int, /, seed: int | None = None, **axes: Any) -> list[dict[str, Any]]:
    """``n`` configurations drawn at random: a :class:`Range` (uniform, loguniform, randint,
    choice) is drawn, a list is a choice among its values, anything else is fixed. ``seed`` makes
    the draws repeatable (an axis itself named ``seed``: :func:`draw`)."""
    return draw(n, axes, seed)


def draw(n: int, axes: Mapping[str, Any], seed: int | None = None) -> list[dict[str, Any]]:
    """:func:`sample` with the axes as one mapping."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--samples must be a whole number >= 1, got {n!r}")
    if not axes:
        raise ValueError("sample() needs at least one name, e.g. lr=loguniform(1e-4, 1e-1)")
    rng = random.Random(seed)
    ranges = {
        name: v if isinstance(v, Range) else choice(*_values(name, v)) if _many(v) else Range("choice", (v,))
        for name, v in axes.items()
    }
    return [{name: r.draw(rng) for name, r in ranges.items()} for _ in range(n)]


def _many(value: Any) -> bool:
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))


def parse_over(text: str, namespace: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``"lr=[1e-3, 3e-3]; batch=[32, 64]; drop=uniform(0, 0.5)"`` -> {name: values or Range}.

    Each part is ``NAME = EXPRESSION``, parts separated by ``;``. The expression is Python,
    evaluated with the notebook's names (``batch=sizes``, ``lr=np.logspace(-4, -1, 4)``) and the
    ranges ``uniform``, ``loguniform``, ``randint`` and ``choice``."""
    space: dict[str, Any] = {}
    env = ChainMap(dict(_RANGES), dict(namespace or {}))
    for part in _split(text):
        name, eq, expr = part.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier() or not expr.strip():
            raise ValueError(f"--over: cannot read {part.strip()!r}: write NAME=VALUES, e.g. lr=[1e-3, 1e-2]")
        if name in space:
            raise ValueError(f"--over names {name} twice")
        try:
            tree = ast.parse(expr.strip(), mode="eval")
            space[name] = eval(compile(tree, f"--over {name}", "eval"), {"__builtins__": builtins}, env)  # noqa: S307
        except Exception as exc:  # noqa: BLE001 - the user's expression: say which one failed
            raise ValueError(f"--over: {name}={expr.strip()}: {type(exc).__name__}: {exc}") from None
    if not space:
        raise ValueError('--over needs at least one NAME=VALUES, e.g. --over "lr=[1e-3, 1e-2]"')
    return space


def _split(text: str) -> list[str]:
    """Split on ``;`` outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]
