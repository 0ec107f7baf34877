"""The trainer backends on one GPU: what the CPU tests cannot show.

On CUDA, fp32, for `trainer.backend=torch` and `trainer.backend=megatron` (the model folder
given, default the tiny random Llama; and a tiny random Qwen2 made here, with q/k/v biases):
- logprobs against the Hugging Face model's own forward on the GPU (max |Δ|);
- three train steps each (median seconds), and the two backends' weights after them (max |Δ|);
- megatron's activation recomputation (`gradient_checkpointing`, which needs CUDA RNG states):
  the gradient with and without it (max |Δ|).

Not here yet (issue #11): SGLang and NCCL weight sync to it, which need SGLang on the GPU host.

Prints ONE JSON line.

    python bench/gpu_check.py [MODEL_FOLDER]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.torch_backend import TorchTrainerBackend

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
"""`GPU_CHECK_DEVICE=cpu` tries the script without a GPU (the recomputation check is skipped)."""


def batch(vocab: int) -> TrainBatch:
    """Four right-padded rows of random ids (fixed seed), the first 8 tokens untrained."""
    gen = torch.Generator().manual_seed(0)
    lengths = [64, 48, 80, 33]
    rows, width = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (rows, width), generator=gen)
    attention = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width)
    for row, n in enumerate(lengths):
        attention[row, :n] = 1
        loss_mask[row, 8:n] = 1
    return TrainBatch(
        input_ids=ids * attention,
        attention_mask=attention,
        loss_mask=loss_mask,
        rollout_logprobs=torch.zeros(rows, width),
        advantages=torch.tensor([1.0, -0.5, 0.7, -1.2])[:, None] * loss_mask,
    )


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def trainer(model: Path, backend: str, **config: Any) -> TorchTrainerBackend:
    settings = {"device": DEVICE, "backend": backend, "lr": 1e-3, "grad_clip": None, **config}
    return TorchTrainerBackend(model, TrainerConfig.model_validate(settings))


def hf_logprobs(model: Path, data: TrainBatch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from omniloop.trainer.torch_backend import shifted_logprobs

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf = torch.nn.Module.to(hf, DEVICE).eval()
    with torch.no_grad():
        on_gpu = data.to(DEVICE)
        logits = hf(input_ids=on_gpu.input_ids, attention_mask=on_gpu.attention_mask).logits
        return shifted_logprobs(logits, on_gpu.input_ids, on_gpu.attention_mask).cpu()


def check(model: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    data = batch(min(AutoConfig.from_pretrained(model).vocab_size, 2000))
    reference = hf_logprobs(model, data)
    out: dict[str, Any] = {}
    trained = {}
    for backend in ("torch", "megatron"):
        b = trainer(model, backend)
        out[f"{backend}_logprob_max_abs_diff_vs_hf"] = float(
            (b.logprobs(data) - reference).abs().max()
        )
        times = []
        for _ in range(3):
            synchronize()
            started = time.perf_counter()
            b.train_step(data)
            synchronize()
            times.append(time.perf_counter() - started)
        out[f"{backend}_step_s"] = round(statistics.median(times), 4)
        trained[backend] = {n: w.float().cpu() for n, w in b.named_weights()}
    out["weights_max_abs_diff_after_3_steps"] = max(
        float((trained["megatron"][n] - w).abs().max()) for n, w in trained["torch"].items()
    )
    if DEVICE != "cuda":
        return out
    grads = []
    for recompute in (False, True):
        b = trainer(model, "megatron", gradient_checkpointing=recompute)
        b.train_step(data)
        grads.append(
            {n: p.grad.clone() for n, p in b.model.named_parameters() if p.grad is not None}
        )
    out["megatron_recompute_grad_max_abs_diff"] = max(
        float((grads[1][n] - g).abs().max()) for n, g in grads[0].items()
    )
    return out


def tiny_qwen2(folder: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


def main() -> None:
    llama = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("tiny")
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else None
    result: dict[str, Any] = {"bench": "gpu_check", "gpu": gpu}
    result["llama"] = check(llama)
    with tempfile.TemporaryDirectory() as tmp:
        result["qwen2"] = check(tiny_qwen2(Path(tmp) / "qwen2"))
    result["torch"] = torch.__version__
    print(json.dumps(result))


if __name__ == "__main__":
    main()
