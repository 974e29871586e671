"""The command of ``gpulease acquire -- COMMAND``, tied to its lease at the node agent first.

``gpulease acquire`` starts ``python -m lease_server.node.claimexec COMMAND...`` with the claim in
the environment (:data:`CLAIM_ENV`, taken out before the command starts: a process's environment
is readable by its owner only, its command line by everyone). This process claims the lease at the
node agent (lease_server/node/claims.py: the kernel names it to the agent, with its uid), then
becomes the command (``exec``: the same process, pid and start time). So the agent knows the
command as the lease's, as it knows a cell's worker: when the server ends the lease (an admin's
revoke, an expiry), the drain ends the command before the GPUs are lent again; and a process of
another user seen on the lease's GPUs is unleased use, not taken for the command's.

Without an agent of that node on this host (the lease is on another machine, or ``gpulease up``
is not running) nothing is claimed and the command runs as before.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any, NoReturn

from . import claims

CLAIM_ENV = "GPULEASE_CLAIM"


def claim_env(instance: str, node: str, lease: str, fence: int, token: str, user: str, gpus: list[int]) -> str:
    """The value of :data:`CLAIM_ENV` for a command of ``lease`` on ``node``."""
    keys = ("instance", "node", "lease", "fence", "token", "user", "gpus")
    return json.dumps(dict(zip(keys, (instance, node, lease, int(fence), token, user, gpus), strict=True)))


def claim_here(d: dict[str, Any], what: str) -> bool:
    """Claim ``d`` (as :func:`claim_env` wrote it) for this process; say in one line on stderr if
    the agent refused, nothing if no agent of that node answers here. True if it was claimed."""
    try:
        claims.claim(d["instance"], d["node"], d["lease"], d["fence"], d["token"], d["user"], d["gpus"])
        return True
    except claims.ClaimRefused as exc:
        lease, node = d["lease"], d["node"]
        sys.stderr.write(f"gpulease: lease {lease}: the node agent of {node} did not tie {what} to it: {exc}\n")
    except OSError:  # no agent of that node on this host
        pass
    return False


def main(argv: list[str]) -> NoReturn:
    raw = os.environ.pop(CLAIM_ENV, "")
    if raw:
        try:
            d = json.loads(raw)
        except ValueError:
            d = None
        if isinstance(d, dict):
            claim_here(d, "the command")
    # Python starts with SIGPIPE and SIGXFSZ ignored, which an exec keeps: the command gets them
    # as a shell would give them (`yes | head -1` ends on SIGPIPE, not on a write error)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:  # as a shell says it (acquire checked first: it went since)
        missing = isinstance(exc, FileNotFoundError)
        sys.stderr.write(f"gpulease: {argv[0]}: {'command not found' if missing else exc.strerror}\n")
        os._exit(127 if missing else 126)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m lease_server.node.claimexec COMMAND [ARG...]")
    main(sys.argv[1:])
