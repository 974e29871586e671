"""What every part of the command line shares: the consoles and the server options."""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def server_options(fn: Any) -> Any:
    """--url and --token of the lease server (default: GPULEASE_URL / GPULEASE_TOKEN, else the
    files gpulease up writes)."""
    fn = click.option("--token", envvar="GPULEASE_TOKEN", help="API token")(fn)
    return click.option("--url", envvar="GPULEASE_URL", help="Lease server URL")(fn)
