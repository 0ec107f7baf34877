"""The web dashboard: static pages served at `/`, plus the one endpoint they need beyond `/v1`.

The pages (`static/`) are plain HTML, CSS and JavaScript modules that read the REST API from
the browser; nothing here renders HTML. The extra endpoint, `GET /v1/tokens/{episode_id}`,
turns a trajectory's token ids into text pieces with the server's tokenizer, so the
trajectory viewer can overlay the loss mask and logprobs on readable text. It lives under its
own path because the API's `GET /v1/episodes/{episode_id:path}` matches every suffix.

Two ways to serve it: pass `routes()` to `create_app(..., extra_routes=...)` (what
`omniloop serve` does), or call `mount_dashboard(app)` on a built app.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, FastAPI, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles

from omniloop.platform.api.problems import ApiProblem
from omniloop.platform.api.routes import NO_NUL, api_state, responses

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STATIC_DIR = Path(__file__).with_name("static")
"""The dashboard's files; `index.html` is served at `/`."""

MAX_MERGE = 8
"""Most tokens merged into one piece when single tokens decode to partial UTF-8 characters."""


class TokenOut(BaseModel):
    """One token of a trajectory, as the viewer shows it."""

    model_config = ConfigDict(extra="forbid")

    id: int
    text: str
    """The token's text. A character split over several tokens is given whole on its last
    token, and as "" on the ones before it."""
    mask: int
    """1 for tokens the policy sampled (trained on), 0 for prompt and observation tokens."""
    logprob: float | None
    """The engine's logprob of a sampled token; None where `mask` is 0."""
    weight_version: int
    """The weight version that sampled the token; -1 where `mask` is 0."""


class TrajectoryTokens(BaseModel):
    """`GET /v1/tokens/{episode_id}`: an episode's trajectory as text pieces."""

    model_config = ConfigDict(extra="forbid")

    episode_id: str
    trajectory_id: str
    tokenizer: str
    """The tokenizer that decoded the ids (the server's engine model)."""
    prompt_length: int
    tokens: list[TokenOut]


@functools.lru_cache(maxsize=4)
def _tokenizer(spec: str) -> PreTrainedTokenizerBase:
    from omniloop.inference.models import load_tokenizer

    return load_tokenizer(spec)


def token_pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """The text of each token of `ids`, in order; the pieces join to the decoded sequence.

    Tokens are decoded one by one. A byte-level tokenizer may split one character over several
    tokens, each of which decodes alone to U+FFFD; such runs (up to `MAX_MERGE` tokens) are
    decoded together and the text is given to the run's last token.
    """
    singles: list[str] = tokenizer.batch_decode(
        [[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    pieces: list[str] = []
    start = 0
    for index, single in enumerate(singles):
        if "\ufffd" not in single and start == index:
            pieces.append(single)
            start = index + 1
            continue
        text = str(
            tokenizer.decode(
                ids[start : index + 1],
                skip_special_tokens=False,
                clean_up_tokenization_spaces=False,
            )
        )
        pending = index + 1 - start
        if text.endswith("\ufffd") and pending < MAX_MERGE and index + 1 < len(ids):
            pieces.append("")
            continue
        pieces.append(text)
        start = index + 1
    return pieces


def tokens_router() -> APIRouter:
    """`GET /v1/tokens/{episode_id}`: a read under `/v1`, guarded like every other one
    (`auth.py`: beyond loopback it needs the token)."""
    router = APIRouter(prefix="/v1", tags=["dashboard"])

    @router.get(
        "/tokens/{episode_id:path}",
        response_model=TrajectoryTokens,
        summary="Get an episode's tokens as text",
        responses=responses(404, 409, 422),
    )
    async def get_tokens(
        request: Request, episode_id: Annotated[str, PathParam(max_length=64, pattern=NO_NUL)]
    ) -> TrajectoryTokens:
        """Each token of the episode's trajectory with its text, loss mask, logprob and weight
        version, decoded by the server's tokenizer. 409 while the episode has no trajectory."""
        state = api_state(request)
        record = await state.store.get_episode(episode_id, with_trajectory=True)
        trajectory = record.trajectory
        if trajectory is None:
            raise ApiProblem(
                409,
                "no-trajectory",
                f"episode {episode_id!r} is {record.status} and has no trajectory yet",
            )
        spec = state.settings.engine.model
        tokenizer = await run_in_threadpool(_tokenizer, spec)
        pieces = await run_in_threadpool(token_pieces, tokenizer, trajectory.input_ids)
        return TrajectoryTokens(
            episode_id=record.id,
            trajectory_id=trajectory.id,
            tokenizer=spec,
            prompt_length=trajectory.prompt_length,
            tokens=[
                TokenOut(
                    id=token,
                    text=text,
                    mask=mask,
                    logprob=logprob if mask else None,
                    weight_version=version,
                )
                for token, text, mask, logprob, version in zip(
                    trajectory.input_ids,
                    pieces,
                    trajectory.loss_mask,
                    trajectory.rollout_logprobs,
                    trajectory.weight_version,
                    strict=True,
                )
            ],
        )

    return router


def static_mount() -> Mount:
    """The pages at `/` (`index.html` for the bare path). Add it after the API's routes."""
    return Mount("/", app=StaticFiles(directory=STATIC_DIR, html=True), name="dashboard")


def routes() -> list[BaseRoute]:
    """Everything the dashboard serves, for `create_app(..., extra_routes=routes())`."""
    return [*tokens_router().routes, static_mount()]


def mount_dashboard(app: FastAPI) -> None:
    """Serve the dashboard from an app built without it (after the app's own routes)."""
    app.include_router(tokens_router())
    app.router.routes.append(static_mount())
