"""`ServiceSandboxes` asks the sandbox deployment for an endpoint once per burst: acquires that
find the endpoint stale while a question is under way wait for its answer."""

from __future__ import annotations

import asyncio

import pytest

from omniloop.platform.control.sandbox_service import ServiceSandboxes
from omniloop.sandboxes.config import SandboxConfig


class EndpointHandle:
    """A stand-in for the deployment's handle: `endpoint.remote()` answers after `seconds`
    (or once `release` is set, when given), naming replica `n` (the count of questions so
    far), or raises while `failing`."""

    def __init__(self, seconds: float = 0.05, release: asyncio.Event | None = None) -> None:
        self.seconds = seconds
        self.release = release
        self.asked = 0
        self.failing = False
        self.endpoint = self

    def remote(self) -> asyncio.Future[tuple[str, str]]:
        self.asked += 1
        n, failing = self.asked, self.failing

        async def answer() -> tuple[str, str]:
            if self.release is not None:
                await self.release.wait()
            else:
                await asyncio.sleep(self.seconds)
            if failing:
                raise TimeoutError("no replica answered")
            return f"http://127.0.0.1:{9000 + n}", "token"

        return asyncio.ensure_future(answer())


def test_a_burst_of_acquires_asks_for_the_endpoint_once(monkeypatch: pytest.MonkeyPatch) -> None:
    handle = EndpointHandle()
    sandboxes = ServiceSandboxes(handle, SandboxConfig(backend="bwrap"), wait_s=5.0)  # type: ignore[arg-type]

    async def main() -> None:
        try:
            burst = await asyncio.gather(*(sandboxes._client(5.0) for _ in range(16)))
            assert handle.asked == 1
            assert len({id(client) for client in burst}) == 1
            # Within ENDPOINT_REUSE_S the endpoint is reused without asking.
            await sandboxes._client(5.0)
            assert handle.asked == 1
            # Once stale, the next burst asks again, once.
            monkeypatch.setattr(ServiceSandboxes, "ENDPOINT_REUSE_S", 0.0)
            later = await asyncio.gather(*(sandboxes._client(5.0) for _ in range(8)))
            assert handle.asked == 2
            assert {client.base_url for client in later} == {"http://127.0.0.1:9002"}
        finally:
            await sandboxes.aclose()

    asyncio.run(main())


def test_a_failed_question_fails_its_waiters_and_the_next_acquire_asks_again() -> None:
    handle = EndpointHandle()
    handle.failing = True
    sandboxes = ServiceSandboxes(handle, SandboxConfig(backend="bwrap"), wait_s=5.0)  # type: ignore[arg-type]

    async def main() -> None:
        try:
            results = await asyncio.gather(
                *(sandboxes._client(5.0) for _ in range(4)), return_exceptions=True
            )
            assert all(isinstance(r, TimeoutError) for r in results), results
            assert handle.asked == 1
            handle.failing = False
            client = await sandboxes._client(5.0)
            assert handle.asked == 2
            assert client.base_url == "http://127.0.0.1:9002"
        finally:
            await sandboxes.aclose()

    asyncio.run(main())


def test_a_waiter_that_gives_up_leaves_the_question_to_the_others() -> None:
    async def main() -> None:
        # The answer comes only after the impatient waiter has given up.
        handle = EndpointHandle(release=asyncio.Event())
        sandboxes = ServiceSandboxes(handle, SandboxConfig(backend="bwrap"), wait_s=5.0)  # type: ignore[arg-type]
        try:
            impatient = asyncio.create_task(sandboxes._client(0.05))
            patient = asyncio.create_task(sandboxes._client(30.0))
            with pytest.raises(TimeoutError):
                await impatient
            assert handle.release is not None
            handle.release.set()
            client = await patient
            assert handle.asked == 1
            assert client.base_url == "http://127.0.0.1:9001"
        finally:
            await sandboxes.aclose()

    asyncio.run(main())
