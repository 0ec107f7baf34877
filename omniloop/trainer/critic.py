"""PPO's critic: a value model trained beside the policy (the `critic` role).

With `trainer.critic` (and `trainer.advantage.estimator: gae`), the critic scores every row of a
step with a value per sampled token, the advantage stage turns rewards and values into GAE
advantages and returns (`advantages.gae`), and the critic then takes one optimizer step on the
step's returns (`value_loss`). The value model is the policy's base model (or
`trainer.critic.model`) without its output layer, with a linear head of one output initialised
to zero (so the first values are 0 and the first advantages are the rewards).

Values are aligned as logprobs are: `values[b, t]` is the value of the state before token `t`
was sampled (the head on the hidden state at `t - 1`); 0 at position 0 and on padding. Text
only: a row with media is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from omniloop.inference.models import resolve_model
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import CriticConfig, TrainerConfig
from omniloop.trainer.host_memory import keep_freed_memory
from omniloop.trainer.torch_backend import FUSED_ADAMW_DEVICES, Scorer, default_device


class ValueModel(Protocol):
    """A critic: values of a batch's tokens, trained on their returns."""

    def values(self, batch: TrainBatch) -> Tensor:
        """`(B, T)` values, aligned as logprobs (module docstring), float32 on the CPU."""
        ...

    def train_step(
        self, batch: TrainBatch, old_values: Tensor, returns: Tensor
    ) -> dict[str, float]:
        """One optimizer step on `batch`'s loss-masked tokens; `critic/*` metrics."""
        ...

    def save(self, path: Path) -> None:
        """Write the critic's state to folder `path`."""
        ...

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""
        ...


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None
) -> Tensor:
    """PPO's value loss: `0.5 * max((V - R)^2, (V_clip - R)^2)` averaged over the masked tokens,
    `V_clip = V_old + clamp(V - V_old, -clip, clip)` (no clipping with `clip` None). All `(B, T)`;
    0 for an empty mask."""
    m = mask != 0
    error = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        error = torch.maximum(error, (clipped - returns) ** 2)
    return 0.5 * torch.where(m, error, 0.0).sum() / m.sum().clamp(min=1)


class TorchCritic:
    """The value model on the trainer's device, in fp32 (`trainer.dtype` applies to the policy),
    with its own AdamW. Its micro-batches run packed as the policy's do (`trainer.pack_sequences`:
    a group's rows hold their prompt once)."""

    HEAD = "value_head.pt"
    STATE = "critic_state.json"

    def __init__(self, model: str | Path, trainer: TrainerConfig, config: CriticConfig) -> None:
        from transformers import AutoModel

        self.config = config
        self.micro_batch_size = trainer.micro_batch_size
        self.device = torch.device(trainer.device) if trainer.device else default_device()
        if trainer.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()  # for a critic role in a process of its own, as for the actor
        self.scorer = Scorer(trainer.model_copy(update={"dtype": "fp32"}), self.device)
        folder = resolve_model(str(config.model or model))
        self.backbone: nn.Module = AutoModel.from_pretrained(folder, dtype=torch.float32)
        hidden = int(self.backbone.config.hidden_size)
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.backbone.to(self.device)
        self.head.to(self.device)
        self.optimizer = torch.optim.AdamW(
            [*self.backbone.parameters(), *self.head.parameters()],
            lr=config.lr,
            weight_decay=0.0,
            fused=self.device.type in FUSED_ADAMW_DEVICES,
        )
        self.steps = 0

    def _values(self, batch: TrainBatch) -> Tensor:
        if batch.media_inputs:
            raise ValueError(f"{batch.ids or 'a row'}: the critic is text-only; rows carry media")
        batch = batch.to(self.device)
        hidden = self.scorer.hidden_states(self.backbone, batch)
        attention = batch.attention_mask
        state = self.head(hidden).squeeze(-1)
        values = torch.zeros_like(state)
        values[:, 1:] = state[:, :-1]
        return values * attention

    def values(self, batch: TrainBatch) -> Tensor:
        """`(B, T)` values of `batch` (module docstring), float32 on the CPU."""
        out = []
        with torch.no_grad():
            for start in range(0, len(batch), self.micro_batch_size):
                part = batch.select(slice(start, start + self.micro_batch_size))
                out.append(_pad(self._values(part).float().cpu(), batch.input_ids.shape[1]))
        return torch.cat(out)

    def train_step(
        self, batch: TrainBatch, old_values: Tensor, returns: Tensor
    ) -> dict[str, float]:
        """One optimizer step on `value_loss` over `batch`'s loss-masked tokens (gradients
        accumulated over micro-batches, weighted by their share of the tokens)."""
        total = float((batch.loss_mask != 0).sum().clamp(min=1))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for start in range(0, len(batch), self.micro_batch_size):
            end = start + self.micro_batch_size
            part = batch.select(slice(start, end))
            width = part.input_ids.shape[1]
            mask = part.loss_mask.to(self.device)
            share = float((mask != 0).sum()) / total
            loss = value_loss(
                self._values(part),
                old_values[start:end, :width].to(self.device),
                returns[start:end, :width].to(self.device),
                mask,
                self.config.value_clip,
            )
            (loss * share).backward()
            loss_sum += float(loss.detach()) * share
        params = [*self.backbone.parameters(), *self.head.parameters()]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip))
        self.optimizer.step()
        self.steps += 1
        mask = batch.loss_mask != 0
        target = returns[mask]
        residual = target - old_values[mask]
        variance = float(target.var()) if target.numel() > 1 else 0.0
        explained = 1.0 - float(residual.var()) / variance if variance > 0 else 0.0
        return {
            "critic/value_loss": loss_sum,
            "critic/grad_norm": grad_norm,
            "critic/values_mean": float(old_values[mask].mean()) if mask.any() else 0.0,
            "critic/returns_mean": float(target.mean()) if mask.any() else 0.0,
            "critic/explained_variance": explained,
        }

    def save(self, path: Path) -> None:
        """The value model, its head and optimizer in `path` (a folder)."""
        path.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "backbone": self.backbone.state_dict(),
                "head": self.head.state_dict(),
                "optimizer": self.optimizer.state_dict(),
            },
            path / self.HEAD,
        )
        (path / self.STATE).write_text(json.dumps({"steps": self.steps}))

    def load(self, path: Path) -> None:
        """Restore what `save` wrote to `path`."""
        state = torch.load(path / self.HEAD, map_location=self.device, weights_only=True)
        self.backbone.load_state_dict(state["backbone"])
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(json.loads((path / self.STATE).read_text())["steps"])


def _pad(values: Tensor, width: int) -> Tensor:
    """`values` right-padded with zeros to `width` columns."""
    if values.shape[1] == width:
        return values
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))
