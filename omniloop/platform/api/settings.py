"""`ApiSettings`: what `omniloop serve` runs with, loaded from YAML plus dotted overrides.

The one safety rule lives here: a server that binds beyond loopback must have a bearer token
(`api_token`, default `$OMNILOOP_API_TOKEN`); settings that would expose an unauthenticated
server fail validation, so `omniloop serve` refuses to start. Which requests then need the
token is `auth.AccessPolicy`'s rule: beyond loopback, every `/v1` request and event stream.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from omniloop.config import StrictModel
from omniloop.inference.base import SamplingParams
from omniloop.modalities.config import MediaConfig
from omniloop.platform.control.rollout_config import EngineConfig
from omniloop.sandboxes.config import SandboxConfig

TOKEN_ENV = "OMNILOOP_API_TOKEN"
"""Environment variable holding the API's bearer token (server and `omniloop episode`)."""

MIN_TOKEN_LENGTH = 16
"""Shortest accepted token: a guessable token is no protection on a reachable port."""

AGENT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Agent names clients may use: 1 to 64 characters, letters, digits, `_`, `.`, `-`."""

LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """True when `host` names only this machine: `localhost`, 127.0.0.0/8 or ::1.

    Any other name (including `0.0.0.0`, `::`, the empty string and hostnames that might
    resolve elsewhere) counts as beyond loopback.
    """
    candidate = host.strip().strip("[]").lower()
    if candidate in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(candidate).is_loopback
    except ValueError:
        return False


def _token_from_env() -> SecretStr | None:
    value = os.environ.get(TOKEN_ENV, "")
    return SecretStr(value) if value else None


def _resolve_spec(spec: str, base_dir: Path | None) -> str:
    """`file.py:name` with the file made relative to the config file's folder."""
    module, sep, attr = spec.partition(":")
    if not sep or not module.endswith(".py") or base_dir is None:
        return spec
    path = Path(module)
    if not path.is_absolute():
        candidate = base_dir / path
        if candidate.exists() or not path.exists():
            path = candidate
    return f"{path}:{attr}"


class AgentEntry(StrictModel):
    """One agent clients may ask for by name in `POST /v1/episodes`."""

    agent: str
    """`file.py:name` or `module:name` of an Agent, or of a function returning one."""
    rewards: list[str] = Field(default_factory=list)
    """Reward functions: built-in names (`exact_match`, `math_equal`, `format_reward`) or
    `file.py:name` / `module:name`. Their values are summed."""
    description: str = ""
    """Shown to clients in `GET /v1/agents`."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling options used where a request leaves them out."""
    max_turns: int = Field(default=8, ge=1)
    """Assistant turns per episode when a request does not say."""

    @field_validator("agent")
    @classmethod
    def _agent_path(cls, value: str, info: ValidationInfo) -> str:
        return _resolve_spec(value, (info.context or {}).get("base_dir"))

    @field_validator("rewards")
    @classmethod
    def _reward_paths(cls, value: list[str], info: ValidationInfo) -> list[str]:
        base = (info.context or {}).get("base_dir")
        return [_resolve_spec(spec, base) for spec in value]


class ApiLimits(StrictModel):
    """Input limits; a request over one is refused with a problem naming the limit."""

    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    """Largest request body; larger ones get 413."""
    max_new_tokens: int = Field(default=4096, ge=1)
    """Largest `sampling.max_new_tokens` a request may ask for."""
    max_turns: int = Field(default=64, ge=1)
    """Largest `max_turns` a request may ask for."""


class ApiSettings(StrictModel):
    """The REST server: where it listens, what it stores, and how it runs submitted episodes."""

    host: str = "127.0.0.1"
    """Interface to bind. Anything but loopback requires `api_token`."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port; 0 picks a free one (the chosen URL is printed)."""
    db_url: str | None = None
    """The run store's database URL; None means `$OMNILOOP_DB_URL`, else
    `sqlite:///runs/omniloop.db`."""
    api_token: SecretStr | None = Field(default_factory=_token_from_env)
    """Bearer token (`Authorization: Bearer <token>`); defaults to `$OMNILOOP_API_TOKEN`. Every
    POST needs it; on a server bound beyond loopback so does every `/v1` request, reads and
    event streams included (`/healthz`, `/readyz`, `/docs` and the dashboard's pages stay
    open). None leaves the API open, which is allowed on loopback only."""
    metrics_need_token: bool = True
    """Whether `/metrics` (Prometheus) needs the token on a server bound beyond loopback (on
    loopback it is open, like every read). On by default: request and episode counts describe
    how the server is used. Prometheus sends the token with `authorization: {credentials_file:
    ...}` in its scrape config; turn this off only for a scraper that cannot."""
    metrics_recent_runs: int = Field(default=20, ge=0, le=200)
    """`/metrics` exports the faults of every running run and of this many newest runs
    whatever their status (so a run that just failed is still seen); 0: running runs only."""
    agents: dict[str, AgentEntry] = Field(default_factory=dict)
    """Agents clients may name in `POST /v1/episodes`, by name."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The inference engine episodes sample from (a URL, or a local CPU engine to start)."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Tool sandboxes for episodes."""
    concurrency: int = Field(default=4, ge=0)
    """Episodes running at once in this process; 0 pauses the worker (episodes only queue,
    and no engine or sandbox is started)."""
    max_queued_episodes: int | None = Field(default=1024, ge=1)
    """Back-pressure: while this many episodes are `queued` in the database (waiting for a
    worker, whoever submitted them), `POST /v1/episodes` answers 503 `queue-full` with
    `Retry-After` and creates nothing. None (`max_queued_episodes=null`) leaves the queue
    unbounded. Counting reads at most this many index entries per batch of submissions."""
    max_context: int = Field(default=2048, ge=16)
    """Most tokens in one episode (prompt + all turns), and in one gateway session's
    conversation."""
    gateway: bool = True
    """Serve OpenAI-compatible chat completions (`/v1/chat/completions`, `/v1/models`,
    `/v1/sessions/{id}`) over the engine that runs the episodes, recorded token-exactly per
    session (docs/gateway.md). Only while that engine runs: not with `concurrency: 0` or
    without agents."""
    media: MediaConfig = Field(default_factory=MediaConfig)
    """Bounds and sampling rules of images, audio and video in prompts and tool results. A
    submitted prompt carries media inline only (`data:` URIs), never as a server path."""
    media_dir: str = "runs/media"
    """Where the media of submitted episodes are stored, once each by content hash."""
    reward_timeout: float = Field(default=30.0, gt=0)
    """Seconds a reward may take before the episode is marked `reward_error`."""
    poll_interval: float = Field(default=1.0, gt=0)
    """Seconds between looks at the database for work and events that another process wrote
    (in-process changes wake waiters at once)."""
    recover_on_start: bool = True
    """Put episodes left `running` outside any run (by a server that died) back in the queue
    at start. Assumes one API server per database."""
    limits: ApiLimits = Field(default_factory=ApiLimits)
    """Input limits."""
    cors_origins: list[str] = Field(default_factory=list)
    """Browser origins allowed to call the API from another origin (e.g. a dashboard served
    elsewhere); empty allows none."""

    @field_validator("agents")
    @classmethod
    def _agent_names(cls, value: dict[str, AgentEntry]) -> dict[str, AgentEntry]:
        for name in value:
            if not re.fullmatch(AGENT_NAME_PATTERN, name):
                raise ValueError(
                    f"agent name {name!r} must be 1 to 64 letters, digits, '_', '.' or '-', "
                    "starting with a letter or digit"
                )
        return value

    @field_validator("api_token")
    @classmethod
    def _token_strength(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        secret = value.get_secret_value()
        if not secret:
            return None
        if len(secret) < MIN_TOKEN_LENGTH or not secret.isprintable() or " " in secret:
            raise ValueError(
                f"api_token must be at least {MIN_TOKEN_LENGTH} printable characters without "
                "spaces (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        return value

    @model_validator(mode="after")
    def _token_beyond_loopback(self) -> ApiSettings:
        if self.api_token is None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host!r} without a bearer token: anyone who can "
                f"reach the port could read every trajectory and submit episodes. Set "
                f"{TOKEN_ENV} (or api_token), or bind 127.0.0.1"
            )
        return self

    @model_validator(mode="after")
    def _agents_within_limits(self) -> ApiSettings:
        for name, entry in self.agents.items():
            if entry.sampling.max_new_tokens > self.limits.max_new_tokens:
                raise ValueError(
                    f"agent {name!r}: sampling.max_new_tokens {entry.sampling.max_new_tokens} is "
                    f"over limits.max_new_tokens {self.limits.max_new_tokens}"
                )
            if entry.max_turns > self.limits.max_turns:
                raise ValueError(
                    f"agent {name!r}: max_turns {entry.max_turns} is over limits.max_turns "
                    f"{self.limits.max_turns}"
                )
        return self

    def token_bytes(self) -> bytes | None:
        """The configured token as bytes, for constant-time comparison; None when open."""
        return None if self.api_token is None else self.api_token.get_secret_value().encode()

    def public_dump(self) -> dict[str, Any]:
        """The settings as JSON-ready data, the token masked (for printing at start)."""
        data = self.model_dump(mode="json")
        data["api_token"] = None if self.api_token is None else "**********"
        return data
