"""Pipeline stages of the megatron policy (`trainer.megatron.pipeline_parallel`).

Each stage holds a contiguous run of the layers, the first also the embedding, the last also the
final norm and the output layer, and the stages of one model run every call together:
`Stages.run(gpt, inputs, tail)` is this stage's part of one forward. A stage after the first
receives the hidden states of the one before it, a stage before the last sends its own to the
one after it, and the last stage's result (`tail` of its output: the logits) is broadcast to
every stage, so that each computes the loss as one stage would. In backward, the gradient of
each stage's input goes back to the stage before it (a hook on the received tensor, and
`_ToNextStage.backward`), so `loss.backward()` on every stage is one backward through the whole
model.

Schedule: one micro-batch in flight, so each stage waits while the others compute. A step is
numerically the one-stage step; what the stages buy is memory (each holds its share of the
weights, gradients and optimizer state), not speed: megatron's interleaved 1F1B schedule is not
used.

Names: a stage's `GPTModel` numbers its layers from 0; `global_name` gives the whole model's
name (the layer index plus the stage's offset). With tied embeddings and several stages, the
last stage holds its own copy of the embedding as its output weight (built untied: megatron
would initialise its duplicate with a collective on CUDA). It is loaded from the embedding, its
gradient is summed with the embedding's (`sum_tied_gradients`) so that both copies take the same
steps, and it is saved once, as the embedding.

Every stage must make the same calls in the same order: they send and receive in lock step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from omniloop.errors import ConfigError

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_HEADER = 8  # a tensor's shape travels first: its rank, then its sizes, in 8 integers
T = TypeVar("T")


@dataclass(frozen=True)
class Stages:
    """The pipeline stages of one model, as seen from one of them."""

    count: int
    index: int
    layers: int
    """Layers per stage."""
    tied: bool
    """The model ties its output weight to its embedding."""

    @classmethod
    def of_process(cls, layers: int, tied: bool) -> Stages:
        """This process's stage in megatron's model-parallel state (initialised before)."""
        from megatron.core import parallel_state

        count = parallel_state.get_pipeline_model_parallel_world_size()
        if layers % count:
            raise ConfigError(
                f"trainer.megatron.pipeline_parallel={count} does not divide the model's "
                f"{layers} layers: choose a divisor of {layers}"
            )
        return cls(count, parallel_state.get_pipeline_model_parallel_rank(), layers // count, tied)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def duplicates_embedding(self) -> bool:
        """This stage's output weight is its copy of the first stage's embedding."""
        return self.tied and self.count > 1 and self.last

    # -- names ---------------------------------------------------------------------------------

    @property
    def layer_range(self) -> range:
        """The whole model's layers this stage holds."""
        return range(self.index * self.layers, (self.index + 1) * self.layers)

    def holds(self, name: str) -> bool:
        """Whether this stage holds (or copies) the whole model's weight `name`, one outside the
        layers: the embedding, the final norm, the output layer."""
        if name == EMBEDDING:
            return self.first or self.duplicates_embedding
        return self.last

    def global_name(self, name: str) -> str | None:
        """The whole model's name for this stage's weight `name`; None for the embedding's copy
        (saved once, as the embedding)."""
        if name == OUTPUT and self.duplicates_embedding:
            return None
        layer = _LAYER.match(name)
        if layer is None:
            return name
        return f"decoder.layers.{int(layer[1]) + self.index * self.layers}.{name[layer.end() :]}"

    def source_name(self, name: str) -> str:
        """The whole model's weight that this stage's weight `name` is loaded from."""
        return self.global_name(name) or EMBEDDING

    def local_weights(self, whole: Mapping[str, T]) -> dict[str, T]:
        """This stage's share of the whole model's `whole` weights, under its own names."""
        out: dict[str, T] = {}
        low = self.index * self.layers
        for name, value in whole.items():
            layer = _LAYER.match(name)
            if layer is not None:
                if low <= int(layer[1]) < low + self.layers:
                    out[f"decoder.layers.{int(layer[1]) - low}.{name[layer.end() :]}"] = value
            elif name == EMBEDDING:
                if self.first:
                    out[name] = value
                if self.duplicates_embedding:
                    out[OUTPUT] = value
            elif self.last:
                out[name] = value
        return out

    def gather(self, part: dict[str, T]) -> dict[str, T]:
        """Every stage's `part` (keyed by whole-model names) in one dict, in stage order, on
        every stage. Tensors travel on the CPU."""
        if self.count == 1:
            return part
        from megatron.core import parallel_state

        moved = {k: v.cpu() if isinstance(v, Tensor) else v for k, v in part.items()}
        parts: list[Any] = [None] * self.count
        dist.all_gather_object(
            parts, moved, group=parallel_state.get_pipeline_model_parallel_group()
        )
        return {name: value for stage in parts for name, value in stage.items()}

    # -- gradients -----------------------------------------------------------------------------

    def sum_tied_gradients(self, gpt: Any) -> None:
        """Give the embedding and its copy on the last stage their summed gradient."""
        if not self.tied or self.count == 1 or not (self.first or self.last):
            return
        from megatron.core import parallel_state

        weight = gpt.embedding.word_embeddings.weight if self.first else gpt.output_layer.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def sum(self, value: Tensor) -> Tensor:
        """`value` summed over the stages (in place)."""
        if self.count > 1:
            from megatron.core import parallel_state

            dist.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
        return value

    # -- the forward ---------------------------------------------------------------------------

    def run(self, gpt: Any, inputs: tuple[Tensor, ...], tail: Callable[[Tensor], Tensor]) -> Tensor:
        """`tail(gpt(*inputs))` of the whole model, on every stage (module docstring)."""
        if self.count == 1:
            return tail(gpt(*inputs))
        from megatron.core import parallel_state

        device = inputs[0].device
        dtype = gpt.config.params_dtype
        if not self.first:
            previous = parallel_state.get_pipeline_model_parallel_prev_rank()
            received = _receive(previous, dtype, device)
            if torch.is_grad_enabled():
                received.requires_grad_()
                received.register_hook(lambda grad: _send(grad, previous))
            gpt.set_input_tensor(received)
        out = gpt(*inputs)
        if self.last:
            result = tail(out)
            _broadcast_from_last(result.detach(), dtype, device)
            return result
        after: Tensor = _ToNextStage.apply(out, dtype)
        return after


class _ToNextStage(torch.autograd.Function):
    """Forward: send this stage's output to the next stage, and return the last stage's result
    (broadcast). Backward: the gradient of the output, from the next stage."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, dtype: torch.dtype) -> Tensor:
        from megatron.core import parallel_state

        ctx.dtype = dtype
        _send(out.detach(), parallel_state.get_pipeline_model_parallel_next_rank())
        return _broadcast_from_last(None, dtype, out.device)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None]:
        from megatron.core import parallel_state

        # The result's gradient is the last stage's too, which backpropagates it there.
        source = parallel_state.get_pipeline_model_parallel_next_rank()
        return _receive(source, ctx.dtype, grads[0].device), None


def _header(tensor: Tensor) -> Tensor:
    header = torch.zeros(_HEADER, dtype=torch.long, device=tensor.device)
    header[0] = tensor.dim()
    header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape)
    return header


def _empty(header: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    dims = int(header[0])
    return torch.empty(header[1 : 1 + dims].tolist(), dtype=dtype, device=device)


def _send(tensor: Tensor, destination: int) -> None:
    tensor = tensor.contiguous()
    dist.send(_header(tensor), destination)
    dist.send(tensor, destination)


def _receive(source: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.recv(header, source)
    tensor = _empty(header, dtype, device)
    dist.recv(tensor, source)
    return tensor


def _broadcast_from_last(tensor: Tensor | None, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The last stage's `tensor` (given there, None elsewhere), on every stage."""
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    if tensor is not None:
        tensor = tensor.contiguous()
        dist.broadcast(_header(tensor), last, group=group)
        dist.broadcast(tensor, last, group=group)
        return tensor
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, last, group=group)
    out = _empty(header, dtype, device)
    dist.broadcast(out, last, group=group)
    return out
