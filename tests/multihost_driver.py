"""A notebook kernel on the service host, for tests/test_multihost.py.

It runs where docs/deploy.md runs JupyterHub's kernels (the service host, beside the Ray head), with
the environment JupyterHub gives them (``GPULEASE_URL``, the hub's proxy token, ``GPULEASE_USER``;
nothing for Ray), and runs ``%%gpu_train`` cells through the real magic in an IPython shell.

Requests arrive as JSON lines on stdin; each answer is one JSON line on stdout after ``ANSWER``:

* ``{"op": "ray"}``: join the Ray cluster the lease server names, as the magic does (with the Ray
  token the lease server hands out); answer its resources;
* ``{"op": "cell", "line": "--gpus 1", "cell": "...", "names": [...]}``: run the cell; answer what
  it printed (the magic's status lines and the worker's output), the names asked for, and the
  error if it raised.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any

ANSWER = "@@answer "


def join_ray() -> dict[str, Any]:
    """Join the Ray cluster the lease server names, as the magic does before a kernel's first
    cell; answer what the cluster offers and whether calls are pinned to their lease's node."""
    import ray

    from magics.session import session

    sess = session()
    sess.connect_ray()
    return {"resources": sorted(ray.cluster_resources()), "pinned": sess._pinned}


def main() -> None:
    from IPython.testing.globalipapp import start_ipython

    from magics.magic import GpuMagics

    shell = start_ipython()
    assert shell is not None
    magics = GpuMagics(shell)
    out = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        answer: dict[str, Any]
        try:
            if req["op"] == "ray":
                answer = join_ray()
            else:
                buf = io.StringIO()
                error = None
                with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                    try:
                        magics.gpu_train(req["line"], req["cell"])
                    except BaseException as exc:  # noqa: BLE001 - the test reads it
                        error = f"{type(exc).__name__}: {exc}"
                names = {k: shell.user_ns[k] for k in req.get("names", []) if k in shell.user_ns}
                answer = {"stdout": buf.getvalue(), "names": names, "error": error}
        except Exception as exc:  # noqa: BLE001 - answered, so that the test shows it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(ANSWER + json.dumps(answer, default=repr) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
