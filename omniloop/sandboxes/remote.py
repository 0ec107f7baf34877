"""A `Sandbox` that lives in sandboxd (`service.py`), reached over HTTP.

`SandboxClient` is one connection pool to one service; `await client.create(...)` gives a
`RemoteSandbox`, which implements the `Sandbox` protocol. Every call is retried on transport
errors and 502/503 with backoff. Retrying is safe: each `exec` carries a request id that the
service runs at most once (a retry after a dropped response gets the first run's result), file
writes are idempotent, and `close` of a closed sandbox succeeds. Creation is not retried after
a transport error (the service may have made a sandbox the client never heard of; its lease
ends it), but a 429 is waited out, as its `Retry-After` says, until `create_timeout`.

A service that stays unreachable through the retries, or that answers 404 for a sandbox it
made (it was restarted), raises `SandboxLost`: the sandbox is gone, and whoever used it may
start its work again.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from omniloop.errors import SandboxError, SandboxLost
from omniloop.http_client import HttpClient, HttpResponse, HttpTransportError
from omniloop.sandboxes.base import ExecResult
from omniloop.sandboxes.config import SandboxConfig, SandboxLimits

_RETRIES = 4
_RETRY_STATUS = (502, 503, 504)


def _detail(response: HttpResponse) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        return str(body.get("detail") or body.get("title") or body)
    return str(body)


class SandboxClient:
    """HTTP client of one sandboxd (`base_url`, e.g. `http://127.0.0.1:8765`)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        create_timeout: float = 300.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.create_timeout = create_timeout
        self.http = HttpClient(self.base_url, headers=headers, timeout=timeout)

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (sandboxes stay in the service until closed or leased out)."""
        await self.http.aclose()

    async def request(
        self,
        method: str,
        url: str,
        *,
        retries: int = _RETRIES,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> HttpResponse:
        """One API call, retried on transport errors and 502/503/504 (callers make it safe)."""
        delay = 0.1
        for attempt in range(retries + 1):
            try:
                response = await self.http.request(method, url, timeout=timeout, **kwargs)
            except HttpTransportError as err:
                if attempt == retries:
                    raise SandboxLost(
                        f"sandboxd at {self.base_url} is unreachable ({method} {url}): {err!r}"
                    ) from err
            else:
                if response.status_code not in _RETRY_STATUS or attempt == retries:
                    return response
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")

    async def create(
        self, config: SandboxConfig | None = None, *, episode_id: str | None = None
    ) -> RemoteSandbox:
        """A new sandbox in the service, with `config`'s backend, image, limits, env and egress
        (a default config takes the service's defaults and its warm pool)."""
        body: dict[str, Any] = {"episode_id": episode_id}
        if config is not None:
            default = SandboxConfig()
            if config.backend != "auto":
                body["backend"] = config.backend
            if config.image != default.image:
                body["image"] = config.image
            if config.limits != default.limits:
                body["limits"] = config.limits.model_dump()
            if config.env:
                body["env"] = config.env
            if config.egress_allowlist is not None:
                body["egress_allowlist"] = config.egress_allowlist
                body["egress_network"] = config.egress_network
            if config.workdir != default.workdir:
                body["workdir"] = config.workdir
        deadline = time.monotonic() + self.create_timeout
        while True:
            response = await self.request("POST", "/v1/sandboxes", json=body, retries=0)
            if response.status_code == 429 and time.monotonic() < deadline:
                wait = float(response.headers.get("retry-after", "1") or 1)
                await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                continue
            if response.status_code != 201:
                raise SandboxError(
                    f"sandboxd refused to create a sandbox ({response.status_code}): "
                    f"{_detail(response)}"
                )
            info = response.json()
            return RemoteSandbox(
                self,
                info["id"],
                limits=SandboxLimits.model_validate(info["limits"]),
                episode_id=info.get("episode_id"),
            )


class RemoteSandbox:
    """A sandbox held by sandboxd; see the module docstring for the retry contract."""

    def __init__(
        self,
        client: SandboxClient,
        sandbox_id: str,
        *,
        limits: SandboxLimits,
        episode_id: str | None = None,
    ) -> None:
        self.id = sandbox_id
        self.client = client
        self.limits = limits
        self.episode_id = episode_id
        self.owns_client = False
        self._closed = False

    def __repr__(self) -> str:
        return f"RemoteSandbox(id={self.id!r}, service={self.client.base_url!r})"

    async def __aenter__(self) -> RemoteSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check(self, response: HttpResponse, what: str) -> HttpResponse:
        if response.status_code == 404:
            raise SandboxLost(
                f"{what} in sandbox {self.id}: sandboxd at {self.client.base_url} no longer "
                f"knows it (the service restarted): {_detail(response)}"
            )
        if response.status_code >= 400:
            status = response.status_code
            raise SandboxError(
                f"{what} in sandbox {self.id} failed ({status}): {_detail(response)}"
            )
        return response

    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        request_id: str | None = None,
    ) -> ExecResult:
        """Run a command in the service's sandbox, exactly once however often the call is
        retried (one `request_id` for all attempts; pass one to make a retry of your own)."""
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        body: dict[str, Any] = {
            "request_id": request_id or uuid.uuid4().hex,
            "command": command if isinstance(command, str) else list(command),
            "timeout": timeout,
            "stdin_b64": base64.b64encode(data).decode() if data is not None else None,
            "env": dict(env) if env is not None else None,
        }
        wait = (timeout or self.limits.timeout) + self.limits.kill_grace + 30.0
        response = await self.client.request(
            "POST", f"/v1/sandboxes/{self.id}/exec", json=body, timeout=wait
        )
        return ExecResult.model_validate(self._check(response, "exec").json())

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write a workspace file through the service (paths leaving it are refused)."""
        payload = data.encode() if isinstance(data, str) else data
        response = await self.client.request(
            "PUT", f"/v1/sandboxes/{self.id}/files", params={"path": path}, content=payload
        )
        self._check(response, f"write of {path!r}")

    async def read_file(self, path: str) -> bytes:
        """Read a workspace file through the service (paths leaving it are refused)."""
        response = await self.client.request(
            "GET", f"/v1/sandboxes/{self.id}/files", params={"path": path}
        )
        return self._check(response, f"read of {path!r}").content

    async def close(self) -> None:
        """Ask the service to remove the sandbox (idempotent)."""
        if self._closed:
            return
        try:
            response = await self.client.request("DELETE", f"/v1/sandboxes/{self.id}")
            self._check(response, "close")
            self._closed = True
        finally:
            if self.owns_client:
                await self.client.aclose()


async def create_remote_sandbox(
    config: SandboxConfig,
    *,
    url: str,
    token: str | None = None,
    episode_id: str | None = None,
) -> RemoteSandbox:
    """One sandbox from the sandboxd at `url`, with a client of its own that its `close` closes
    (a worker making many sandboxes should share one `SandboxClient` instead)."""
    client = SandboxClient(url, token=token)
    try:
        sandbox = await client.create(config, episode_id=episode_id)
    except BaseException:
        await client.aclose()
        raise
    sandbox.owns_client = True
    return sandbox
