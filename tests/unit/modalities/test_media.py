"""Media references, the content-addressed store, sources, and decoding within bounds.

Every bad item named by the omni-modal issue (a truncated PNG, a zero-length WAV, an MP4 with
no frames, a 100-megapixel image, a 2-hour video) must be a `MediaError` that names the item,
never a crash and never an unbounded decode.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import av
import numpy as np
import pytest

from omniloop.errors import MediaError
from omniloop.modalities import MediaConfig, MediaKind, MediaStore, read_source, synth
from omniloop.modalities.decode import decode_audio, decode_image, decode_video, sample_count
from omniloop.modalities.media import sniff_format
from omniloop.modalities.qwen_omni import QwenOmniProcessor

CONFIG = MediaConfig()


def _png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims `width` x `height` (a decompression bomb's shape)."""
    data = bytearray(synth.solid_png(1, 1))
    # IHDR starts at byte 8: length (4), type (4), width (4), height (4), ...; CRC after 13.
    data[16:24] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF
    data[29:33] = struct.pack(">I", crc)
    return bytes(data)


def _long_mp4(seconds: int) -> bytes:
    """Two tiny frames `seconds` apart: a video of that length, made in milliseconds."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=1)
        stream.width = stream.height = 16
        stream.pix_fmt = "yuv420p"
        for pts in (0, seconds):
            frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
            frame.pts = pts
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def _audio_only_mp4() -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        samples = np.zeros((1, 1024), dtype=np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


# -- store and sources -------------------------------------------------------------------------


def test_store_keeps_each_item_once_by_hash(tmp_path: Path) -> None:
    store = MediaStore(tmp_path)
    data = synth.solid_png(8, 8)
    first = store.put(data, "image")
    second = store.put(data, MediaKind.IMAGE)
    assert first == second
    assert first.format == "png"
    assert first.size == len(data)
    assert store.read(first) == data
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [first.sha256]
    other = store.put(synth.solid_png(8, 8, (0, 0, 255)), "image")
    assert other.sha256 != first.sha256
    assert first.label.startswith("image:")
    assert len(first.label) == len("image:") + 12


def test_store_refuses_empty_and_oversized_items(tmp_path: Path) -> None:
    store = MediaStore(tmp_path, max_bytes=100)
    with pytest.raises(MediaError, match="empty"):
        store.put(b"", "audio")
    with pytest.raises(MediaError, match=r"media.max_bytes=100"):
        store.put(b"x" * 101, "video")
    missing = MediaStore(tmp_path / "elsewhere")
    with pytest.raises(MediaError, match="not in the media store"):
        missing.read(MediaStore(tmp_path).put(b"abc", "image"))


def test_sources_bytes_data_uris_and_paths(tmp_path: Path) -> None:
    data = synth.solid_png(4, 4)
    encoded = base64.b64encode(data).decode()
    assert read_source(data) == data
    assert read_source(f"data:image/png;base64,{encoded}") == data
    assert read_source(f"data:,{encoded}") == data  # SGLang's form for audio
    assert read_source("data:text/plain,a%20b") == b"a b"
    (tmp_path / "x.png").write_bytes(data)
    assert read_source("x.png", base_dir=tmp_path) == data
    assert read_source(f"file://{tmp_path / 'x.png'}") == data
    with pytest.raises(MediaError, match="URL"):
        read_source("https://example.com/cat.png")
    with pytest.raises(MediaError, match="cannot read media file"):
        read_source("missing.png", base_dir=tmp_path)
    with pytest.raises(MediaError, match="max_bytes"):
        read_source(tmp_path / "x.png", max_bytes=10)
    with pytest.raises(MediaError, match="not"):
        read_source("data:image/png;base64,@@@")


def test_sniffed_formats() -> None:
    assert sniff_format(synth.solid_png(2, 2)) == "png"
    assert sniff_format(synth.tone_wav(0.1)) == "wav"
    assert sniff_format(synth.moving_square_mp4(frames=2)) == "mp4"
    assert sniff_format(b"hello") == "unknown"


def test_config_refuses_crossed_bounds() -> None:
    with pytest.raises(ValueError, match="image_min_pixels"):
        MediaConfig(image_min_pixels=10_000, image_max_pixels=100)
    with pytest.raises(ValueError, match="video_fps"):
        MediaConfig(video_fps=0)


# -- decoding ----------------------------------------------------------------------------------


def test_image_transparency_goes_over_white() -> None:
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)  # fully transparent black
    image = decode_image(synth.png(rgba), CONFIG)
    assert image.mode == "RGB"
    assert np.asarray(image).min() == 255


def test_audio_is_mono_at_the_configured_rate() -> None:
    stereo = np.stack([np.zeros(22050), np.full(22050, 0.5)], axis=1).astype(np.float32)
    samples = decode_audio(synth.wav(stereo, 22050), CONFIG)
    assert samples.dtype == np.float32
    assert samples.ndim == 1
    assert abs(len(samples) - 16000) <= 1
    assert abs(float(np.median(samples)) - 0.25) < 1e-3


def test_video_frames_sampled_at_the_configured_rate() -> None:
    video = decode_video(synth.moving_square_mp4(frames=8, fps=4), CONFIG)  # 2 s
    assert video.frames.shape == (4, 48, 64, 3)
    assert video.frames.dtype == np.uint8
    assert video.seconds == pytest.approx(2.0)
    assert video.sample_fps == pytest.approx(2.0)
    # The square moves right: its mean column grows frame by frame.
    columns = [np.nonzero(f[:, :, 0].max(axis=0) > 128)[0].mean() for f in video.frames]
    assert columns == sorted(columns)
    assert columns[0] < columns[-1]


@pytest.mark.parametrize(
    ("total", "seconds", "expected"),
    [(8, 2.0, 4), (1, 0.25, 2), (600, 300.0, 64), (10, 2.5, 6), (3, 1.5, 4)],
)
def test_sample_count_even_and_bounded(total: int, seconds: float, expected: int) -> None:
    assert sample_count(total, seconds, CONFIG) == expected


def test_single_frame_video_repeats_to_a_temporal_patch() -> None:
    video = decode_video(synth.moving_square_mp4(frames=1), CONFIG)
    assert len(video.frames) == 2
    assert np.array_equal(video.frames[0], video.frames[1])


BAD_MEDIA = [
    pytest.param(MediaKind.IMAGE, synth.solid_png(32, 32)[:60], "truncated", id="truncated-png"),
    pytest.param(MediaKind.IMAGE, b"not an image at all", "not an image", id="garbage-image"),
    pytest.param(MediaKind.IMAGE, _png_claiming(10_000, 10_000), "100.0 megapixels", id="100mp"),
    pytest.param(MediaKind.IMAGE, synth.solid_png(1, 300), "aspect ratio", id="thin-image"),
    pytest.param(
        MediaKind.AUDIO,
        synth.wav(np.zeros(0, np.float32), 16000),
        "no samples",
        id="zero-length-wav",
    ),
    pytest.param(
        MediaKind.AUDIO, synth.tone_wav(31.0, rate=8000), "audio_max_seconds", id="long-audio"
    ),
    pytest.param(MediaKind.AUDIO, b"RIFF\x00\x00\x00\x00WAVEjunk", "not audio", id="bad-wav"),
    pytest.param(MediaKind.VIDEO, _audio_only_mp4(), "no video stream", id="mp4-no-frames"),
    pytest.param(
        MediaKind.VIDEO, synth.moving_square_mp4(frames=8)[:200], "video", id="truncated-mp4"
    ),
    pytest.param(MediaKind.VIDEO, _long_mp4(7200), "video_max_seconds", id="two-hour-video"),
]


@pytest.mark.parametrize(("kind", "data", "match"), BAD_MEDIA)
def test_bad_media_is_a_clear_error(kind: MediaKind, data: bytes, match: str) -> None:
    processor = QwenOmniProcessor(CONFIG)
    with pytest.raises(MediaError, match=match) as caught:
        processor.process(kind, data, label=f"{kind}:abc123")
    assert f"{kind}:abc123" in str(caught.value)


def test_large_image_is_downscaled_within_the_bound() -> None:
    processor = QwenOmniProcessor(CONFIG)
    out = processor.process(MediaKind.IMAGE, synth.solid_png(3000, 2000), label="image:big")
    assert out.tokens <= CONFIG.image_max_pixels // (28 * 28)
    assert out.tokens >= 1
    assert out.seconds > 0
