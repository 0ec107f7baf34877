"""Generated tokens/s of omniloop's CPU engine beside Hugging Face `generate`, on SmolLM2.

Prints ONE JSON line. For each concurrency (default 1, 8, 32): our engine serves that many
concurrent `/generate` requests over HTTP (loopback, one prompt each, greedy, `ignore_eos`, so
every request produces exactly `--new-tokens` tokens); then HF `model.generate` runs a batch
of the same prompts (left-padded, greedy, `min_new_tokens` = `max_new_tokens`). The two are
interleaved per concurrency so that changing machine load hits both alike. Both use the same
explicit torch thread count. Wall seconds, CPU seconds (engine process; bench process for the
HTTP client and for HF) and the load average are reported, because on a shared machine wall
time alone is noise.

    .venv/bin/python bench/engine_cpu.py [--model smollm2] [--threads 1] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give three tips for a job interview.",
    "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What is a prime number?",
    "How does a bicycle stay upright?",
    "Name five fruits that are red.",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish.",
    "How many legs does a spider have?",
    "What is machine learning?",
    "Write a short poem about autumn.",
    "Explain what a CPU does.",
    "What should I pack for a weekend hike?",
    "How do vaccines work?",
    "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
    "What is the Pythagorean theorem?",
    "How do I make a cup of tea?",
    "Who wrote Pride and Prejudice?",
    "What are the primary colors?",
    "Explain gravity to a child.",
    "What is the largest planet in our solar system?",
    "How do bees make honey?",
    "What is an API?",
    "List the days of the week.",
]


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def start_engine(model: str, threads: int, max_context: int) -> tuple[subprocess.Popen[str], str]:
    exe = Path(sys.executable).parent / "omniloop"
    cmd = [
        str(exe), "engine", "serve", "--model", model, "--port", "0", "--threads", str(threads),
        "--max-batch", "32", "--max-context", str(max_context),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "ready at " in line:
            url = line.split("ready at ", 1)[1].split()[0]
            return proc, url
    raise RuntimeError("engine exited before it was ready:\n" + "".join(lines))


async def run_ours(url: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import httpx

    sampling = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:

        async def one(ids: list[int]) -> list[int]:
            r = await http.post("/generate", json={"input_ids": ids, "sampling_params": sampling})
            r.raise_for_status()
            out: list[int] = r.json()["output_ids"]
            return out

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def run_hf(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return [row[width:].tolist() for row in out]


def same_until_eos(ours: list[int], theirs: list[int], eos: set[int]) -> bool:
    """Whether two greedy outputs agree up to our first EOS: past it they differ by design
    (`ignore_eos` keeps sampling EOS, HF's `min_new_tokens` forbids it)."""
    k = next((i for i, t in enumerate(ours) if t in eos), len(ours))
    return ours[:k] == theirs[:k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8,32")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from omniloop.inference.llama import LlamaConfig
    from omniloop.inference.models import resolve_model

    began = time.perf_counter()
    load_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    max_context = max(len(p) for p in prompts) + args.new_tokens + 8
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    eos = set(LlamaConfig.from_folder(folder).eos_token_ids)

    proc, url = start_engine(args.model, args.threads, max_context)
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    agree: dict[str, int] = {}
    try:
        asyncio.run(run_ours(url, prompts[:2], 4))  # warm-up: first forward, HTTP pools
        run_hf(hf, prompts[:2], 4, pad_id)
        for c in levels:
            batch = [prompts[i % len(prompts)] for i in range(c)]
            cpu_server, cpu_client, t0 = cpu_seconds_of(proc.pid), time.process_time(), time.time()
            our_tokens = asyncio.run(run_ours(url, batch, args.new_tokens))
            wall = time.time() - t0
            generated = sum(len(t) for t in our_tokens)
            assert generated == c * args.new_tokens, generated
            ours[str(c)] = {
                "tok_s": round(generated / wall, 1),
                "wall_s": round(wall, 2),
                "cpu_s_engine": round(cpu_seconds_of(proc.pid) - cpu_server, 2),
                "cpu_s_client": round(time.process_time() - cpu_client, 2),
            }
            cpu, t0 = time.process_time(), time.time()
            hf_tokens = run_hf(hf, batch, args.new_tokens, pad_id)
            wall = time.time() - t0
            theirs[str(c)] = {
                "tok_s": round(c * args.new_tokens / wall, 1),
                "wall_s": round(wall, 2),
                "cpu_s": round(time.process_time() - cpu, 2),
            }
            agree[str(c)] = sum(
                same_until_eos(a, b, eos) for a, b in zip(our_tokens, hf_tokens, strict=True)
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    def ratio(c: int) -> float | None:
        if str(c) not in ours:
            return None
        return round(ours[str(c)]["tok_s"] / theirs[str(c)]["tok_s"], 2)

    print(
        json.dumps(
            {
                "bench": "engine_cpu",
                "model": args.model,
                "torch_threads": {"engine": args.threads, "hf": args.threads},
                "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
                "cores": len(os.sched_getaffinity(0)),
                "new_tokens": args.new_tokens,
                "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
                "ours": ours,
                "hf_generate": theirs,
                "ratio_1": ratio(1),
                "ratio_8": ratio(8),
                "ratio_32": ratio(32),
                "greedy_equal_to_hf_until_eos": agree,
                "loadavg_start": [round(x, 2) for x in load_start],
                "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                "duration_s": round(time.perf_counter() - began, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
