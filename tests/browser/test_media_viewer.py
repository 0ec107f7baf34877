"""The trajectory viewer shows an episode's media inline, where their placeholder tokens are:
an image of the prompt in the Prompt block, an audio clip a tool returned in the turn whose
observation holds it, each one element instead of its placeholder spans, fetched from
`GET /v1/episodes/{id}/media/{index}` (with the token, where the server needs it) and shown
from a blob: URL that is revoked when the page is left."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Page, expect

from omniloop.inference.models import load_tokenizer
from omniloop.modalities import MediaPlacement, MediaStore, synth
from omniloop.trajectory import (
    ToolCallRecord,
    Trajectory,
    TrajectoryBuilder,
    TrajectoryMeta,
    TurnRecord,
)

RUN_ID = "media-run"
EPISODE_ID = "mm/0"
PNG = synth.solid_png(64, 48)
WAV = synth.tone_wav(0.5)
# tiny-omni's placeholder and marker ids (the server's `tiny` tokenizer decodes them to "";
# the viewer places media by offset, not by token text).
IMAGE, AUDIO = 49152, 49153
VISION_BOS, VISION_EOS, AUDIO_BOS, AUDIO_EOS = 49155, 49156, 49157, 49158
IMAGE_TOKENS, AUDIO_TOKENS = 16, 12
BLOB_URL = re.compile(r"^blob:http://127\.0\.0\.1:\d+/[0-9a-f-]{36}$")
"""A blob: URL of the page's origin (the media are never loaded from the API's URL)."""
CALL = '<tool_call>{"name": "listen", "arguments": {}}</tool_call><|im_end|>'


def _trajectory(media_dir: Path) -> Trajectory:
    """Two turns: an image in the prompt, an audio clip in the first turn's tool result."""
    tokenizer = load_tokenizer("tiny")

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    store = MediaStore(media_dir)
    image, audio = store.put(PNG, "image"), store.put(WAV, "audio")
    head = encode("<|im_start|>user\n")
    prompt = [
        *head,
        VISION_BOS,
        *[IMAGE] * IMAGE_TOKENS,
        VISION_EOS,
        *encode("What does the clip say about this picture?<|im_end|>\n<|im_start|>assistant\n"),
    ]
    placed = [MediaPlacement(**image.model_dump(), offset=len(head) + 1, tokens=IMAGE_TOKENS)]
    builder = TrajectoryBuilder(prompt)

    # Turn 1 calls the tool; its result (the observation) holds the clip.
    call = encode(CALL)
    builder.add_sampled(call, [-0.3] * len(call), version=0)
    builder.add_observation(encode("\n<|im_start|>user\n<tool_response>\nthe clip:\n"))
    placed.append(
        MediaPlacement(**audio.model_dump(), offset=len(builder) + 1, tokens=AUDIO_TOKENS)
    )
    builder.add_observation([AUDIO_BOS, *[AUDIO] * AUDIO_TOKENS, AUDIO_EOS])
    builder.add_observation(encode("\n</tool_response><|im_end|>\n<|im_start|>assistant\n"))
    first = TurnRecord(
        start=len(prompt),
        num_sampled=len(call),
        num_observation=len(builder) - len(prompt) - len(call),
        finish_reason="stop",
        weight_version=0,
    )
    # Turn 2 answers.
    answer = encode("It is a tone.<|im_end|>")
    second = TurnRecord(
        start=len(builder), num_sampled=len(answer), finish_reason="stop", weight_version=0
    )
    builder.add_sampled(answer, [-0.3] * len(answer), version=0)
    meta = TrajectoryMeta(
        run_id=RUN_ID,
        episode_id=EPISODE_ID,
        task={"prompt": "What does the clip say about this picture?"},
        turns=[first, second],
        tool_calls=[
            ToolCallRecord(turn=0, name="listen", arguments={}, raw=CALL, output="the clip:")
        ],
        stop_reason="stop",
        timings={"total": 0.5},
    )
    multimodal = [p.model_dump(mode="json") for p in placed]
    return builder.build(meta, multimodal).model_copy(update={"reward": 1.0})


def _seed(dashboard: Any, run_dir: Path) -> Trajectory:
    trajectory = _trajectory(run_dir / "media")
    store = dashboard.store()
    try:
        store.create_run("media run", {"run_dir": str(run_dir)}, run_id=RUN_ID, status="running")
        store.create_episode(
            trajectory.meta.task, run_id=RUN_ID, agent="calc", episode_id=EPISODE_ID,
            status="running",
        )  # fmt: skip
        store.finish_episode(EPISODE_ID, trajectory)
    finally:
        store.close()
    return trajectory


def test_media_show_inline_where_their_placeholders_are(
    page: Page, dashboard: Any, screenshot: Any, tmp_path: Path
) -> None:
    trajectory = _seed(dashboard, tmp_path / "run")
    image, audio = trajectory.multimodal
    ids = trajectory.input_ids
    assert ids[image["offset"] - 1] == VISION_BOS
    assert ids[audio["offset"] + AUDIO_TOKENS] == AUDIO_EOS
    assert trajectory.prompt_length < audio["offset"] < trajectory.meta.turns[1].start
    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url) if "/media/" in r.url else None)

    page.goto(f"{dashboard.url}/#/episodes/{EPISODE_ID}")
    expect(page.locator("#app")).to_have_attribute("data-status", "completed")
    prompt = page.locator(".token-view .turn").filter(has=page.locator("h3", has_text="Prompt"))
    turn1 = page.locator(".token-view .turn").filter(has=page.locator("h3", has_text="Turn 1"))
    turn2 = page.locator(".token-view .turn").filter(has=page.locator("h3", has_text="Turn 2"))

    # The image: one <img> in the Prompt block, loaded from a blob: URL, with its caption.
    figure = prompt.locator(f'figure.media[data-media="image"][data-offset="{image["offset"]}"]')
    expect(figure).to_have_attribute("data-state", "loaded")
    expect(figure.locator("figcaption")).to_have_text(f"image · {IMAGE_TOKENS} tokens")
    img = figure.locator("img")
    expect(img).to_have_attribute("src", BLOB_URL)
    assert img.evaluate("el => [el.naturalWidth, el.naturalHeight]") == [64, 48]

    # The clip: one <audio controls> in Turn 1's block, none elsewhere.
    clip = turn1.locator(f'figure.media[data-media="audio"][data-offset="{audio["offset"]}"]')
    expect(clip).to_have_attribute("data-state", "loaded")
    expect(clip.locator("figcaption")).to_have_text(f"audio · {AUDIO_TOKENS} tokens")
    player = clip.locator("audio")
    expect(player).to_have_attribute("controls", "")
    expect(player).to_have_attribute("src", BLOB_URL)
    assert player.evaluate("el => el.duration") == 0.5
    expect(page.locator("figure.media")).to_have_count(2)
    expect(prompt.locator("figure.media")).to_have_count(1)
    expect(turn2.locator("figure.media")).to_have_count(0)

    # The placeholder runs are not token spans; the markers around them are.
    tokens = page.locator(".token-view .tokens .tok")
    expect(tokens).to_have_count(len(ids) - IMAGE_TOKENS - AUDIO_TOKENS)
    for item in (image, audio):
        for i in (item["offset"], item["offset"] + item["tokens"] - 1):
            expect(page.locator(f'.tok[data-i="{i}"]')).to_have_count(0)
        expect(page.locator(f'.tok[data-i="{item["offset"] - 1}"]')).to_have_count(1)
        expect(page.locator(f'.tok[data-i="{item["offset"] + item["tokens"]}"]')).to_have_count(1)
    # The count stays that of the whole sequence, and says how much of it is media.
    expect(page.locator(".token-view > .page-head")).to_contain_text(
        f"{len(ids)} tokens · {sum(trajectory.loss_mask)} sampled · 2 turns · 1 tool calls · "
        f"2 media ({IMAGE_TOKENS + AUDIO_TOKENS} placeholder tokens)"
    )
    expect(turn1.locator('.tool-call[data-tool="listen"]')).to_be_visible()
    # Each item was fetched once, from the media route.
    enc = EPISODE_ID.replace("/", "%2F")
    assert sorted(fetched) == [
        f"{dashboard.url}/v1/episodes/{enc}/media/0",
        f"{dashboard.url}/v1/episodes/{enc}/media/1",
    ]
    screenshot(page, "media")

    # What the page shows is what the route serves.
    served = httpx.get(f"{dashboard.url}/v1/episodes/{enc}/media/0", timeout=30)
    assert served.content == PNG
    assert served.headers["content-type"] == "image/png"

    # Leaving the page revokes the blob: URLs.
    src = img.get_attribute("src")
    page.goto(f"{dashboard.url}/#/episodes")
    expect(page.locator(".token-view")).to_have_count(0)
    revoked = page.evaluate(
        "async (url) => { try { await fetch(url); return false; } catch { return true; } }", src
    )
    assert revoked


def test_media_are_fetched_with_the_token_beyond_loopback(
    page: Page, guarded_dashboard: Any, tmp_path: Path
) -> None:
    dashboard = guarded_dashboard
    _seed(dashboard, tmp_path / "run")
    enc = EPISODE_ID.replace("/", "%2F")
    media_url = f"{dashboard.url}/v1/episodes/{enc}/media/0"
    assert httpx.get(media_url, timeout=30).status_code == 401
    sent: list[dict[str, str]] = []
    page.on("request", lambda r: sent.append(r.headers) if r.url == media_url else None)

    page.goto(f"{dashboard.url}/#/episodes/{EPISODE_ID}")
    prompt = page.locator("[data-token-prompt]")
    expect(prompt).to_be_visible()
    prompt.locator("input[name=token]").fill(dashboard.token)
    prompt.get_by_role("button", name="Continue").click()
    figure = page.locator('figure.media[data-media="image"]')
    expect(figure).to_have_attribute("data-state", "loaded")
    assert figure.locator("img").evaluate("el => el.naturalWidth") == 64
    expect(page.locator('figure.media[data-media="audio"]')).to_have_attribute(
        "data-state", "loaded"
    )
    assert sent
    assert sent[-1]["authorization"] == f"Bearer {dashboard.token}"
