"""Ray token authentication: who may join the Ray cluster that runs ``%%gpu_train`` cells.

Anyone who can reach a Ray cluster without authentication can run code on its GPU hosts without
a lease. Ray (>= 2.52) refuses drivers and nodes that do not present the cluster's token when the
cluster runs with ``RAY_AUTH_MODE=token``; a process finds the token in ``RAY_AUTH_TOKEN``, in the
file ``RAY_AUTH_TOKEN_PATH``, or in ``~/.ray/auth_token``.

``gpulease up`` generates one token per data dir (``$GPULEASE_HOME/ray_auth_token``, mode 0600)
and hands it on through the environment only, never through ``~/.ray``:

* its Ray head, and so every Ray worker the head starts: ``RAY_AUTH_MODE=token`` and
  ``RAY_AUTH_TOKEN_PATH`` (:func:`driver_env`);
* the JupyterLab it starts, and so every kernel: the same two variables;
* the lease server, which hands the token to users and admins with the Ray address in
  ``GET /api/v1/info`` (setting ``ray_auth_token_file``), so that ``%%gpu_train`` in a kernel
  started some other way still joins (:func:`use_token`, called by ``magics.session``).

The lease server itself never joins Ray.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKEN_FILE = "ray_auth_token"  # in the data dir of gpulease up
MODE_VAR, TOKEN_VAR, PATH_VAR = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


def ensure_token(data_dir: Path) -> Path:
    """The token file of ``data_dir``: kept if it holds a token, else a new one (256 random bits,
    as ``ray get-auth-token --generate`` makes), created with mode 0600."""
    path = data_dir / TOKEN_FILE
    try:
        if path.read_text().strip():
            os.chmod(path, 0o600)
            return path
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.chmod(path, 0o600)
    return path


def driver_env(token_path: Path) -> dict[str, str]:
    """What a process needs in its environment to join the cluster: token mode, the token file."""
    return {MODE_VAR: "token", PATH_VAR: str(token_path)}


def clean_env(env: dict[str, str], token_path: Path) -> dict[str, str]:
    """``env`` with our token in force: any other token (RAY_AUTH_TOKEN wins over the path) removed."""
    out = {k: v for k, v in env.items() if k != TOKEN_VAR}
    out.update(driver_env(token_path))
    return out


def info_token(settings: Any, role: str) -> dict[str, str]:
    """The token for ``GET /api/v1/info``: users and admins only (not agents, not proxies acting as
    themselves), and only when the server is configured with ``ray_auth_token_file``."""
    path = getattr(settings, "ray_auth_token_file", "")
    if not path or role not in ("user", "admin"):
        return {}
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        log.warning("cannot read ray_auth_token_file %s: %s", path, exc)
        return {}
    return {"ray_auth_token": token} if token else {}


def use_token(token: str) -> bool:
    """Make this process's next ``ray.init`` present ``token`` (token mode), whatever Ray token the
    environment holds: the lease server names the cluster and hands out its token together, so its
    token is the one for that address (a token inherited from elsewhere, e.g. a previous
    ``gpulease up``, would be refused). Returns False, changing nothing, for an empty ``token``.

    Like Ray's own ``_enable_token_auth`` it sets ``os.environ``, which child processes inherit."""
    if not token:
        return False
    os.environ[MODE_VAR] = "token"
    os.environ[TOKEN_VAR] = token
    os.environ.pop(PATH_VAR, None)
    _refresh_ray_config()
    return True


def _refresh_ray_config() -> None:
    """Ray reads RAY_AUTH_MODE into its config when it is imported and caches the token it loads:
    reload both, as Ray's own ``_enable_token_auth`` does, so that a change made after
    ``import ray`` counts. A Ray without token authentication has neither: nothing to do."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]
    except ImportError:
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
