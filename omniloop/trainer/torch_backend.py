"""`TorchTrainerBackend`: a policy trained with plain PyTorch (CPU or one GPU), the policy being
a `PolicyModel`: a Hugging Face causal LM or multimodal conditional-generation model (e.g. the
Qwen2.5-Omni thinker; `HFPolicy`, `trainer.backend=torch`) or megatron-core's `GPTModel` built
from a Hugging Face Llama / Qwen2 folder (`MegatronPolicy`, `trainer.backend=megatron`). The
loop, losses, optimizer and checkpoints are the same for both.

Logprob alignment — where loss-mask bugs live. A causal LM's logits at position `j` are the
distribution of token `j + 1`. The backend shifts them so that every per-token tensor is indexed
by the token it scores:

    logprobs[b, i] = log softmax(logits[b, i - 1])[input_ids[b, i]]    for 1 <= i < length_b
    logprobs[b, 0] = 0                   (nothing precedes the first token)
    logprobs[b, i] = 0                   for padding (i >= length_b)

which is the alignment of `Trajectory.rollout_logprobs` and of `TrainBatch.loss_mask`: a token
with `loss_mask[b, i] = 1` is trained through the logits at `i - 1`. Entropy follows the same
rule (`entropy[b, i]` is the entropy of the distribution that token `i` was drawn from).

Batches are right-padded. With causal attention, a real token never attends to a later padding
token, so a sequence's logprobs do not depend on what it is batched with (up to kernel
rounding); position ids start at 0 for every row. The forward runs the rows packed where it can
(`trainer.pack_sequences`, `Scorer.packing`): fewer rows with no padding, each opening that
rows share held once, each token at its own position and seeing only its own row's earlier
tokens (`trainer/packing.py`), so the logprobs are the padded rows' up to rounding.

Media (`TrainBatch.media_inputs`): a multimodal model gets the batch's media forward inputs
(`TrainBatch.media_kwargs`, each key concatenated over rows in row order) beside `input_ids` and
`attention_mask`, and computes its own positions from them (3-D mRoPE for Qwen-Omni: from the
real tokens of each row, found by `attention_mask`, and the grids of the row's items), so right
padding leaves a row's logprobs as they are when it is scored alone. Before a forward, each row's
placeholder tokens are counted against its media inputs (`check_media`): a mismatch is an error
naming the row, never a silent misplacement of features.

Precision: weights and AdamW state are fp32. `dtype=bf16` runs forward and backward under
`torch.autocast(bfloat16)` (CPU and CUDA); logprobs, entropy and the loss are always computed in
fp32 from the logits.

Checkpoint folder (`save` / `load`): `model.safetensors` (the policy, tied tensors once),
`optimizer.pt` (AdamW and learning-rate schedule state), `trainer_state.json` (weight version,
the caller's data position, the base model). The reference model is not saved: it is the base
model the backend is constructed from, so resume by constructing from the same base and
calling `load`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import safetensors.torch
import torch
from torch import Tensor, nn

from omniloop.errors import ConfigError
from omniloop.inference.models import resolve_model
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.data_parallel import Alone, RankGroup
from omniloop.trainer.host_memory import keep_freed_memory
from omniloop.trainer.losses import entropy_from_logits, rl_loss, token_logprobs
from omniloop.trainer.packing import Packing, pack_rows, token_order

FUSED_ADAMW_DEVICES = ("cpu", "cuda")
"""Devices torch's fused AdamW runs on."""

CHECKPOINT_FORMAT = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


def shifted_logprobs(
    logits: Tensor, input_ids: Tensor, attention_mask: Tensor, chunk_size: int | None = None
) -> Tensor:
    """Per-token logprobs `(B, T)` in fp32, aligned to the token they score (module docstring).

    `logits` `(B, T, V)` as the model returns them for `input_ids` `(B, T)`.
    """
    # Score every logits row against the *next* token instead of slicing logits[:, :-1]: the
    # slice would force a copy of the whole (B, T, V) tensor when rows are flattened.
    next_ids = torch.roll(input_ids, shifts=-1, dims=1)
    per_row = token_logprobs(logits, next_ids, chunk_size)  # [b, j] scores token j + 1
    aligned = torch.nn.functional.pad(per_row[:, :-1], (1, 0))
    return torch.where(attention_mask != 0, aligned, 0.0)


def trained_tokens(mask: Tensor) -> tuple[Tensor, Tensor]:
    """`(rows, positions)` of the tokens where `mask` `(B, T)` is nonzero (never position 0,
    which nothing predicts)."""
    rows, before = torch.nonzero(mask[:, 1:] != 0, as_tuple=True)
    return rows, before + 1


def at_tokens(values: Tensor, rows: Tensor, positions: Tensor, shape: torch.Size) -> Tensor:
    """`(B, T)` fp32 zeros holding `values` at `(rows, positions)` (differentiable)."""
    out = torch.zeros(shape, dtype=torch.float32, device=values.device)
    return out.index_put((rows, positions), values.float())


def load_hf_model(path: str | Path) -> nn.Module:
    """The fp32 Hugging Face model of a model folder (in eval mode, as `from_pretrained`
    leaves it).

    A causal LM loads with `AutoModelForCausalLM`; a model whose config is not a causal LM's
    (the Qwen2.5-Omni thinker, vision-language models) with the multimodal auto classes, which
    give its conditional-generation class: the one whose forward takes `pixel_values`,
    `input_features`, ... and returns logits. Raises ConfigError for any other model.
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForMultimodalLM,
    )

    config = AutoConfig.from_pretrained(path)
    for auto in (AutoModelForCausalLM, AutoModelForMultimodalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            model: nn.Module = auto.from_pretrained(path, dtype=torch.float32)
            return model
    raise ConfigError(
        f"model {str(path)!r} ({config.model_type!r}) is neither a causal LM nor a multimodal "
        "conditional-generation model; the trainer cannot train it"
    )


@dataclass(frozen=True)
class MediaLayout:
    """How a multimodal model marks media in its token stream: the placeholder id of each
    modality, and how many placeholders one row's media inputs stand for (Qwen-VL / Omni
    conventions: `grid_thw.prod() / merge²` per image or video, the audio tower's output length
    per clip)."""

    token_ids: dict[str, int]
    """Modality (`image`, `video`, `audio`) -> placeholder token id."""
    merge_size: int | None
    audio_lengths: Callable[[Tensor], Any] | None

    @classmethod
    def of(cls, model: nn.Module) -> MediaLayout | None:
        """The layout of `model`, or None for a model that takes no media."""
        config = getattr(model, "config", None)
        token_ids: dict[str, int] = {}
        for kind in ("image", "video", "audio"):
            value = getattr(config, f"{kind}_token_id", None)
            if value is None:
                value = getattr(config, f"{kind}_token_index", None)
            if isinstance(value, int):
                token_ids[kind] = value
        if not token_ids:
            return None
        merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
        tower = getattr(getattr(model, "base_model", None), "audio_tower", None)
        lengths = getattr(tower, "_get_feat_extract_output_lengths", None)
        return cls(token_ids, merge if isinstance(merge, int) else None, lengths)

    def expected(self, inputs: Mapping[str, Tensor]) -> dict[str, int | None]:
        """Placeholders per modality that one row's media inputs fill (None: not computable
        for this model, left to the model's own check)."""
        out: dict[str, int | None] = {}
        for kind, grid_key, values_key in (
            ("image", "image_grid_thw", "pixel_values"),
            ("video", "video_grid_thw", "pixel_values_videos"),
        ):
            if grid_key in inputs and self.merge_size:
                out[kind] = int(inputs[grid_key].prod(-1).sum()) // self.merge_size**2
            else:
                out[kind] = None if values_key in inputs else 0
        if "feature_attention_mask" in inputs and self.audio_lengths is not None:
            lengths = self.audio_lengths(inputs["feature_attention_mask"].sum(-1))
            # Qwen2.5-Omni returns (after the convolutions, after the pooling): the tokens are
            # the last.
            tokens = lengths[-1] if isinstance(lengths, tuple) else lengths
            out["audio"] = int(tokens.sum())
        else:
            out["audio"] = None if "input_features" in inputs else 0
        return out


def check_media(model: nn.Module, batch: TrainBatch) -> None:
    """Raise ValueError naming the row when a row's placeholder tokens do not match its media
    inputs (counted over its real tokens), or when rows carry media and `model` takes none.

    The model itself would fail deep inside its forward with a batch-level message, or, for
    audio features in excess, fill the placeholders silently with the wrong clips.
    """
    layout = MediaLayout.of(model)
    if layout is None:
        if batch.has_media:
            rows = [i for i, m in enumerate(batch.media_inputs) if m is not None]
            raise ValueError(
                f"{_rows_name(batch, rows)} carry media_inputs, but the model "
                f"({type(model).__name__}) takes no media"
            )
        return
    real = batch.attention_mask != 0
    counts = {
        kind: ((batch.input_ids == token) & real).sum(-1).tolist()
        for kind, token in layout.token_ids.items()
    }
    for row in range(len(batch)):
        inputs = batch.media_inputs[row] if batch.media_inputs else None
        expected = layout.expected(inputs or {})
        for kind, row_counts in counts.items():
            want = expected.get(kind)
            if want is not None and row_counts[row] != want:
                raise ValueError(
                    f"{_rows_name(batch, [row])}: {row_counts[row]} {kind} placeholder tokens "
                    f"in input_ids, but its media_inputs fill {want}"
                )


def _rows_name(batch: TrainBatch, rows: list[int]) -> str:
    """`row 3 (traj-id)` / `rows 0, 1 (a, b)` for error messages."""
    label = "row" if len(rows) == 1 else "rows"
    listed = ", ".join(str(r) for r in rows)
    if batch.ids:
        return f"{label} {listed} ({', '.join(batch.ids[r] for r in rows)})"
    return f"{label} {listed}"


def _decoder(model: nn.Module) -> nn.Module | None:
    """The module whose `last_hidden_state` the output layer projects to logits, taking the
    same inputs as `model`: its base model. For a causal LM that is `get_decoder()`; for a
    conditional-generation model `get_decoder()` is the text-only language model, while the base
    model (e.g. `Qwen2_5OmniThinkerModel`) is the one that consumes the media inputs and computes
    the 3-D positions."""
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        return base
    hf: Any = model
    decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else None
    return decoder if isinstance(decoder, nn.Module) else None


@runtime_checkable
class SelectiveHead(Protocol):
    """A model that runs its output layer on chosen positions only."""

    def logits_at(
        self, input_ids: Tensor, attention_mask: Tensor, rows: Tensor, positions: Tensor
    ) -> Tensor:
        """`(N, V)` logits at `(rows, positions)` of the batch `input_ids`."""
        ...


class Scorer:
    """Forward passes under a trainer config: autocast per `dtype`, logprobs scored in
    micro-batches (`micro_batches`; the policy's and the reference's alike)."""

    def __init__(self, config: TrainerConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """`batch` cut into consecutive micro-batches: of `micro_batch_tokens` tokens when set,
        else of `micro_batch_size` rows."""
        cfg = self.config
        if cfg.micro_batch_tokens is None:
            return batch.split(cfg.micro_batch_size)
        shared = cfg.shared_prefix_min_tokens if cfg.pack_sequences else 0
        return batch.split_tokens(cfg.micro_batch_tokens, shared)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.dtype == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def packing(self, model: nn.Module, batch: TrainBatch) -> Packing | None:
        """`batch`'s rows packed for a Hugging Face `model` (`trainer.pack_sequences`), or None
        where they run padded: packing off, rows with media (the model computes their positions
        itself), attention other than `sdpa` or `eager` (which take the packed rows' mask as
        given), a sliding window narrower than the packed rows (a given mask replaces the
        window's), or a model that packs its own rows (megatron's)."""
        config = getattr(model, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if not self.config.pack_sequences or batch.has_media or impl not in ("sdpa", "eager"):
            return None
        packing = pack_rows(
            batch.input_ids, batch.attention_mask, min_shared=self.config.shared_prefix_min_tokens
        )
        window = getattr(config, "sliding_window", None)
        if not isinstance(window, int) or not getattr(config, "use_sliding_window", True):
            return packing
        return packing if packing.input_ids.shape[1] <= window else None

    def _forward(self, module: nn.Module, batch: TrainBatch, packing: Packing | None = None) -> Any:
        """`module` run on `batch`'s ids, attention mask and media inputs (or on the rows of
        `packing`: their ids, positions and mask), under autocast. A ValueError of the model
        (e.g. features that do not fit the placeholders) is raised again naming the rows of
        `batch`."""
        try:
            with self._autocast():
                if packing is not None:
                    return module(
                        input_ids=packing.input_ids,
                        position_ids=packing.positions,
                        attention_mask=_attention_mask(module, packing),
                        use_cache=False,
                    )
                return module(
                    input_ids=batch.input_ids,
                    attention_mask=batch.attention_mask,
                    use_cache=False,
                    **batch.media_kwargs(),
                )
        except ValueError as exc:
            raise ValueError(
                f"{_rows_name(batch, list(range(len(batch))))}: the model refused the batch: {exc}"
            ) from exc

    def hidden_states(self, decoder: nn.Module, batch: TrainBatch) -> Tensor:
        """`(B, T, H)` last hidden states of a Hugging Face base model (`decoder`, no output
        layer) for `batch`, run packed where `packing` allows (zeros past each row's tokens)."""
        packing = self.packing(decoder, batch)
        hidden: Tensor = self._forward(decoder, batch, packing).last_hidden_state
        return hidden if packing is None else packing.unpack(hidden)

    def logits(self, model: nn.Module, batch: TrainBatch) -> Tensor:
        """`(B, T, V)` logits of `model` for `batch` (on the batch's device), media included."""
        packing = self.packing(model, batch)
        logits: Tensor = self._forward(model, batch, packing).logits
        return logits if packing is None else packing.unpack(logits)

    def token_logits(
        self, model: nn.Module, batch: TrainBatch, rows: Tensor, positions: Tensor
    ) -> Tensor:
        """`(N, V)` logits of the distributions that tokens `(rows, positions)` of `batch` were
        drawn from (the logits at `position - 1`).

        Only those rows go through the output layer. In RL most of a sequence (the prompt,
        tool output) is not trained, and over a large vocabulary the output layer and its fp32
        logits are most of a step's compute and memory: the toy task's steps allocated 2 GB of
        logits and their gradients, page-faulted in afresh every step. Models whose output is
        more than a projection of the decoder's last hidden state (logit soft-capping) run
        whole and are sliced. The decoder is the base model (`_decoder`), which takes the media
        inputs as the whole model does. A model that picks its own rows (`SelectiveHead`, e.g.
        megatron's) is asked for them.
        """
        if isinstance(model, SelectiveHead):
            with self._autocast():
                return model.logits_at(batch.input_ids, batch.attention_mask, rows, positions - 1)
        hf: Any = model
        decoder = _decoder(model)
        head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
        softcap = getattr(getattr(hf, "config", None), "final_logit_softcapping", None)
        if decoder is None or not isinstance(head, nn.Linear) or softcap:
            return self.logits(model, batch)[rows, positions - 1]
        packing = self.packing(model, batch)
        hidden: Tensor = self._forward(decoder, batch, packing).last_hidden_state
        at = (rows, positions - 1) if packing is None else packing.at(rows, positions - 1)
        with self._autocast():
            logits: Tensor = head(hidden[at])
        return logits

    @torch.no_grad()
    def score(self, model: nn.Module, batch: TrainBatch) -> Tensor:
        """Per-token logprobs of `batch` under `model`: `(B, T)` fp32 on the CPU, no gradient.

        Raises ValueError naming the row when a row's media inputs do not match its
        placeholder tokens (`check_media`).
        """
        check_media(model, batch)
        was_training = model.training
        model.eval()
        try:
            out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
            start = 0
            for mb in self.micro_batches(batch):
                mb = mb.to(self.device)
                logits = self.logits(model, mb)
                lp = shifted_logprobs(
                    logits, mb.input_ids, mb.attention_mask, self.config.logits_chunk_size
                )
                out[start : start + len(mb), : lp.shape[1]] = lp.cpu()
                start += len(mb)
            return out
        finally:
            model.train(was_training)


def _attention_mask(module: nn.Module, packing: Packing) -> Tensor:
    """The packed rows' mask `(P, 1, W, W)` as the module's attention takes a given one: `sdpa`
    a boolean (True: attend), `eager` an additive float."""
    visible = packing.visible[:, None]
    if getattr(getattr(module, "config", None), "_attn_implementation", None) == "sdpa":
        return visible
    blocked = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
    return blocked.masked_fill(~visible, torch.finfo(torch.float32).min)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class PolicyModel(Protocol):
    """The model a `TorchTrainerBackend` trains.

    `module` is called as a Hugging Face model is: `module(input_ids=, attention_mask=,
    use_cache=False, **media_inputs)` returning an object with `.logits` `(B, T, V)`.
    """

    @property
    def module(self) -> nn.Module:
        """The model trained (moved to the trainer's device by the backend)."""
        ...

    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The weights under the names an engine serving the Hugging Face model loads, detached,
        each tied tensor once."""
        ...

    def save_hf(self, folder: Path | None) -> None:
        """Write the weights and the model's config into `folder` (which exists). Every
        model-parallel rank calls it (the weights are gathered); None: write nothing."""
        ...

    def save_weights(self, file: Path | None) -> None:
        """Write every weight of `module`, whole, to the safetensors `file` (a checkpoint's),
        loadable at any model-parallel sizes. Every model-parallel rank calls it (the weights
        are gathered); None: write nothing."""
        ...

    def load_weights(self, file: Path, device: torch.device) -> None:
        """Restore `save_weights`' file (this rank's part of each weight); ValueError naming
        what does not fit."""
        ...

    def whole_names(self) -> list[str]:
        """The whole model's parameter names (as `module` names them with one rank), in that
        model's order; every rank calls this."""
        ...

    def whole_state(self, local: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per-parameter state (the optimizer's) keyed by this rank's parameter names, made the
        whole model's: keyed by `whole_names`, each tensor shaped like its parameter whole
        (gathered from every rank, which all call this)."""
        ...

    def local_state(
        self, whole: dict[str, dict[str, Any]], names: list[str]
    ) -> dict[str, dict[str, Any]]:
        """`whole_state` undone: the entries of this rank's parameters `names`, its parts."""
        ...

    def finish_gradients(self) -> None:
        """Complete the gradients of a backward before the optimizer step (the copies of one
        weight held by several ranks get their summed gradient)."""
        ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradients so that their global norm is at most `max_norm` (`inf`: leave
        them); returns the norm before (not finite when a gradient is not)."""
        ...


class HFPolicy:
    """A Hugging Face model as the policy (`load_hf_model`)."""

    def __init__(self, path: Path, *, gradient_checkpointing: bool = False) -> None:
        model: Any = load_hf_model(path)
        if gradient_checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        self.module: nn.Module = model

    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Parameters and persistent buffers under their in-memory names (`named_parameters()`:
        what an engine holding the same Hugging Face class loads by name, e.g. `model.visual.…`
        for the Omni thinker); tied tensors once."""
        persistent = set(self.module.state_dict().keys())
        for name, param in self.module.named_parameters():
            yield name, param.detach()
        for name, buf in self.module.named_buffers():
            if name in persistent:
                yield name, buf.detach()

    def save_hf(self, folder: Path | None) -> None:
        """`save_pretrained`: the checkpoint layout transformers writes (for the Omni thinker,
        `visual.…` rather than the in-memory `model.visual.…`), which `from_pretrained` maps
        back."""
        if folder is not None:
            self.module.save_pretrained(folder)  # type: ignore[operator]

    def save_weights(self, file: Path | None) -> None:
        if file is not None:
            safetensors.torch.save_model(self.module, str(file))

    def whole_names(self) -> list[str]:
        return [name for name, p in self.module.named_parameters() if p.requires_grad]

    def whole_state(self, local: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return local

    def local_state(
        self, whole: dict[str, dict[str, Any]], names: list[str]
    ) -> dict[str, dict[str, Any]]:
        return {name: whole[name] for name in names if name in whole}

    def finish_gradients(self) -> None:
        pass

    def load_weights(self, file: Path, device: torch.device) -> None:
        missing, unexpected = safetensors.torch.load_model(
            self.module, str(file), strict=True, device=str(device)
        )
        if missing or unexpected:
            raise ValueError(f"{file}: weights do not fit the model: {missing=} {unexpected=}")

    def clip_grad_norm(self, max_norm: float) -> float:
        params = [p for p in self.module.parameters() if p.requires_grad]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def load_policy(path: Path, config: TrainerConfig) -> PolicyModel:
    """The policy of `config.backend` for the model folder `path`."""
    if config.backend == "megatron":
        from omniloop.trainer.megatron.model import MegatronPolicy

        return MegatronPolicy.load(
            path,
            gradient_checkpointing=config.gradient_checkpointing,
            tensor_parallel=config.megatron.tensor_parallel,
            pipeline_parallel=config.megatron.pipeline_parallel,
            pack_sequences=config.pack_sequences,
            shared_prefix_min_tokens=config.shared_prefix_min_tokens,
        )
    return HFPolicy(path, gradient_checkpointing=config.gradient_checkpointing)


class TorchTrainerBackend:
    """A `TrainerBackend` over a `PolicyModel` (`load_policy`, by `config.backend`): AdamW, grad
    clipping, micro-batching. Rows may carry `media_inputs` for a multimodal Hugging Face model.

    `model` is anything `resolve_model` accepts (`tiny`, `tiny-omni`, `smollm2`, a HF folder).
    `ranks`: the data-parallel group this backend is one rank of (`data_parallel.py`); each rank
    calls `train_step` with its own rows of the step, in lock step with the others, and every
    rank's weights stay equal. Not thread-safe: one caller drives it.
    """

    def __init__(
        self,
        model: str | Path,
        config: TrainerConfig | None = None,
        ranks: RankGroup | None = None,
    ) -> None:
        self.config = config or TrainerConfig()
        self.ranks: RankGroup = ranks or Alone()
        self.model_path = resolve_model(str(model))
        self.device = torch.device(self.config.device) if self.config.device else default_device()
        if self.config.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()
        self.policy = load_policy(self.model_path, self.config)
        # nn.Module.to directly: transformers' wrapper around `to` confuses type checkers.
        self.model: nn.Module = nn.Module.to(self.policy.module, self.device)
        self.reference: nn.Module | None = None
        if self.config.loss.kl_coef > 0 and self.config.reference == "copy":
            # The initial policy, loaded again (a module holding a process group, megatron's,
            # cannot be deep-copied).
            initial = load_policy(self.model_path, self.config).module
            self.reference = nn.Module.to(initial, self.device).eval().requires_grad_(False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self.ranks.adamw(
            params,
            sharded=self.config.distributed_optimizer,
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.adam_eps,
            weight_decay=self.config.weight_decay,
            # One kernel over all parameters instead of a loop of ops per tensor: on SmolLM2 on
            # one CPU thread, clipping and update take ~0.15 s instead of ~0.35 s.
            fused=self.device.type in FUSED_ADAMW_DEVICES,
        )
        warmup = self.config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.version = 0
        self.scorer = Scorer(self.config, self.device)

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """Per-token logprobs under the current policy: `(B, T)` fp32 on the CPU, no gradient."""
        return self.scorer.score(self.model, batch)

    def ref_logprobs(self, batch: TrainBatch) -> Tensor:
        """Per-token logprobs under the frozen reference (the initial policy); `(B, T)` fp32 CPU."""
        if self.reference is None:
            raise ValueError(
                "this backend keeps no reference model (loss.kl_coef is 0 or reference is "
                "'external')"
            )
        return self.scorer.score(self.reference, batch)

    # -- training ------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One AdamW step on `batch`, accumulating gradients over micro-batches.

        The loss of each micro-batch is normalized by the token and sequence counts of the whole
        batch, so the accumulated gradient equals the full-batch gradient under every
        aggregation mode. `old_logprobs` default to the current logprobs detached (ratio 1: one
        step per batch); for several steps on one batch, pass `batch.replace(old_logprobs=
        backend.logprobs(batch))`. The gradients of the last step stay on the parameters until
        the next step. Rows' media inputs go to the model with them (checked by `check_media`
        before anything runs).
        """
        cfg = self.config
        started = time.perf_counter()
        cpu_started = time.thread_time()
        trained_version = self.version
        refusal = self._refusal(batch)
        # Counts of the whole step, over every data-parallel rank: the loss is normalized by
        # them, so the ranks' summed gradients are the whole batch's gradient.
        local = [(batch.loss_mask != 0).sum(), ((batch.loss_mask != 0).sum(-1) > 0).sum()]
        counts = self.ranks.sum(
            torch.tensor([*map(float, local), float(len(batch)), float(refusal is not None)])
        ).tolist()
        total_tokens, total_seqs, total_rows, refusals = counts
        if refusal is not None:
            raise refusal
        if refusals:
            raise ValueError("another data-parallel rank refused its rows of the step")
        if total_tokens == 0:
            raise ValueError("the batch has no loss-masked tokens to train on")

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, Tensor] = {}
        if cfg.pack_sequences and cfg.shared_prefix_min_tokens:
            # Rows that open alike side by side, so that they share the opening in a micro-batch
            # (`trainer/packing.py`); the step's gradient does not depend on the rows' order.
            batch = batch.select(token_order(batch.input_ids, batch.attention_mask))
        for mb in self.scorer.micro_batches(batch):
            mb = mb.to(self.device)
            if (mb.loss_mask != 0).sum() == 0:
                continue
            # Logprobs, entropy and the reference's logprobs of the trained tokens only: the
            # loss reads nothing else (every per-token term is loss-masked).
            rows, positions = trained_tokens(mb.loss_mask)
            targets = mb.input_ids[rows, positions]
            shape = mb.input_ids.shape
            chunk = cfg.logits_chunk_size
            ref = mb.ref_logprobs
            if ref is None and self.reference is not None and cfg.loss.kl_coef > 0:
                with torch.no_grad():
                    ref_logits = self.scorer.token_logits(self.reference, mb, rows, positions)
                    ref_rows = token_logprobs(ref_logits, targets, chunk)
                    ref = at_tokens(ref_rows, rows, positions, shape)
                    del ref_logits
            logits = self.scorer.token_logits(self.model, mb, rows, positions)
            lp = at_tokens(token_logprobs(logits, targets, chunk), rows, positions, shape)
            if cfg.loss.entropy_coef > 0:
                entropy_rows = entropy_from_logits(logits, chunk)
            else:
                with torch.no_grad():
                    entropy_rows = entropy_from_logits(logits.detach(), chunk)
            entropy = at_tokens(entropy_rows, rows, positions, shape)
            old = mb.old_logprobs if mb.old_logprobs is not None else lp.detach()
            loss, metrics = rl_loss(
                cfg.loss,
                lp,
                old,
                mb.advantages,
                mb.loss_mask,
                rollout_logprobs=mb.rollout_logprobs,
                ref_logprobs=ref,
                entropy=entropy,
                total_tokens=total_tokens,
                total_seqs=total_seqs,
            )
            loss.backward()
            for key, value in metrics.items():
                sums[key] = sums[key] + value if key in sums else value
            del logits, lp, entropy, loss

        self.policy.finish_gradients()
        if self.ranks.size > 1:
            self.ranks.sum_gradients([p for p in self.model.parameters() if p.requires_grad])
            sums = _summed_over(self.ranks, sums)
        max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
        grad_norm = self.policy.clip_grad_norm(max_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.version += 1

        elapsed = time.perf_counter() - started
        out = {f"actor/{k}": float(v) for k, v in sums.items()}
        out.update(
            {
                "actor/grad_norm": grad_norm,
                "actor/lr": lr,
                "actor/skipped_step": float(skipped),
                "actor/num_tokens": total_tokens,
                "actor/num_seqs": total_rows,
                "actor/version": float(self.version),
                "perf/step_seconds": elapsed,
                "perf/step_cpu_seconds": time.thread_time() - cpu_started,
                "perf/tokens_per_second": float(batch.attention_mask.sum()) / max(elapsed, 1e-9),
            }
        )
        out.update(self._staleness(batch, trained_version))
        return out

    def _refusal(self, batch: TrainBatch) -> ValueError | None:
        """Why this rank cannot train on its rows, if it cannot (told to the other ranks before
        anything runs, so that none waits for this one in a collective)."""
        cfg = self.config
        if cfg.loss.kl_coef > 0 and batch.ref_logprobs is None and self.reference is None:
            return ValueError("loss.kl_coef > 0 with reference='external' needs batch.ref_logprobs")
        try:
            check_media(self.model, batch)
        except ValueError as refusal:
            return refusal
        return None

    def _staleness(self, batch: TrainBatch, trained_version: int) -> dict[str, float]:
        """Mean and most steps between the trained and the sampling weight version, over the
        sampled tokens of every rank (DESIGN.md §2: s = v_trainer - v_rollout, per token)."""
        stale = torch.zeros(0, dtype=torch.long)
        if batch.weight_version is not None:
            sampled = (batch.loss_mask != 0) & (batch.weight_version >= 0)
            stale = trained_version - batch.weight_version[sampled]
        local = (float(stale.sum()), int(stale.numel()), int(stale.max()) if stale.numel() else 0)
        seen = self.ranks.gather(local)
        tokens = sum(count for _, count, _ in seen)
        if not tokens:
            return {}
        return {
            "actor/staleness_mean": sum(total for total, _, _ in seen) / tokens,
            "actor/staleness_max": float(max(most for _, count, most in seen if count)),
        }

    # -- weights and checkpoints ---------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The weights under the names an engine serving the Hugging Face model loads
        (`PolicyModel.hf_weights`), detached, tied tensors once."""
        return self.policy.hf_weights()

    def save(
        self, path: str | Path, data_position: dict[str, Any] | None = None, *, write: bool = True
    ) -> None:
        """Write a checkpoint folder; it appears complete or not at all (written aside, renamed).

        `data_position` must be JSON-serializable; it comes back from `load` unchanged. The
        weights and optimizer state are saved whole (a model-parallel policy's are gathered, a
        sharded optimizer's state too: every rank calls this, and only the one with `write`
        writes), so any data-, tensor- and pipeline-parallel sizes load them.
        """
        whole_state = self.ranks.optimizer_state(self.optimizer)
        if self.ranks.rank != 0:  # the first data-parallel rank's model-parallel ranks save
            return
        assert whole_state is not None
        optimizer = self._whole_optimizer_state(whole_state)
        if not write:
            self.policy.save_weights(None)
            return
        state = json.dumps(
            {
                "format": CHECKPOINT_FORMAT,
                "version": self.version,
                "data_position": data_position or {},
                "base_model": str(self.model_path),
            },
            indent=2,
        )
        with _atomic_dir(Path(path)) as tmp:
            self.policy.save_weights(tmp / MODEL_FILE)
            torch.save(
                {"optimizer": optimizer, "scheduler": self.scheduler.state_dict()},
                tmp / OPTIMIZER_FILE,
            )
            (tmp / STATE_FILE).write_text(state)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, schedule and version; returns the saved data position."""
        path = Path(path)
        state_file = path / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"{path} is not a trainer checkpoint (no {STATE_FILE})")
        state = json.loads(state_file.read_text())
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"{path}: checkpoint format {state.get('format')!r}, expected {CHECKPOINT_FORMAT}"
            )
        self.policy.load_weights(path / MODEL_FILE, self.device)
        opt = torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(self._local_optimizer_state(opt["optimizer"]))
        self.scheduler.load_state_dict(opt["scheduler"])
        self.version = int(state["version"])
        data_position: dict[str, Any] = state["data_position"]
        return data_position

    def save_hf(self, path: str | Path, *, write: bool = True) -> None:
        """Write a HF model folder (safetensors, config, tokenizer) atomically, fp32 weights
        (`PolicyModel.save_hf`). An engine loads it with `/update_weights_from_disk`. Every
        model-parallel rank calls it; only the one with `write` writes."""
        from transformers import AutoTokenizer

        if not write:
            self.policy.save_hf(None)
            return
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        with _atomic_dir(Path(path)) as tmp:
            self.policy.save_hf(tmp)
            tokenizer.save_pretrained(tmp)

    def _whole_optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's `state` (over this rank's parameters) as the whole model's: entries
        indexed by `PolicyModel.whole_names`, each tensor whole. Every model-parallel rank calls
        this."""
        names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        local = {names[int(i)]: entry for i, entry in state["state"].items()}
        order = self.policy.whole_names()
        entries = self.policy.whole_state(local)
        index = {name: i for i, name in enumerate(order)}
        return {
            "state": {index[name]: entry for name, entry in entries.items()},
            "param_groups": _with_params(state["param_groups"], len(order)),
        }

    def _local_optimizer_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """`_whole_optimizer_state` undone: this rank's parameters' entries, their parts."""
        names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        order = self.policy.whole_names()
        by_name = {order[int(i)]: entry for i, entry in saved["state"].items()}
        mine = self.policy.local_state(by_name, names)
        index = {name: i for i, name in enumerate(names)}
        return {
            "state": {index[name]: entry for name, entry in mine.items()},
            "param_groups": _with_params(saved["param_groups"], len(names)),
        }


def _with_params(groups: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The optimizer's one parameter group, over `count` parameters."""
    if len(groups) != 1:
        raise ValueError(f"the trainer's optimizer has one parameter group, not {len(groups)}")
    return [{**groups[0], "params": list(range(count))}]


def _summed_over(ranks: RankGroup, sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each metric's sum over the ranks' micro-batches (a rank with no trained token has none)."""
    totals: dict[str, Tensor] = {}
    for seen in ranks.gather({key: float(value) for key, value in sums.items()}):
        for key, value in seen.items():
            totals[key] = totals.get(key, torch.tensor(0.0)) + value
    return totals


@contextlib.contextmanager
def _atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `target` by renames."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
