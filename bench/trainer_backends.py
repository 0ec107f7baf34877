"""Trainer backends side by side: step time and peak memory, the Hugging Face model
(`trainer.backend=torch`) against megatron-core's `GPTModel` (`trainer.backend=megatron`).

The same batch (8 rows of 128 tokens, the last 96 trained, fixed seed) and model (`--model`,
default `smollm2`, fp32, one thread) for each backend, each in a process of its own so that its
peak resident memory is its own: one warm-up step, then the median of `--steps` timed
`train_step`s. The backends alternate (torch, megatron, torch, megatron) and each one's time is
the median of its rounds, so a change in the machine's load between them shows in both.

`megatron_tp2_step_s`, `megatron_pp2_step_s`: megatron with two tensor-parallel ranks, and
with two pipeline stages, as a run's actor drives them (`RankedTrainer`: two rank processes
over gloo, one thread each, under a local Ray); their peak memory is each rank process's peak
resident set (`megatron_tp2_rank_peak_gb`, a list). null, with megatron's reason in
`megatron_tp2_error` (or `_pp2_`), for a model that does not split so (SmolLM2-135M's 9 heads
do not split in two).

`--batch grpo`: a GRPO step's batch instead, 8 prompts of 64 tokens × 4 samples of 48 trained
tokens each (32 rows, micro-batches of 8), and each backend also with `pack_sequences=false`
(`torch_padded_step_s`, `megatron_padded_step_s`): the rows of a group hold their prompt once
when packed (`trainer/packing.py`), 2,048 distinct tokens against 3,584 padded.

Prints ONE JSON line: `torch_step_s`, `megatron_tp1_step_s`, `megatron_tp2_step_s`,
`megatron_pp2_step_s`, `megatron_over_torch`, `torch_peak_gb`, `megatron_peak_gb` (with
`--batch grpo` also `torch_padded_step_s`, `megatron_padded_step_s`, `shared_prefix_speedup`:
torch padded over packed).

    .venv/bin/python bench/trainer_backends.py [--model smollm2] [--steps 3] [--rounds 2]
        [--batch uniform|grpo]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

BATCH_NAMES = {"uniform": "8x128 (96 trained)", "grpo": "8 prompts x 4 samples, 64 + 48 tokens"}
RANKED = {"megatron_tp2": {"tensor_parallel": 2}, "megatron_pp2": {"pipeline_parallel": 2}}
"""Megatron's layouts over two rank processes."""


BATCHES = {"uniform": (8, 1, 128, 32), "grpo": (8, 4, 112, 64)}
"""Batch shapes: prompts, samples per prompt, tokens per row, prompt tokens (untrained)."""


def one(backend: str, model: str, steps: int, shape: str) -> dict[str, object]:
    """Time `steps` train steps of `backend` in this process (after a warm-up step)."""
    import torch

    from omniloop.trainer.batch import TrainBatch
    from omniloop.trainer.config import TrainerConfig
    from omniloop.trainer.torch_backend import TorchTrainerBackend

    torch.set_num_threads(1)
    prompts, samples, length, prompt = BATCHES[shape]
    rows = prompts * samples
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40_000, (rows, length), generator=gen)
    ids[:, :prompt] = ids[::samples, :prompt].repeat_interleave(samples, 0)  # a group's prompt
    loss_mask = torch.zeros(rows, length)
    loss_mask[:, prompt:] = 1
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones(rows, length, dtype=torch.long),
        loss_mask=loss_mask,
        rollout_logprobs=torch.zeros(rows, length),
        advantages=torch.linspace(-1, 1, rows)[:, None] * loss_mask,
    )
    settings: dict[str, object] = {"lr": 1e-5, "micro_batch_size": 8, "device": "cpu"}
    if backend.endswith("_padded"):
        backend = backend.removesuffix("_padded")
        settings["pack_sequences"] = False
    if backend in RANKED:
        import ray

        from omniloop.trainer.backend import make_backend

        ray.init(address="local", num_cpus=2, include_dashboard=False)
        settings |= {"backend": "megatron", "megatron": RANKED[backend]}
        config = TrainerConfig.model_validate(settings)
        trainer = make_backend(model, config)
    else:
        config = TrainerConfig.model_validate({**settings, "backend": backend})
        trainer = TorchTrainerBackend(model, config)
    trainer.train_step(batch)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - started)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out: dict[str, object] = {"step_s": statistics.median(times), "peak_gb": peak_gb}
    if backend in RANKED:
        out["rank_peak_gb"] = rank_peaks_gb()
    return out


def rank_peaks_gb() -> list[float]:
    """The peak resident set of each rank process (Ray titles them `ray::RankWorker…`)."""
    import psutil

    peaks = []
    for proc in psutil.process_iter(["cmdline"]):
        if any("RankWorker" in part for part in proc.info["cmdline"] or []):
            with open(f"/proc/{proc.pid}/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        peaks.append(round(int(line.split()[1]) / 2**20, 2))
    return sorted(peaks)


def run_one(backend: str, model: str, steps: int, shape: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", backend, "--model", model, "--steps", str(steps)]
    cmd += ["--batch", shape]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        # e.g. SmolLM2's 9 attention heads do not split over two tensor-parallel ranks
        errors = [line for line in done.stderr.splitlines() if "Error: " in line]
        raise RuntimeError(errors[-1] if errors else done.stderr[-500:])
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per backend")
    parser.add_argument("--batch", choices=sorted(BATCHES), default="uniform")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.model, args.steps, args.batch)))
        return
    padded = ["torch_padded", "megatron_padded"] if args.batch == "grpo" else []
    backends = ["torch", *padded[:1], "megatron", *padded[1:], *RANKED]
    results: dict[str, list[dict[str, Any]]] = {backend: [] for backend in backends}
    errors: dict[str, str] = {}
    for _ in range(args.rounds):
        for backend in backends:
            if backend in errors:
                continue
            try:
                results[backend].append(run_one(backend, args.model, args.steps, args.batch))
            except RuntimeError as error:
                if backend not in RANKED:
                    raise
                errors[backend] = str(error)
    step = {b: statistics.median(r["step_s"] for r in rs) for b, rs in results.items() if rs}
    peak = {b: max(r["peak_gb"] for r in rs) for b, rs in results.items() if rs}
    print(
        json.dumps(
            {
                "bench": "trainer_backends",
                "model": args.model,
                "torch_step_s": round(step["torch"], 3),
                "megatron_tp1_step_s": round(step["megatron"], 3),
                **{
                    f"{backend}_step_s": round(step[backend], 3) if backend in step else None
                    for backend in RANKED
                },
                **{f"{backend}_error": errors.get(backend) for backend in RANKED},
                **{
                    f"{backend}_rank_peak_gb": results[backend][-1]["rank_peak_gb"]
                    for backend in RANKED
                    if results[backend]
                },
                **{f"{backend}_step_s": round(step[backend], 3) for backend in padded},
                **(
                    {"shared_prefix_speedup": round(step["torch_padded"] / step["torch"], 3)}
                    if padded
                    else {}
                ),
                "megatron_over_torch": round(step["megatron"] / step["torch"], 3),
                "torch_peak_gb": round(peak["torch"], 2),
                "megatron_peak_gb": round(peak["megatron"], 2),
                "batch": BATCH_NAMES[args.batch],
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
