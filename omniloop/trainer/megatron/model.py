"""A Hugging Face Llama / Qwen2 model as megatron-core's `GPTModel`, behind the call the trainer
makes of a Hugging Face model.

`MegatronPolicy.load(path)` builds the `GPTModel` from the folder's config (`convert`), loads its
weights, and wraps it in `MegatronCausalLM`, whose `forward(input_ids=, attention_mask=)`
returns an object with `.logits` `(B, T, V)`: what `TorchTrainerBackend`'s scorer and loss call.
Weights leave in Hugging Face names (`hf_weights`), so engines load them as they load the torch
backend's, and `save_hf` writes a folder an engine or `from_pretrained` reads.

Attention: right-padded rows, positions from 0, one causal mask for the batch (a real token
never attends to a later padding token, so padding changes nothing that is scored). The mask is
always passed explicitly (megatron's default mask is built on CUDA).

Tensor parallelism (`tensor_parallel` ranks, no pipeline stages): each rank holds its part of
every split weight (`convert.shard`); the rows of one batch go through all ranks together, and
the logits come out whole on each (`parallel_output=False`), so the loss is computed as with
one rank. The ranks' processes must already form the world (`tensor_parallel` ranks, or that
times the data-parallel ranks, e.g. gloo on the CPU, NCCL on GPUs; `trainer/ranks.py` starts
them for a run) and call every method in lock step: `hf_weights` gathers the parts from all
ranks. With one rank, a world of one (gloo, over a file in a temporary folder) is made unless
the process already has one. The gradient norm counts each split weight's parts once across
ranks and each whole weight once (`clip_grad_norm`). Checkpoints (`save_weights`) hold the
whole weights, gathered, so any tensor-parallel size resumes them (`load_weights` takes this
rank's part).
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from omniloop.errors import ConfigError
from omniloop.trainer.megatron import cpu_shims
from omniloop.trainer.megatron.convert import (
    GPTShape,
    gpt_shape,
    rope_parameters,
    shard,
    split_dim,
    to_hf,
    to_megatron,
    transformer_config,
    unshard,
)
from omniloop.trainer.megatron.pipeline import Stages
from omniloop.trainer.packing import pack_rows

_group_lock = threading.Lock()


@dataclass
class CausalLMOutput:
    logits: Tensor


def ensure_model_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1) -> None:
    """Megatron's model-parallel state for `tensor_parallel` × `pipeline_parallel` ranks per
    model, if not there yet (module docstring); ConfigError when the process's world does not
    fit."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    per_model = tensor_parallel * pipeline_parallel
    with _group_lock:
        if not dist.is_initialized():
            if per_model != 1:
                raise ConfigError(
                    f"trainer.megatron.tensor_parallel={tensor_parallel} and "
                    f"pipeline_parallel={pipeline_parallel} need a process per rank, joined in "
                    "one process group, and this process has none (a run's actor starts them: "
                    "`RankedTrainer`)"
                )
            store = Path(tempfile.mkdtemp(prefix="omniloop-megatron-")) / "store"
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            if dist.get_world_size() % per_model:
                raise ConfigError(
                    f"trainer.megatron.tensor_parallel={tensor_parallel} × "
                    f"pipeline_parallel={pipeline_parallel} does not divide the world of "
                    f"{dist.get_world_size()} processes"
                )
            parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel)
        elif (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        ) != (tensor_parallel, pipeline_parallel):
            raise ConfigError(
                f"trainer.megatron.tensor_parallel={tensor_parallel} and pipeline_parallel="
                f"{pipeline_parallel}, but this process already runs "
                f"{parallel_state.get_tensor_model_parallel_world_size()} and "
                f"{parallel_state.get_pipeline_model_parallel_world_size()}"
            )


class MegatronCausalLM(nn.Module):
    """`GPTModel` called as a Hugging Face causal LM is (module docstring)."""

    def __init__(
        self,
        gpt: nn.Module,
        shape: GPTShape,
        stages: Stages,
        *,
        pack: bool = False,
        min_shared: int = 0,
    ) -> None:
        """`pack`: run the rows of a batch packed (`trainer/packing.py`), given its attention
        mask, rows opening with the same `min_shared` or more tokens sharing them (0: none);
        `stages`: the pipeline stage `gpt` is (`pipeline.py`)."""
        super().__init__()
        self.gpt: Any = gpt  # megatron-core is untyped
        self.shape = shape
        self.stages = stages
        self.pack = pack
        self.min_shared = min_shared

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        use_cache: bool = False,
        **media: Any,
    ) -> CausalLMOutput:
        if media:
            raise ValueError(
                f"trainer.backend=megatron trains text models; these rows carry media inputs "
                f"({', '.join(sorted(media))}): use trainer.backend=torch"
            )
        if self.pack and attention_mask is not None:
            packing = pack_rows(input_ids, attention_mask, min_shared=self.min_shared)
            inputs = (packing.input_ids, packing.positions, packing.mask)
            with _rotary_at(self.gpt, packing.positions):
                logits = self.stages.run(self.gpt, inputs, _same)
            return CausalLMOutput(logits=packing.unpack(logits))
        logits = self.stages.run(self.gpt, _positions_and_mask(input_ids), _same)
        return CausalLMOutput(logits=logits)

    def logits_at(
        self, input_ids: Tensor, attention_mask: Tensor, rows: Tensor, positions: Tensor
    ) -> Tensor:
        """`(N, V)` logits at `(rows, positions)`, only those through the output layer (the
        trainer's `SelectiveHead`): in RL most tokens are not trained, and over a large
        vocabulary the output layer is most of a step's compute and memory."""
        packing = None
        if self.pack:
            packing = pack_rows(input_ids, attention_mask, min_shared=self.min_shared)
            inputs = (packing.input_ids, packing.positions, packing.mask)
            rows, positions = packing.at(rows, positions)
        else:
            inputs = _positions_and_mask(input_ids)

        def head(hidden: Tensor) -> Tensor:  # (T, B, H) → (N, V)
            picked = hidden[positions, rows][:, None, :]  # (N, 1, H): N sequences of one token
            weight = self.gpt.shared_embedding_or_output_weight() if self.shape.tied else None
            logits, _ = self.gpt.output_layer(picked, weight=weight, runtime_gather_output=True)
            return logits[:, 0, :]

        # With `post_process` off, the last stage's GPTModel returns the decoder's output (final
        # norm included) instead of running its output layer: the same forward up to the logits.
        last_stage = self.gpt.post_process
        self.gpt.post_process = False
        try:
            if packing is None:
                return self.stages.run(self.gpt, inputs, head)
            with _rotary_at(self.gpt, packing.positions):
                return self.stages.run(self.gpt, inputs, head)
        finally:
            self.gpt.post_process = last_stage


def _same(tensor: Tensor) -> Tensor:
    return tensor


@contextlib.contextmanager
def _rotary_at(gpt: Any, positions: Tensor) -> Iterator[None]:
    """Rotary embeddings at each token's own position (`(B, T)` `positions`) in the forwards
    of `gpt` within: megatron's `RotaryEmbedding` gives the angles of columns 0..T-1, which is
    right for rows that start at column 0, and for packed rows without sharing up to rounding
    (attention sees relative positions); a row that reads a shared opening from columns far
    before its own needs its true positions. The angles of each column's position, `(T, B, 1,
    dim)`, broadcast over the heads as the column angles `(T, 1, 1, dim)` do."""
    rotary = gpt.rotary_pos_emb
    columns = rotary.forward

    def at_positions(*_: Any, **__: Any) -> Tensor:
        table: Tensor = columns(int(positions.max()) + 1)  # (L, 1, 1, dim)
        return table[:, 0][positions.transpose(0, 1)]

    rotary.forward = at_positions
    try:
        yield
    finally:
        del rotary.forward  # the class's again


def _positions_and_mask(input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """GPTModel's inputs for right-padded rows: ids, positions from 0, the causal mask."""
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).expand(batch, -1)
    causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device)
    return input_ids, positions, torch.triu(causal, diagonal=1)[None, None]  # True: masked


@dataclass
class MegatronPolicy:
    """The policy module of `trainer.backend=megatron` (module docstring)."""

    module: MegatronCausalLM
    hf_config: Any
    tensor_parallel: int = 1

    @property
    def stages(self) -> Stages:
        return self.module.stages

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        gradient_checkpointing: bool = False,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        pack_sequences: bool = False,
        shared_prefix_min_tokens: int = 0,
    ) -> MegatronPolicy:
        """Build this rank's `GPTModel` (its pipeline stage, its tensor-parallel part) of the
        Hugging Face folder `path` and load its weights. `pack_sequences`: run batches packed
        (`trainer/packing.py`), rows sharing openings of `shared_prefix_min_tokens` or more.

        `gradient_checkpointing`: megatron's full recompute, one layer at a time (it saves and
        restores CUDA RNG states, so it needs a GPU)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from transformers import AutoConfig

        if not torch.cuda.is_available():
            if gradient_checkpointing:
                raise ConfigError(
                    "trainer.gradient_checkpointing with trainer.backend=megatron needs a GPU "
                    "(megatron's recompute saves CUDA RNG states); set it false on the CPU"
                )
            cpu_shims.install()
        ensure_model_parallel(tensor_parallel, pipeline_parallel)
        from megatron.core import parallel_state
        from megatron.core import tensor_parallel as megatron_tp

        if torch.cuda.is_available():
            # Megatron forks its CUDA RNG tracker around attention (and saves its states for
            # recomputation); the tracker needs its states seeded first.
            megatron_tp.model_parallel_cuda_manual_seed(0)

        rank = parallel_state.get_tensor_model_parallel_rank()
        hf_config = AutoConfig.from_pretrained(path)
        shape = gpt_shape(hf_config)
        stages = Stages.of_process(shape.layers, shape.tied)
        recompute = (
            {"recompute_granularity": "full", "recompute_method": "uniform"}
            | {"recompute_num_layers": 1}
            if gradient_checkpointing
            else {}
        )
        config = transformer_config(
            hf_config,
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            pipeline_dtype=torch.float32,
            **recompute,
        )
        gpt = GPTModel(
            config,
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            # Several stages: the last one's copy of a tied embedding is its own weight here
            # (`pipeline.py`).
            share_embeddings_and_output_weights=shape.tied and stages.count == 1,
            position_embedding_type="rope",
            rotary_base=int(rope_parameters(hf_config)["rope_theta"]),
            parallel_output=False,  # whole logits on every rank: the loss is a rank's own
            pre_process=stages.first,
            post_process=stages.last,
        )
        # Only this stage's tensors are read from the files.
        hf_state = _SafetensorsFolder(Path(path))
        whole = stages.local_weights(
            to_megatron(hf_state, shape, stages.layer_range, wanted=stages.holds)
        )
        parts = {name: shard(name, t, rank, tensor_parallel) for name, t in whole.items()}
        missing, unexpected = gpt.load_state_dict(parts, strict=False)
        missing = [k for k in missing if not k.endswith("._extra_state")]
        if missing or unexpected:
            raise ValueError(f"{path}: weights do not fit the GPTModel: {missing=} {unexpected=}")
        module = MegatronCausalLM(
            gpt, shape, stages, pack=pack_sequences, min_shared=shared_prefix_min_tokens
        )
        return cls(module.eval(), hf_config, tensor_parallel)

    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The whole weights under Hugging Face names, detached (each tied tensor once),
        gathered from every rank."""
        return to_hf(self._whole_weights(), self.module.shape)

    def _whole_weights(self) -> dict[str, Tensor]:
        """The whole model's weights under megatron's names, gathered from every tensor-parallel
        rank and pipeline stage, on every rank."""
        part: dict[str, Tensor] = {}
        for name, local in self.module.gpt.named_parameters():
            whole = self._gathered(name, local.detach())
            if (global_name := self.stages.global_name(name)) is not None:
                part[global_name] = whole
        return self.stages.gather(part)

    def _gathered(self, name: str, part: Tensor) -> Tensor:
        """The whole of `GPTModel` weight `name` (or a tensor shaped like it) from every
        tensor-parallel rank's `part`; every rank calls this."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.tensor_parallel == 1 or split_dim(name) is None:
            return part
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(part) for _ in range(self.tensor_parallel)]
        dist.all_gather(parts, part.contiguous(), group=group)
        return unshard(name, parts)

    def _rank_part(self, name: str, whole: Tensor) -> Tensor:
        from megatron.core import parallel_state

        rank = parallel_state.get_tensor_model_parallel_rank() if self.tensor_parallel > 1 else 0
        return shard(name, whole, rank, self.tensor_parallel)

    # -- per-parameter state (the optimizer's) ---------------------------------------------------

    def whole_names(self) -> list[str]:
        names = [
            f"gpt.{global_name}"
            for name, _ in self.module.gpt.named_parameters()
            if (global_name := self.stages.global_name(name)) is not None
        ]
        return list(self.stages.gather(dict.fromkeys(names, 0)))

    def whole_state(self, local: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        part = {}
        for name, entry in local.items():
            gpt_name = name.removeprefix("gpt.")
            whole = {
                key: self._gathered(gpt_name, value) if _per_element(value) else value
                for key, value in entry.items()
            }
            if (global_name := self.stages.global_name(gpt_name)) is not None:
                part[f"gpt.{global_name}"] = whole
        return self.stages.gather(part)

    def local_state(
        self, whole: dict[str, dict[str, Any]], names: list[str]
    ) -> dict[str, dict[str, Any]]:
        out = {}
        for name in names:
            gpt_name = name.removeprefix("gpt.")
            entry = whole.get(f"gpt.{self.stages.source_name(gpt_name)}")
            if entry is not None:
                out[name] = {
                    key: self._rank_part(gpt_name, value) if _per_element(value) else value
                    for key, value in entry.items()
                }
        return out

    def finish_gradients(self) -> None:
        self.stages.sum_tied_gradients(self.module.gpt)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradients so that their global norm is at most `max_norm`; the norm before.

        A split weight's squared norm is summed over its tensor-parallel parts and a whole
        weight's counted once (every tensor-parallel rank holds the same gradient); each stage
        counts its own layers, and the last stage's copy of a tied embedding is not counted
        again."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        params = [(n, p) for n, p in self.module.gpt.named_parameters() if p.grad is not None]
        split = torch.zeros((), dtype=torch.float64)
        whole = torch.zeros((), dtype=torch.float64)
        for name, param in params:
            if self.stages.global_name(name) is None:
                continue
            squared = param.grad.detach().double().pow(2).sum().cpu()
            if getattr(param, "tensor_model_parallel", False):
                split += squared
            else:
                whole += squared
        if self.tensor_parallel > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            dist.all_reduce(split, group=group)
        norm = float(self.stages.sum(split + whole).sqrt())
        if math.isfinite(norm) and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for _, param in params:
                param.grad.detach().mul_(scale)
        return norm

    def save_hf(self, folder: Path | None) -> None:
        """Write the weights (`model.safetensors`) and config into `folder`."""
        import safetensors.torch

        weights = {name: t.contiguous() for name, t in self.hf_weights()}
        if folder is None:
            return
        safetensors.torch.save_file(weights, str(folder / "model.safetensors"), {"format": "pt"})
        self.hf_config.save_pretrained(folder)

    def save_weights(self, file: Path | None) -> None:
        """The whole parameters under megatron's names (its `_extra_state` entries hold
        nothing), gathered from every rank: any tensor- and pipeline-parallel sizes load
        them."""
        import safetensors.torch

        weights = {
            f"gpt.{name}": tensor.contiguous() for name, tensor in self._whole_weights().items()
        }
        if file is not None:
            safetensors.torch.save_file(weights, str(file))

    def load_weights(self, file: Path, device: torch.device) -> None:
        import safetensors.torch

        saved = safetensors.torch.load_file(str(file), device=str(device))
        expected = set(self.whole_names())
        if saved.keys() != expected:
            missing, unexpected = sorted(expected - saved.keys()), sorted(saved.keys() - expected)
            raise ValueError(f"{file}: weights do not fit the model: {missing=} {unexpected=}")
        with torch.no_grad():
            for name, param in self.module.gpt.named_parameters():
                whole = saved[f"gpt.{self.stages.source_name(name)}"]
                param.copy_(self._rank_part(name, whole))


class _SafetensorsFolder(Mapping[str, Tensor]):
    """The tensors of a folder's safetensors files, each read when it is looked up."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self._files: dict[str, Path] = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as tensors:
                self._files.update(dict.fromkeys(tensors.keys(), file))

    def __getitem__(self, name: str) -> Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), "pt") as tensors:
            tensor: Tensor = tensors.get_tensor(name)
            return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _per_element(value: Any) -> bool:
    """An optimizer state entry shaped like its parameter (not a scalar such as `step`)."""
    return isinstance(value, Tensor) and value.dim() > 0
