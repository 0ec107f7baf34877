"""Episodes with media: prompts and tool results carry images, audio and video; every turn
sends the engine every item so far, placed exactly where its block sits in the token stream.
(A scripted engine and an in-memory sandbox: fakes inside a unit test of the episode module;
the engine side is tested against the real engine in tests/integration/engine.)"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from omniloop import Task, ToolAgent, reward
from omniloop.agents.chat import ChatFormat
from omniloop.agents.media import media_resolver
from omniloop.inference.base import GenerateOutput, SamplingParams
from omniloop.inference.models import load_tokenizer, resolve_model
from omniloop.modalities import MediaConfig, MediaData, MediaKind, MediaStore, synth
from omniloop.modalities.processing import MediaTokens
from omniloop.platform.control.components import load_tasks
from omniloop.platform.control.episode import EpisodeSettings, run_episode
from omniloop.tools import ToolResult, tool

PNG = synth.solid_png(64, 48, (220, 20, 20))
CALL = '<tool_call>{"name": "zoom", "arguments": {}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("tiny-omni")


class ScriptedEngine:
    """Replies with scripted texts; records each prompt and the media sent with it."""

    def __init__(self, tokenizer: Any, texts: list[str], raw: list[list[int]] | None = None):
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.replies = raw or [[*tokenizer.encode(t, add_special_tokens=False), end] for t in texts]
        self.prompts: list[list[int]] = []
        self.media: list[list[MediaData]] = []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, media: Sequence[MediaData] = ()
    ) -> GenerateOutput:
        self.prompts.append(list(input_ids))
        self.media.append(list(media))
        ids = self.replies[min(len(self.prompts) - 1, len(self.replies) - 1)]
        return GenerateOutput(
            output_ids=ids, output_logprobs=[-0.5] * len(ids), finish_reason="stop",
            weight_version=0,
        )  # fmt: skip


class NoSandbox:
    async def acquire(self) -> Any:
        raise AssertionError("no tool here needs a sandbox")

    async def release(self, sandbox: Any) -> None: ...


@tool
def zoom() -> ToolResult:
    """Zoom into the picture."""
    return ToolResult(
        text="zoomed:",
        media=[MediaData(kind=MediaKind.IMAGE, data=synth.solid_png(28, 28, (0, 0, 250)))],
    )


@tool
def broken_zoom() -> ToolResult:
    """Zoom, badly."""
    return ToolResult(text="zoomed:", media=[MediaData(kind="image", data=PNG[:50])])


@reward
def one(task: dict, response: str) -> float:
    return 1.0


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def episode(
    tokenizer: Any,
    engine: ScriptedEngine,
    task: Task,
    store_dir: Path,
    tools: list[Any] | None = None,
    model: str = "tiny-omni",
) -> Any:
    agent = ToolAgent(tools or [zoom])
    resolver = media_resolver(resolve_model(model), tokenizer, MediaConfig(), store_dir)
    return await run_episode(
        agent,
        task,
        engine=engine,
        chat=ChatFormat(tokenizer, agent.tool_schemas),
        sandbox_provider=NoSandbox(),
        rewards=[one],
        settings=EpisodeSettings(run_id="r", episode_id="e/0", group_id="e", max_turns=4),
        media=resolver,
    )


def blocks(ids: list[int], tokens: MediaTokens) -> list[tuple[int, int, int]]:
    """(offset, length, pad id) of every run of placeholder pads in `ids`."""
    pads = {tokens.image, tokens.audio, tokens.video}
    out, i = [], 0
    while i < len(ids):
        if ids[i] in pads:
            j = i
            while j < len(ids) and ids[j] == ids[i]:
                j += 1
            out.append((i, j - i, ids[i]))
            i = j
        else:
            i += 1
    return out


def media_prompt(*parts: dict[str, Any]) -> Task:
    content = [{"type": "text", "text": "How many red shapes?"}, *parts]
    return Task(id="t", prompt=[{"role": "user", "content": content}], answer="1")


async def test_prompt_and_tool_media_reach_the_engine_every_turn(tokenizer, tmp_path) -> None:
    engine = ScriptedEngine(tokenizer, [CALL, "One."])
    task = media_prompt(
        {"type": "image", "image": data_uri(PNG)},
        {"type": "audio", "audio": synth.tone_wav(0.5)},
    )
    traj = await episode(tokenizer, engine, task, tmp_path)
    tokens = MediaTokens.from_tokenizer(tokenizer)

    assert traj.meta.stop_reason == "stop"
    assert traj.reward == 1.0
    assert [m.kind for m in engine.media[0]] == ["image", "audio"]
    # The tool's image is still in the model's input on the next turn, after the first two.
    assert [m.kind for m in engine.media[1]] == ["image", "audio", "image"]
    assert engine.media[1][:2] == engine.media[0]
    found = blocks(traj.input_ids, tokens)
    assert [(e["offset"], e["tokens"]) for e in traj.multimodal] == [(o, n) for o, n, _ in found]
    assert [e["kind"] for e in traj.multimodal] == ["image", "audio", "image"]
    assert [pad for _, _, pad in found] == [tokens.image, tokens.audio, tokens.image]
    # Each turn's prompt is the trajectory so far: the blocks are where the engine saw them.
    assert engine.prompts[1] == traj.input_ids[: len(engine.prompts[1])]
    for entry in traj.multimodal:
        assert traj.input_ids[entry["offset"] - 1] in (tokens.vision_bos, tokens.audio_bos)
        assert not any(traj.loss_mask[entry["offset"] : entry["offset"] + entry["tokens"]])
    # Stored once by hash, read back byte for byte.
    store = MediaStore(tmp_path)
    first = traj.multimodal[0]
    assert (tmp_path / first["sha256"][:2] / first["sha256"]).read_bytes() == PNG
    assert store.read(engine_media_ref(traj, 2)) == engine.media[1][2].data
    assert traj.meta.metrics["media/image"] == 2.0
    assert traj.meta.metrics["media/audio"] == 1.0
    assert traj.meta.metrics["media/image_tokens"] == sum(
        e["tokens"] for e in traj.multimodal if e["kind"] == "image"
    )
    assert json.loads(traj.model_dump_json())["multimodal"] == traj.multimodal
    # Media bytes never reach the persisted tool-call record.
    assert "media" not in traj.meta.tool_calls[0].model_dump()


def engine_media_ref(traj: Any, index: int) -> Any:
    from omniloop.modalities import MediaPlacement

    return MediaPlacement.model_validate(traj.multimodal[index]).media


async def test_a_tool_returning_unusable_media_shows_the_model_why(tokenizer, tmp_path) -> None:
    engine = ScriptedEngine(tokenizer, [CALL.replace("zoom", "broken_zoom"), "Done."])
    traj = await episode(tokenizer, engine, media_prompt(), tmp_path, tools=[broken_zoom])
    assert traj.meta.stop_reason == "stop"
    assert traj.meta.metrics["media/errors"] == 1.0
    assert traj.multimodal == []
    assert engine.media[1] == []
    shown = tokenizer.decode(engine.prompts[1])
    assert "[image not shown:" in shown
    assert "truncated or corrupt" in shown


@pytest.mark.parametrize(
    ("part", "match"),
    [
        ({"type": "image", "image": data_uri(PNG[:60])}, "truncated or corrupt"),
        ({"type": "video", "video": data_uri(b"not a video")}, "not a video"),
        ({"type": "image", "image": "https://example.com/x.png"}, "URL"),
        ({"type": "image"}, "needs its source"),
    ],
)
async def test_a_prompt_with_unusable_media_is_a_media_error(tokenizer, tmp_path, part, match):
    engine = ScriptedEngine(tokenizer, ["One."])
    traj = await episode(tokenizer, engine, media_prompt(part), tmp_path)
    assert traj.meta.stop_reason == "media_error"
    assert traj.is_infra_failure
    assert traj.reward is None
    assert traj.meta.error is not None
    assert match in traj.meta.error.message
    assert engine.prompts == []  # nothing was sampled
    assert "not used:" in tokenizer.decode(traj.input_ids)


async def test_a_text_model_refuses_media_by_name(tmp_path) -> None:
    tokenizer = load_tokenizer("tiny")
    engine = ScriptedEngine(tokenizer, ["One."])
    task = media_prompt({"type": "image", "image": data_uri(PNG)})
    traj = await episode(tokenizer, engine, task, tmp_path, model="tiny")
    assert traj.meta.stop_reason == "media_error"
    assert traj.meta.error is not None
    assert "takes no image input" in traj.meta.error.message


async def test_sampled_placeholders_are_neutralised_out_of_the_loss(tokenizer, tmp_path) -> None:
    tokens = MediaTokens.from_tokenizer(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    said = tokenizer.encode("A", add_special_tokens=False)
    engine = ScriptedEngine(tokenizer, [], raw=[[*said, tokens.image, tokens.audio_bos, end]])
    task = media_prompt({"type": "image", "image": data_uri(PNG)})
    traj = await episode(tokenizer, engine, task, tmp_path)
    start = traj.meta.turns[0].start
    sampled = traj.input_ids[start:]
    assert tokens.image not in sampled
    assert tokens.audio_bos not in sampled
    assert sampled[len(said) : len(said) + 2] == [tokenizer.unk_token_id] * 2
    assert traj.loss_mask[start:] == [1] * len(said) + [0, 0, 1]
    assert traj.meta.metrics["media/neutralised_placeholders"] == 2.0
    assert len(traj.multimodal) == 1  # only the prompt's image is media


def test_task_files_name_media_relative_to_themselves(tmp_path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(PNG)
    line = {
        "id": "a",
        "prompt": [{"role": "user", "content": [{"type": "image", "image": "img/a.png"}]}],
    }
    (tmp_path / "tasks.jsonl").write_text(json.dumps(line) + "\n")
    (task,) = load_tasks(str(tmp_path / "tasks.jsonl"))
    assert isinstance(task.prompt, list)
    assert task.prompt[0]["content"][0]["image"] == str(tmp_path / "img" / "a.png")


async def test_files_are_refused_where_paths_are_not_allowed(tokenizer, tmp_path) -> None:
    from omniloop.agents.media import EpisodeMedia
    from omniloop.errors import MediaError

    (tmp_path / "secret.png").write_bytes(PNG)
    resolver = media_resolver(
        resolve_model("tiny-omni"), tokenizer, MediaConfig(), tmp_path / "store", allow_files=False
    )
    part = {"type": "image", "image": str(tmp_path / "secret.png")}
    message = {"role": "user", "content": [part]}
    with pytest.raises(MediaError, match="file paths are not accepted"):
        EpisodeMedia(resolver).prepare([message], strict=True)
