"""Shared fixtures. Tests are not a package: transferqueue installs a top-level `tests`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from omniloop.processes import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# -- process fixtures ------------------------------------------------------------------------


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def _still_running(pids: Iterable[int], within: float = 0.0) -> list[int]:
    pids = list(pids)
    deadline = time.monotonic() + within
    while True:
        left = [pid for pid in pids if _running(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


@pytest.fixture(scope="session")
def still_running() -> Callable[..., list[int]]:
    """`still_running(pids, within=0.0)`: those of `pids` still running (not ended, not a
    zombie) once all have ended or `within` seconds have passed, checked every 0.1 s."""
    return _still_running


# -- engine fixtures -------------------------------------------------------------------------

ENGINE_MAX_CONTEXT = 512
"""Context length of the `tiny_engine_url` server (small, so over-long prompts are cheap)."""
ENGINE_MAX_BATCH = 8


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@contextlib.contextmanager
def served_engine(log: Path, model: str, *options: str) -> Iterator[str]:
    """`omniloop engine serve --model MODEL --port 0 --threads 1 OPTIONS` as a subprocess
    writing to `log`, for the block; yields its URL once `/health` answers. Port 0: the server
    binds a free port itself and prints it, so no port can be taken between choosing it and
    binding it. The log is shown if the server exits or is not healthy within 180 s."""
    exe = Path(sys.executable).parent / "omniloop"
    cmd = [str(exe), "engine", "serve", "--model", model, "--port", "0", "--threads", "1"]
    with log.open("wb") as out:
        proc = subprocess.Popen([*cmd, *options], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        url: str | None = None
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {proc.returncode} before serving:\n{log.read_text()}"
                )
            if url is None:
                ready = [ln for ln in log.read_text().splitlines() if "engine ready at " in ln]
                url = ready[0].split("ready at ", 1)[1].split()[0] if ready else None
            try:
                if url is not None and httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not healthy after 180 s:\n{log.read_text()}")
            time.sleep(0.1)
        assert url is not None
        yield url
    finally:
        _stop_process(proc)


@pytest.fixture(scope="session")
def engine_server() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """`served_engine`, for test modules that serve a model of their own."""
    return served_engine


@pytest.fixture(scope="session")
def tiny_engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of `omniloop engine serve --model tiny` run as a subprocess for the whole session.

    One torch thread (the CI machine has two cores shared by everything), 8 slots, a context
    of 512 tokens. The server's output is in the session's temp dir and shown on failure.
    """
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    options = ["--max-batch", str(ENGINE_MAX_BATCH), "--max-context", str(ENGINE_MAX_CONTEXT)]
    with served_engine(log, "tiny", *options) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_engine_max_context() -> int:
    """The context length `tiny_engine_url` serves with."""
    return ENGINE_MAX_CONTEXT


# -- sandboxd -------------------------------------------------------------------------------


class Sandboxd:
    """A sandboxd subprocess (`python -m omniloop.sandboxes.docker_cli serve`)."""

    def __init__(self, log: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "omniloop.sandboxes.docker_cli", "serve"]
        command += ["--port", str(self.port), *args]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandboxd exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"sandboxd not ready after {timeout}s:\n{self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        return int(self.proc.returncode)


@pytest.fixture(scope="session")
def sandboxd_class() -> type[Sandboxd]:
    """`sandboxd_class(log_path, *cli_args)`: a sandboxd subprocess (tests are no package, so
    the class travels as a fixture)."""
    return Sandboxd


# -- read-only paths ----------------------------------------------------------------------------


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A host folder for `SandboxConfig.read_only_paths`: under /tmp with 0755, so a sandbox's
    own user may read it (pytest's tmp_path is 0700), holding `data.txt`, writable by anyone
    (only a read-only mount may stop a write)."""
    folder = Path(tempfile.mkdtemp(prefix="omniloop-ro-", dir="/tmp"))
    os.chmod(folder, 0o755)
    (folder / "data.txt").write_text("seen from inside\n")
    os.chmod(folder / "data.txt", 0o666)
    try:
        yield folder
    finally:
        (folder / "data.txt").unlink(missing_ok=True)
        folder.rmdir()


async def _readable_not_writable(sandbox: Any, folder: Path) -> None:
    read = await sandbox.exec(["cat", str(folder / "data.txt")])
    assert read.stdout == "seen from inside\n"
    write = await sandbox.exec(["sh", "-c", f"echo x > {folder}/data.txt"])
    assert write.exit_code != 0
    assert "Read-only file system" in write.stderr
    assert (folder / "data.txt").read_text() == "seen from inside\n"


@pytest.fixture
def check_read_only() -> Callable[[Any, Path], Awaitable[None]]:
    """`await check_read_only(sandbox, shared_folder)`: the folder is readable inside the
    sandbox at its own path and a write to it fails on the read-only mount."""
    return _readable_not_writable
