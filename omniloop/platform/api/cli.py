"""`omniloop serve` (the REST server) and `omniloop episode submit|get|watch|cancel` (its client).

The client reads the server's URL from `--url` or `$OMNILOOP_API_URL` (default
`http://127.0.0.1:8000`) and the token from `$OMNILOOP_API_TOKEN`. It prints JSON on stdout
(one document, or one event per line for `watch`) and errors on stderr. Exit codes: 0 success
(`watch`: the episode completed), 1 the server refused or failed (`watch`: the episode failed
or was cancelled), 2 bad usage or configuration.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from omniloop.errors import OmniloopError

if TYPE_CHECKING:
    import httpx
    from starlette.routing import BaseRoute

    from omniloop.platform.api.settings import ApiSettings

URL_ENV = "OMNILOOP_API_URL"
DEFAULT_URL = "http://127.0.0.1:8000"
WATCH_RECONNECTS = 5
"""Times `watch` resumes a dropped stream (with Last-Event-ID) before giving up."""
TERMINAL = ("completed", "failed", "cancelled")


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


# -- omniloop serve --------------------------------------------------------------------------


def serve(
    config: Annotated[
        Path | None, typer.Option("--config", help="YAML server config (ApiSettings).")
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="Dotted overrides, e.g. concurrency=2 engine.url=http://..."),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Interface to bind (non-loopback needs a token).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port; 0 picks a free one.")] = None,
    db_url: Annotated[str | None, typer.Option("--db-url", help="Run store database URL.")] = None,
    log_level: Annotated[str, typer.Option(help="Log level (uvicorn and omniloop).")] = "info",
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved settings and stop.")
    ] = False,
) -> None:
    """Serve the REST API (/v1) and run submitted episodes.

    Prints `omniloop api ready at URL` once it accepts requests. Refuses to bind beyond
    loopback without $OMNILOOP_API_TOKEN.
    """
    import logging

    import yaml

    from omniloop.config import load_config
    from omniloop.platform.api.settings import ApiSettings

    flags = list(overrides or [])
    # JSON strings are YAML strings: `::1` or a URL with `:` stay strings.
    if host is not None:
        flags.append(f"host={json.dumps(host)}")
    if port is not None:
        flags.append(f"port={port}")
    if db_url is not None:
        flags.append(f"db_url={json.dumps(db_url)}")
    try:
        settings = load_config(ApiSettings, config, flags)
    except OmniloopError as err:
        raise _fail(str(err), 2) from None
    typer.echo(yaml.safe_dump(settings.public_dump(), sort_keys=False), err=True)
    if dry_run:
        return
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    try:
        from omniloop.platform.api.app import create_app

        app = create_app(settings, extra_routes=web_routes())
    except OmniloopError as err:
        raise _fail(str(err), 2) from None
    import asyncio

    code = asyncio.run(_serve(app, settings, log_level))
    if code:
        raise typer.Exit(code)


def web_routes() -> list[BaseRoute]:
    """The dashboard's routes: `omniloop.web.routes()` when the web package provides it."""
    import omniloop.web

    provider = getattr(omniloop.web, "routes", None)
    return list(provider()) if callable(provider) else []


async def _serve(app: Any, settings: ApiSettings, log_level: str) -> int:
    import asyncio

    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=log_level.lower(),
            access_log=False,
            timeout_keep_alive=30,
            # Event streams never end on their own: give them 5 s after SIGTERM, then close.
            timeout_graceful_shutdown=5,
            backlog=2048,
        )
    )
    serving = asyncio.create_task(server.serve())
    freezer: asyncio.Task[None] | None = None
    # uvicorn signals readiness only through the `started` flag (set after the socket binds).
    while not server.started and not serving.done():  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    if server.started:
        _freeze_heap()
        sock = server.servers[0].sockets[0]
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        typer.echo(f"omniloop api ready at http://{shown}:{bound_port}", err=True)
        # The worker imports and loads more (tokenizer, engine client) once it starts.
        freezer = asyncio.create_task(_freeze_when_worker_started(app))
    await serving
    if freezer is not None:
        freezer.cancel()
    # uvicorn exits 3 when the app's startup failed (its log says why).
    return 0 if server.started else 3


def _freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's view.

    What start-up built (modules, the app, pydantic's validators) lives as long as the process;
    left in the collected generations, each full collection walks all of it: measured, a 200 ms
    stall of every request, which was the p99 of `bench/api_load.py`.
    """
    import gc

    gc.collect()
    gc.freeze()


async def _freeze_when_worker_started(app: Any) -> None:
    import asyncio

    worker = app.state.omniloop.worker
    while worker is not None and worker.state == "starting":  # noqa: ASYNC110
        await asyncio.sleep(0.5)
    _freeze_heap()


# -- omniloop episode ------------------------------------------------------------------------

episode_app = typer.Typer(no_args_is_help=True)

UrlOption = Annotated[
    str | None,
    typer.Option("--url", help=f"Server URL (default ${URL_ENV} or {DEFAULT_URL})."),
]


@episode_app.callback()
def episode() -> None:
    """Submit, inspect, follow and cancel episodes on an `omniloop serve` server."""


def _client(url: str | None, timeout: float | None = 30.0) -> httpx.Client:
    import httpx

    from omniloop.platform.api.settings import TOKEN_ENV

    base = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
    headers = {"Accept": "application/json"}
    token = os.environ.get(TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(base_url=base, headers=headers, timeout=timeout)


def _problem_text(response: httpx.Response) -> str:
    try:
        doc = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:500]}"
    if not isinstance(doc, dict):
        return f"HTTP {response.status_code}: {doc!r}"
    lines = [f"HTTP {response.status_code} {doc.get('title', '')}: {doc.get('detail', '')}"]
    for error in doc.get("errors") or []:
        lines.append(f"  {error.get('location')}.{error.get('field')}: {error.get('message')}")
    return "\n".join(lines)


def _request(client: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    import httpx

    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as err:
        raise _fail(f"cannot reach {client.base_url}: {err}") from None
    if response.status_code >= 400:
        raise _fail(_problem_text(response))
    return response.json()


def _print(doc: Any) -> None:
    typer.echo(json.dumps(doc, indent=2))


@episode_app.command()
def submit(
    agent: Annotated[str, typer.Argument(help="Agent name (see GET /v1/agents).")],
    prompt: Annotated[
        str | None, typer.Argument(help="The task's prompt (or give --task-file).")
    ] = None,
    answer: Annotated[str | None, typer.Option(help="Reference answer for rewards.")] = None,
    task_id: Annotated[str | None, typer.Option("--task-id", help="Task id.")] = None,
    task_file: Annotated[
        Path | None,
        typer.Option("--task-file", help="A JSON task (id, prompt, answer, metadata)."),
    ] = None,
    max_turns: Annotated[int | None, typer.Option(help="Most assistant turns.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Most tokens per turn.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option("--idempotency-key", help="Retry-safe key: resubmitting returns the same."),
    ] = None,
    watch_events: Annotated[
        bool, typer.Option("--watch", help="Follow the episode's events until it ends.")
    ] = False,
    url: UrlOption = None,
) -> None:
    """Queue an episode; print the server's answer (with the episode id) as JSON."""
    if task_file is not None:
        try:
            task: dict[str, Any] = json.loads(task_file.read_text())
        except (OSError, ValueError) as err:
            raise _fail(f"cannot read task file {str(task_file)!r}: {err}", 2) from None
        if not isinstance(task, dict):
            raise _fail(f"task file {str(task_file)!r} must hold a JSON object", 2)
    elif prompt is not None:
        task = {"prompt": prompt}
    else:
        raise _fail("give a PROMPT or --task-file", 2)
    if answer is not None:
        task["answer"] = answer
    if task_id is not None:
        task["id"] = task_id
    sampling = {
        key: value
        for key, value in (
            ("max_new_tokens", max_new_tokens),
            ("temperature", temperature),
            ("seed", seed),
        )
        if value is not None
    }
    body: dict[str, Any] = {"agent": agent, "task": task, "sampling": sampling}
    if max_turns is not None:
        body["max_turns"] = max_turns
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    with _client(url) as client:
        accepted = _request(client, "POST", "/v1/episodes", json=body, headers=headers)
    _print(accepted)
    if watch_events:
        raise typer.Exit(_watch(url, accepted["id"], None))


@episode_app.command()
def get(
    episode_id: Annotated[str, typer.Argument(help="The episode id.")],
    trajectory: Annotated[
        bool, typer.Option("--trajectory/--no-trajectory", help="Include the trajectory.")
    ] = True,
    url: UrlOption = None,
) -> None:
    """Print the episode (status, reward, error, trajectory) as JSON."""
    with _client(url) as client:
        doc = _request(
            client,
            "GET",
            f"/v1/episodes/{_quote(episode_id)}",
            params={"trajectory": str(trajectory).lower()},
        )
    _print(doc)


@episode_app.command()
def watch(
    episode_id: Annotated[str, typer.Argument(help="The episode id.")],
    last_event_id: Annotated[
        int | None, typer.Option("--last-event-id", help="Start after this event id.")
    ] = None,
    url: UrlOption = None,
) -> None:
    """Print the episode's events, one JSON object per line, until it ends.

    Exits 0 when the episode completed, 1 when it failed or was cancelled. A dropped stream is
    resumed where it broke off.
    """
    raise typer.Exit(_watch(url, episode_id, last_event_id))


@episode_app.command()
def cancel(
    episode_id: Annotated[str, typer.Argument(help="The episode id.")],
    url: UrlOption = None,
) -> None:
    """Cancel a queued or running episode; print it as JSON."""
    with _client(url) as client:
        doc = _request(client, "POST", f"/v1/episodes/{_quote(episode_id)}/cancel")
    _print(doc)


def _quote(segment: str) -> str:
    from urllib.parse import quote

    return quote(segment, safe="")


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, str]]:
    """Server-Sent Events parsed from a stream's lines: dicts with `id`, `event`, `data`."""
    current: dict[str, str] = {}
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield {**current, "data": "\n".join(data)}
            current, data = {}, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name in ("id", "event"):
            current[name] = value
    if data:
        yield {**current, "data": "\n".join(data)}


def _watch(url: str | None, episode_id: str, last_event_id: int | None) -> int:
    """Follow the stream to the episode's end, resuming after drops; 0 when it completed."""
    import httpx

    path = f"/v1/episodes/{_quote(episode_id)}"
    status: str | None = None
    drops = 0
    with _client(url, timeout=None) as client:
        while True:
            headers = {"Accept": "text/event-stream"}
            if last_event_id is not None:
                headers["Last-Event-ID"] = str(last_event_id)
            try:
                with client.stream("GET", f"{path}/events", headers=headers) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise _fail(_problem_text(response))
                    for event in sse_events(response.iter_lines()):
                        payload = json.loads(event["data"])
                        typer.echo(json.dumps(payload))
                        sys.stdout.flush()
                        if "id" in event:
                            last_event_id = int(event["id"])
                        if payload.get("type") == "status":
                            status = payload.get("data", {}).get("status", status)
            except httpx.HTTPError as err:
                error = f"lost the event stream of {episode_id}: {err}"
            else:
                if status in TERMINAL:
                    break
                # Ended without a terminal event: nothing was left to send (the episode was
                # already over), or the server closed the stream (a restart). Ask which.
                status = _request(client, "GET", path, params={"trajectory": "false"})["status"]
                if status in TERMINAL:
                    break
                error = f"the event stream of {episode_id} ended while it is {status}"
            drops += 1
            if drops > WATCH_RECONNECTS:
                raise _fail(error)
            time.sleep(min(2.0**drops / 4, 5.0))
    return 0 if status == "completed" else 1


def register(app: typer.Typer) -> None:
    """Attach `serve` and the `episode` commands to the root app."""
    app.command("serve")(serve)
    app.add_typer(episode_app, name="episode", help="Submit and follow episodes over REST.")
