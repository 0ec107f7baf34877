"""`TorchTrainerBackend`: a Hugging Face causal LM trained with plain PyTorch (CPU or one GPU).

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
rounding); position ids start at 0 for every row.

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
import copy
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn

from omniloop.inference.models import resolve_model
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.losses import entropy_from_logits, rl_loss, token_logprobs

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


class Scorer:
    """Forward passes under a trainer config: autocast per `dtype`, logprobs scored in
    micro-batches of `micro_batch_size` (the policy's and the reference's alike)."""

    def __init__(self, config: TrainerConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.dtype == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def logits(self, model: nn.Module, batch: TrainBatch) -> Tensor:
        """`(B, T, V)` logits of `model` for `batch` (on the batch's device)."""
        with self._autocast():
            out = model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
            )
        logits: Tensor = out.logits
        return logits

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
        whole and are sliced.
        """
        hf: Any = model
        decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else None
        head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
        softcap = getattr(getattr(hf, "config", None), "final_logit_softcapping", None)
        if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Linear) or softcap:
            return self.logits(model, batch)[rows, positions - 1]
        with self._autocast():
            out = decoder(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
            )
            logits: Tensor = head(out.last_hidden_state[rows, positions - 1])
        return logits

    @torch.no_grad()
    def score(self, model: nn.Module, batch: TrainBatch) -> Tensor:
        """Per-token logprobs of `batch` under `model`: `(B, T)` fp32 on the CPU, no gradient."""
        was_training = model.training
        model.eval()
        try:
            out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
            start = 0
            for mb in batch.split(self.config.micro_batch_size):
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


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TorchTrainerBackend:
    """A `TrainerBackend` over `AutoModelForCausalLM`: AdamW, grad clipping, micro-batching.

    `model` is anything `resolve_model` accepts (`tiny`, `smollm2`, a HF folder). Not thread-safe:
    one caller drives it.
    """

    def __init__(self, model: str | Path, config: TrainerConfig | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config or TrainerConfig()
        self.model_path = resolve_model(str(model))
        self.device = torch.device(self.config.device) if self.config.device else default_device()
        hf_model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        if self.config.gradient_checkpointing:
            hf_model.activation_checkpointing_enable({"use_reentrant": False})
        # nn.Module.to directly: transformers' wrapper around `to` confuses type checkers.
        self.model: nn.Module = nn.Module.to(hf_model, self.device)
        self.reference: nn.Module | None = None
        if self.config.loss.kl_coef > 0 and self.config.reference == "copy":
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.adam_eps,
            weight_decay=self.config.weight_decay,
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
        the next step.
        """
        cfg = self.config
        started = time.perf_counter()
        cpu_started = time.thread_time()
        trained_version = self.version
        total_tokens = float((batch.loss_mask != 0).sum())
        if total_tokens == 0:
            raise ValueError("the batch has no loss-masked tokens to train on")
        total_seqs = float(((batch.loss_mask != 0).sum(-1) > 0).sum())
        if cfg.loss.kl_coef > 0 and batch.ref_logprobs is None and self.reference is None:
            raise ValueError("loss.kl_coef > 0 with reference='external' needs batch.ref_logprobs")

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, Tensor] = {}
        for mb in batch.split(cfg.micro_batch_size):
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

        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
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
                "actor/num_seqs": float(len(batch)),
                "actor/version": float(self.version),
                "perf/step_seconds": elapsed,
                "perf/step_cpu_seconds": time.thread_time() - cpu_started,
                "perf/tokens_per_second": float(batch.attention_mask.sum()) / max(elapsed, 1e-9),
            }
        )
        if batch.weight_version is not None:
            sampled = (batch.loss_mask != 0) & (batch.weight_version >= 0)
            if bool(sampled.any()):
                # DESIGN.md §2: s = v_trainer - v_rollout, per sampled token.
                stale = trained_version - batch.weight_version[sampled]
                out["actor/staleness_mean"] = float(stale.float().mean())
                out["actor/staleness_max"] = float(stale.max())
        return out

    # -- weights and checkpoints ---------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Parameters and persistent buffers under their HF names; tied tensors once (detached)."""
        persistent = set(self.model.state_dict().keys())
        for name, param in self.model.named_parameters():
            yield name, param.detach()
        for name, buf in self.model.named_buffers():
            if name in persistent:
                yield name, buf.detach()

    def save(self, path: str | Path, data_position: dict[str, Any] | None = None) -> None:
        """Write a checkpoint folder; it appears complete or not at all (written aside, renamed).

        `data_position` must be JSON-serializable; it comes back from `load` unchanged.
        """
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
            safetensors.torch.save_model(self.model, str(tmp / MODEL_FILE))
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                },
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
        missing, unexpected = safetensors.torch.load_model(
            self.model, str(path / MODEL_FILE), strict=True, device=str(self.device)
        )
        if missing or unexpected:
            raise ValueError(f"{path}: weights do not fit the model: {missing=} {unexpected=}")
        opt = torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(opt["optimizer"])
        self.scheduler.load_state_dict(opt["scheduler"])
        self.version = int(state["version"])
        data_position: dict[str, Any] = state["data_position"]
        return data_position

    def save_hf(self, path: str | Path) -> None:
        """Write a HF model folder (safetensors, config, tokenizer) atomically, fp32 weights.

        An engine loads it with `/update_weights_from_disk`.
        """
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        with _atomic_dir(Path(path)) as tmp:
            self.model.save_pretrained(tmp)  # type: ignore[operator]
            tokenizer.save_pretrained(tmp)


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
