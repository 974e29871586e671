"""The server extension: configuration (traitlets), routes, and the kernel hook's lifecycle.

Configure it like any Jupyter server extension, e.g. in ``jupyter_server_config.py``::

    c.GpuLease.lease_server_url = "http://leases.example:8470"
    c.GpuLease.lease_server_token = "glt_..."

Without configuration it reads ``GPULEASE_URL`` / ``GPULEASE_TOKEN``, else the files ``gpulease up``
writes (``~/.gpulease/url`` and ``token``), as every gpulease client does.
"""

from __future__ import annotations

import asyncio
import os

from jupyter_server.extension.application import ExtensionApp
from traitlets import Bool, Float, Unicode, default

from lease_server import errors
from lease_server.client import discover

from . import __version__
from .handlers import routes
from .kernels import KernelLeaseReleaser
from .upstream import LeaseApi


def _discovered() -> tuple[str, str]:
    try:
        return discover(notebook=True)
    except errors.ServerUnavailable:  # nothing configured: the handlers say so, the server still runs
        return "", os.environ.get("GPULEASE_TOKEN", "")


class GpuLease(ExtensionApp):
    """gpulease in the Jupyter server: the GPU board's API and the kernel lease hook."""

    name = "gpulease"
    version = __version__
    load_other_extensions = True

    lease_server_url = Unicode(
        help="URL of the lease server, e.g. http://127.0.0.1:8470. Default: GPULEASE_URL, "
        "else the URL that 'gpulease up' wrote to ~/.gpulease/url.",
    ).tag(config=True)

    lease_server_token = Unicode(
        help="Lease API token this Jupyter server acts with: every page of this server is that lease "
        "user. Default: GPULEASE_TOKEN, else gpulease up's user token (~/.gpulease/lab_token), never its "
        "admin token unless that is the only one there.",
    ).tag(config=True)

    act_as_user = Unicode(
        help="Lease user every call acts for, with a proxy token (gpulease token create hub --proxy): "
        "for a JupyterHub deployment with one shared token. Default: GPULEASE_USER; else, if the "
        "token is a proxy token, JupyterHub's user of this server (JUPYTERHUB_USER).",
    ).tag(config=True)

    request_timeout = Float(10.0, help="Seconds to wait for the lease server's answer.").tag(config=True)

    release_on_kernel_exit = Bool(
        True,
        help="Release a kernel's leases (those whose session is the kernel's) when it shuts down, "
        "restarts or dies, instead of waiting for their TTL.",
    ).tag(config=True)

    @default("lease_server_url")
    def _default_url(self) -> str:
        return _discovered()[0]

    @default("act_as_user")
    def _default_act_as(self) -> str:
        return os.environ.get("GPULEASE_USER", "")

    @default("lease_server_token")
    def _default_token(self) -> str:
        return _discovered()[1]

    def initialize_settings(self) -> None:
        assert self.serverapp is not None  # set when the extension was linked, before this
        self.api = LeaseApi(
            self.lease_server_url,
            self.lease_server_token,
            self.request_timeout,
            act_as=self.act_as_user,
            hub_user=os.environ.get("JUPYTERHUB_USER", ""),
        )
        self.streams: set[asyncio.Event] = set()  # open event streams, ended when the server stops
        self.releaser = KernelLeaseReleaser(
            self.api, self.serverapp.kernel_manager, getattr(self.serverapp, "event_logger", None)
        )
        if self.release_on_kernel_exit:
            self.releaser.start()
        if self.api.problem:
            self.log.warning("gpulease: %s", self.api.problem)
        else:
            self.log.info("gpulease: lease server %s; the GPU board's API is at /gpulease/", self.api.url)
        self.settings["gpulease"] = self

    def initialize_handlers(self) -> None:
        # Patterns are relative: ExtensionApp puts the server's base_url in front.
        self.handlers.extend(routes("/"))

    async def stop_extension(self) -> None:
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        for gone in list(self.streams):
            gone.set()
        if self.release_on_kernel_exit:
            await self.releaser.stop()
        await self.api.close()
