"""`GET /v1/episodes/{id}/media/{index}`: the bytes of an episode's images, audio and video,
read from the media store of its run (`RUN_DIR/media`) or, for an episode submitted over REST,
from the server's `media_dir`; with the format's Content-Type, cacheable for good, guarded by
the token like every `/v1` read, and a problem for whatever cannot be served.

A real SQLite store and real `MediaStore` folders; the app is called in-process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import omniloop.web
from omniloop.modalities import Media, MediaPlacement, MediaStore, synth
from omniloop.platform.api import create_app
from omniloop.platform.store import Store
from omniloop.trajectory import (
    ToolCallRecord,
    Trajectory,
    TrajectoryBuilder,
    TrajectoryMeta,
    TurnRecord,
)

TOKEN = "media-token-0123456789abcdef"
PNG = synth.solid_png(64, 48)
WAV = synth.tone_wav(0.25)
# tiny-omni's placeholder and marker ids.
IMAGE, AUDIO = 49152, 49153
VISION_BOS, VISION_EOS, AUDIO_BOS, AUDIO_EOS = 49155, 49156, 49157, 49158
CACHE_CONTROL = "private, max-age=31536000, immutable"


def _placed(media: Media, offset: int, tokens: int) -> dict[str, Any]:
    return MediaPlacement(**media.model_dump(), offset=offset, tokens=tokens).model_dump(
        mode="json"
    )


def media_trajectory(episode_id: str, run_id: str, media: list[Media]) -> Trajectory:
    """A one-turn trajectory: `media[0]` in the prompt (4 placeholders), the rest returned by
    a tool after the turn (3 placeholders each)."""
    builder = TrajectoryBuilder([1, 2, VISION_BOS, *[IMAGE] * 4, VISION_EOS, 3])
    placed = [_placed(media[0], 3, 4)]
    builder.add_sampled([10, 11, 12], [-0.5] * 3, version=0)
    observation_start = len(builder)
    builder.add_observation([7])
    for item in media[1:]:
        placed.append(_placed(item, len(builder) + 1, 3))
        builder.add_observation([AUDIO_BOS, *[AUDIO] * 3, AUDIO_EOS])
    turn = TurnRecord(
        start=builder.prompt_length,
        num_sampled=3,
        num_observation=len(builder) - observation_start,
        finish_reason="stop",
        weight_version=0,
    )
    call = ToolCallRecord(turn=0, name="listen", arguments={}, raw="{}", output="a clip")
    meta = TrajectoryMeta(
        run_id=run_id,
        episode_id=episode_id,
        turns=[turn],
        tool_calls=[call],
        stop_reason="stop",
    )
    return builder.build(meta, placed).model_copy(update={"reward": 1.0})


def seed(
    db_url: str,
    media_dir: Path,
    *,
    episode_id: str = "ep",
    run_id: str | None = None,
    run_dir: str | None = None,
    items: tuple[tuple[bytes, str], ...] = ((PNG, "image"), (WAV, "audio")),
) -> list[Media]:
    """An episode with a trajectory whose media are stored in `media_dir`; a run with
    `run_dir` in its configuration when `run_id` is given."""
    media_store = MediaStore(media_dir)
    media = [media_store.put(data, kind) for data, kind in items]
    store = Store(db_url)
    try:
        store.migrate()
        if run_id is not None:
            config = {} if run_dir is None else {"run_dir": run_dir}
            store.create_run("train", config, run_id=run_id, status="running")
        store.create_episode(
            {"id": "t0"}, run_id=run_id, agent="calc", episode_id=episode_id, status="running"
        )
        store.finish_episode(episode_id, media_trajectory(episode_id, run_id or "local", media))
    finally:
        store.close()
    return media


async def test_an_episode_s_media_are_served_with_their_type_and_cached_for_good(
    make_settings, open_api, tmp_path
):
    settings = make_settings(media_dir=str(tmp_path / "media"))
    seed(settings.db_url, tmp_path / "media")
    async with open_api(settings) as api:
        image = await api.get("/v1/episodes/ep/media/0")
        audio = await api.get("/v1/episodes/ep/media/1")
        detail = (await api.get("/v1/episodes/ep")).json()
    assert image.status_code == 200, image.text
    assert image.content == PNG
    assert image.headers["content-type"] == "image/png"
    assert image.headers["content-length"] == str(len(PNG))
    assert audio.status_code == 200, audio.text
    assert audio.content == WAV
    assert audio.headers["content-type"] == "audio/wav"
    for response in (image, audio):
        assert response.headers["cache-control"] == CACHE_CONTROL
        assert response.headers["x-content-type-options"] == "nosniff"
    assert [m["kind"] for m in detail["trajectory"]["multimodal"]] == ["image", "audio"]


async def test_a_run_s_episode_reads_the_run_s_media_folder(
    make_settings, open_api, tmp_path, monkeypatch
):
    # A relative run_dir is relative to the API process's working directory.
    monkeypatch.chdir(tmp_path)
    settings = make_settings(media_dir=str(tmp_path / "elsewhere"))
    seed(
        settings.db_url,
        tmp_path / "runs" / "r1" / "media",
        episode_id="step3/t0/1",
        run_id="r/1",
        run_dir="runs/r1",
    )
    async with open_api(settings) as api:
        image = await api.get("/v1/episodes/step3%2Ft0%2F1/media/0")
        audio = await api.get("/v1/episodes/step3/t0/1/media/1")
    assert image.status_code == 200, image.text
    assert image.content == PNG
    assert audio.content == WAV
    assert not (tmp_path / "elsewhere").exists()


async def test_unknown_formats_are_sent_as_octet_stream(make_settings, open_api, tmp_path):
    settings = make_settings(media_dir=str(tmp_path / "media"))
    blob = b"<html><script>alert(1)</script></html>"
    seed(settings.db_url, tmp_path / "media", items=((blob, "image"),))
    async with open_api(settings) as api:
        response = await api.get("/v1/episodes/ep/media/0")
    assert response.status_code == 200
    assert response.content == blob
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.headers["x-content-type-options"] == "nosniff"


async def test_what_cannot_be_served_is_a_problem(make_settings, open_api, problem, tmp_path):
    settings = make_settings(media_dir=str(tmp_path / "media"))
    media = seed(settings.db_url, tmp_path / "media")
    store = Store(settings.db_url)
    store.create_episode({"id": "t1"}, agent="calc", episode_id="queued")
    store.close()
    # A run whose configuration has no run_dir.
    seed(settings.db_url, tmp_path / "unused", episode_id="in-bare", run_id="bare")
    async with open_api(settings) as api:
        unknown = problem(await api.get("/v1/episodes/nope/media/0"), 404)
        queued = problem(await api.get("/v1/episodes/queued/media/0"), 404)
        past = problem(await api.get("/v1/episodes/ep/media/2"), 404)
        negative = problem(await api.get("/v1/episodes/ep/media/-1"), 422)
        not_a_number = problem(await api.get("/v1/episodes/ep/media/first"), 422)
        no_run_dir = problem(await api.get("/v1/episodes/in-bare/media/0"), 404)

        MediaStore(tmp_path / "media").path(media[1]).unlink()
        missing = problem(await api.get("/v1/episodes/ep/media/1"), 404)

        MediaStore(tmp_path / "media").path(media[0]).write_bytes(PNG[:-1] + b"\x00")
        corrupt = problem(await api.get("/v1/episodes/ep/media/0"), 500)
    assert unknown["type"] == "urn:omniloop:problem:not-found"
    assert queued["type"] == "urn:omniloop:problem:no-trajectory"
    assert "queued" in queued["detail"]
    assert past["type"] == "urn:omniloop:problem:media-not-found"
    assert "has 2 media items" in past["detail"]
    assert negative["errors"][0]["field"] == "index"
    assert not_a_number["errors"][0]["field"] == "index"
    assert no_run_dir["type"] == "urn:omniloop:problem:media-missing"
    assert "run 'bare' has no run_dir" in no_run_dir["detail"]
    assert missing["type"] == "urn:omniloop:problem:media-missing"
    assert str(tmp_path / "media") in missing["detail"]
    assert missing["media_dir"] == str(tmp_path / "media")
    assert corrupt["type"] == "urn:omniloop:problem:media-corrupt"
    assert "is corrupt" in corrupt["detail"]
    assert str(tmp_path / "media") in corrupt["detail"]


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
async def test_media_need_the_token_where_every_v1_read_does(
    make_settings, open_api, problem, tmp_path, host
):
    settings = make_settings(host=host, api_token=TOKEN, media_dir=str(tmp_path / "media"))
    seed(settings.db_url, tmp_path / "media")
    app = create_app(settings, extra_routes=omniloop.web.routes())
    async with open_api(settings, app) as api:
        bare = await api.get("/v1/episodes/ep/media/0")
        wrong = await api.get(
            "/v1/episodes/ep/media/0", headers={"Authorization": "Bearer not-it-0123456789abc"}
        )
        right = await api.get(
            "/v1/episodes/ep/media/0", headers={"Authorization": f"Bearer {TOKEN}"}
        )
    assert right.status_code == 200
    assert right.content == PNG
    if host == "127.0.0.1":
        assert bare.status_code == 200
        assert bare.content == PNG
    else:
        assert problem(bare, 401)["type"] == "urn:omniloop:problem:unauthorized"
        assert PNG not in bare.content
        problem(wrong, 401)


async def test_the_openapi_document_describes_the_media_route(make_settings, open_api):
    async with open_api(make_settings()) as api:
        doc = (await api.get("/openapi.json")).json()
    operation = doc["paths"]["/v1/episodes/{episode_id}/media/{index}"]["get"]
    assert operation["summary"] == "Get a media item of an episode"
    ok = operation["responses"]["200"]
    assert {"image/png", "audio/wav", "video/mp4", "application/octet-stream"} <= set(ok["content"])
    assert ok["content"]["image/png"]["schema"] == {"type": "string", "format": "binary"}
    assert {"Cache-Control", "X-Content-Type-Options"} <= set(ok["headers"])
    assert {"404", "422", "500", "default"} <= set(operation["responses"])
    index = next(p for p in operation["parameters"] if p["name"] == "index")
    assert index["schema"]["minimum"] == 0


def test_submitted_prompts_carry_media_inline_only() -> None:
    """A media part of a submitted prompt is a `data:` URI under its kind's key: a server path,
    a URL or a source under another kind's key is a validation error (a path would read the
    server's files)."""
    from pydantic import ValidationError

    from omniloop.platform.api.schemas import TaskIn

    def task(*parts: dict[str, str]) -> dict[str, object]:
        return {"prompt": [{"role": "user", "content": [{"type": "text", "text": "?"}, *parts]}]}

    accepted = TaskIn.model_validate(task({"type": "image", "image": "data:image/png;base64,AA=="}))
    assert accepted.model_dump(mode="json")["prompt"][0]["content"][1] == {
        "type": "image",
        "image": "data:image/png;base64,AA==",
    }
    for part in (
        {"type": "image", "image": "/etc/passwd"},
        {"type": "audio", "audio": "https://example.com/a.wav"},
        {"type": "video", "image": "data:,AA=="},
        {"type": "pdf", "pdf": "data:,AA=="},
    ):
        with pytest.raises(ValidationError):
            TaskIn.model_validate(task(part))
