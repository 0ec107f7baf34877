"""Our whole GRPO step beside TRL's `GRPOTrainer`: same task, model, batch, in one invocation.

Both sides train SmolLM2-135M-Instruct (fp32, CPU, the same local weights `model: smollm2`
resolves to) on the calculator example (`examples/calculator`) for the same number of optimizer
steps, one after the other: 8 prompts × 4 samples per step (the first `8 × steps` tasks of
`tasks.jsonl`, in file order), the example's two-turn episode (the `python` call prefilled up to
the end of the expression, the tool's result as a tool message, the answer turn prefilled with
`The answer is `), the same stop strings and per-turn token budget, the exact-answer reward, AdamW
with the example's settings, a PPO-clipped token-mean GRPO loss without KL, one torch thread per
process.

- Ours: `omniloop run examples/calculator/train.yaml` in a child process, all roles as Ray Serve
  services, bwrap sandboxes, `max_staleness=1` as in the example (the next step's rollout runs
  while the trainer works), then, unless `--no-on-policy`, again with `max_staleness=0`
  (strictly on-policy, as TRL trains; reported as `ours_on_policy_*`).
- TRL: a pinned `trl` is installed by this script into its own venv (`~/.cache/omniloop/bench/
  trl-venv`, reused when its pins match) beside the same torch, transformers and accelerate
  versions as `.venv`; this file then runs there as `--trl-child`. GRPOTrainer's own tool loop
  (`tools=`) cannot express the example's prefills (it renders every prompt through the chat
  template and parses calls from the completion alone), so the episode is TRL's `rollout_func`:
  the trainer's model samples with the trainer's `GenerationConfig` (Hugging Face `generate`,
  batched, as TRL's transformers path does) plus the stop strings, the call runs in a `python3`
  subprocess, and the tool's text and the answer prefill go into the completion with
  `env_mask` 0, as TRL's tool loop masks tool output. Everything else (advantages, loss,
  optimizer, scheduler, micro-batching) is GRPOTrainer's.

Measured per side: steps per hour from the seconds per optimizer step after the first
`WARMUP_STEPS` (ours: the run's `perf/step_seconds`; TRL: the time between the ends of
consecutive optimizer steps, generation included), the mean reward of the last step (32
episodes; per-step rewards are reported too), the reward of its final weights on held-out
tasks (`--eval-tasks`, the 32 tasks of the file after the trained ones, each sampled 4 times as
in training: ours with `omniloop rollout` on the run's last checkpoint, TRL with its episode
function on the trained model), and the peak of the summed RSS of the side's
whole process tree (the launched process and all its descendants: for ours the driver, Ray's
daemons, every Serve replica, the engine and the sandboxes; for TRL the one Python process and
its tool subprocesses), sampled every `SAMPLE_S` seconds. RSS counts a page shared by several
processes (libraries, torch) in each of them, so the sum overstates what many processes use
together; the sum of the proportional set sizes (PSS, each shared page split between its users)
is reported beside it.

Prints ONE JSON line: `ours_steps_per_hour`, `trl_steps_per_hour`, `speedup` (ours / TRL),
`ours_reward`, `trl_reward`, `ours_eval_reward`, `trl_eval_reward`, `ours_peak_gb`,
`trl_peak_gb`, `memory_ratio` (ours / TRL), the same with `_pss_`, the `ours_on_policy_*`
counterparts, `eval_episodes`, per-step seconds, rollout seconds and rewards
of each side, wall times, `steps`, `trl_version`, `cpus`, `load_avg_1m`. Progress goes to
stderr. The targets (≥ 4× TRL's steps per hour, a reward at least TRL's after the same steps,
≤ half its peak memory) are judged by the reader, not asserted: the result is printed either way.
A step's reward is that of the weights that sampled it, which at `max_staleness=1` are one step
older than on-policy; the held-out reward compares the weights each side ends with.

    .venv/bin/python bench/vs_trl.py [--steps 4] [--staleness 1] [--no-on-policy]
                                     [--eval-tasks 32] [--trl-version 1.16.0]
                                     [--torch-index URL]

About 16 minutes with the default 4 steps on 2 cores. The first invocation also installs the
TRL venv (~40 s with the torch wheel on disk: torch resolves through pip's own configuration;
`--torch-index URL` adds an index for the CPU build elsewhere).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "calculator"
TRL_VENV = Path.home() / ".cache" / "omniloop" / "bench" / "trl-venv"
TRL_VERSION = "1.16.0"  # the version verified on this machine kind (ENVIRONMENT.md)
# The first step of either side pays for first compilations and, for ours, a rollout that no
# training overlaps; the later steps are the steady state.
WARMUP_STEPS = 1
SAMPLE_S = 0.5
PSS_EVERY = 4
TASKS_PER_STEP = 8
SAMPLES_PER_TASK = 4
MICRO_BATCH = 4  # the example's `trainer.micro_batch_size`
EVAL_TASKS = 32
"""Tasks after the trained ones that each side's final weights are evaluated on, each sampled
`SAMPLES_PER_TASK` times (`--eval-tasks`)."""

# The calculator example's episode, copied here because the TRL side runs in a venv without
# omniloop (checked against `examples/calculator/agent.py` and `train_agent.py` at start-up).
SYSTEM_PROMPT = (
    "You are a careful calculator. Use the python tool to compute, then answer with the number."
)
PREFILL = '<tool_call>\n{"name": "python", "arguments": {"code": "print('
ANSWER_PREFILL = "The answer is "
STOP = ["</tool_call>", "}}", "\n"]
NUMBER = re.compile(r"-?\d[\d,]*")


def log(message: str) -> None:
    """Progress on stderr (stdout carries only the JSON result)."""
    print(f"[vs_trl {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def exact_answer(answer: str, response: str) -> float:
    """The example's reward: 1.0 when the last number of the response equals the answer."""
    numbers = NUMBER.findall(response)
    return float(bool(numbers) and numbers[-1].replace(",", "") == str(answer))


class TreeMemory:
    """Peak summed RSS (and PSS) of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_procs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        samples = 0
        while not self._stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            # RSS is cheap to read (statm); PSS needs smaps (~2 ms a process), so it is read
            # every PSS_EVERY samples only, to keep the sampler's own CPU use negligible.
            with_pss = samples % PSS_EVERY == 0
            rss = pss = 0
            for proc in procs:
                try:
                    if with_pss:
                        full = proc.memory_full_info()
                        rss, pss = rss + full.rss, pss + getattr(full, "pss", 0)
                    else:
                        rss += proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue  # exited between the listing and the read
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            self.peak_procs = max(self.peak_procs, len(procs))
            samples += 1
            self._stop.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def steady_seconds(step_seconds: list[float]) -> float:
    """Mean seconds per step after the warm-up steps (all of them when there are no others)."""
    kept = step_seconds[WARMUP_STEPS:] or step_seconds
    return statistics.fmean(kept)


def task_split(steps: int, eval_tasks: int) -> tuple[list[str], list[str]]:
    """The example's task lines: those `steps` steps train on (in file order, as both sides
    take them), and the `eval_tasks` after them, held out for the final weights."""
    lines = (EXAMPLE / "tasks.jsonl").read_text().splitlines()
    trained = steps * TASKS_PER_STEP
    return lines[:trained], lines[trained : trained + eval_tasks]


# --- ours -------------------------------------------------------------------------------------


def run_ours(steps: int, staleness: int, max_new_tokens: int, work: Path) -> dict[str, Any]:
    """Train with `omniloop run` in a child process; step times and rewards from its metrics."""
    run_dir = work / f"ours-staleness{staleness}"
    overrides = [
        f"run_dir={run_dir}",
        f"steps={steps}",
        f"tasks_per_step={TASKS_PER_STEP}",
        f"rollout.samples_per_task={SAMPLES_PER_TASK}",
        f"rollout.sampling.max_new_tokens={max_new_tokens}",
        f"max_staleness={staleness}",
        # The bench's own database and no checkpoint inside the measured steps: the comparison
        # is of training, and TRL saves nothing either (`save_strategy="no"`).
        f"database=sqlite:///{work / 'omniloop.db'}",
        f"checkpoint_every={steps + 1}",
        "tensorboard=false",
    ]
    command = [str(ROOT / ".venv" / "bin" / "omniloop"), "run", str(EXAMPLE / "train.yaml")]
    log(f"ours: omniloop run ... {' '.join(overrides)}")
    started = time.monotonic()
    with (work / f"ours-staleness{staleness}.log").open("w") as out:
        proc = subprocess.Popen([*command, *overrides], cwd=ROOT, stdout=out, stderr=out)
        memory = TreeMemory(proc.pid)
        metrics_path = run_dir / "metrics.jsonl"
        reported = 0
        while proc.poll() is None:
            time.sleep(1.0)
            done = _read_jsonl(metrics_path)
            for line in done[reported:]:
                log(
                    f"ours step {int(line['step']) + 1}/{steps}: "
                    f"{line['perf/step_seconds']:.1f} s, reward {line['reward/mean']:.3f}"
                )
            reported = len(done)
        memory.stop()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"omniloop run failed ({proc.returncode}):\n{_tail(Path(out.name))}")
    metrics = _read_jsonl(metrics_path)
    if len(metrics) != steps:
        raise SystemExit(f"omniloop run logged {len(metrics)} steps, not {steps}")
    step_seconds = [float(m["perf/step_seconds"]) for m in metrics]
    return {
        "step_seconds": step_seconds,
        "rewards": [float(m["reward/mean"]) for m in metrics],
        "train_seconds": [float(m["perf/train_seconds"]) for m in metrics],
        "rollout_seconds": [float(m["perf/rollout_seconds"]) for m in metrics],
        "errors": sum(int(m["episodes/errors"]) for m in metrics),
        # A role that failed and recovered (the run goes on) makes its step slow: say so.
        "faults": sum(int(m.get("faults/count", 0)) for m in metrics),
        "wall_s": wall,
        "peak_rss": memory.peak_rss,
        "peak_pss": memory.peak_pss,
        "peak_procs": memory.peak_procs,
    }


def _tail(path: Path, lines: int = 30) -> str:
    # The work folder goes away on exit: show the end of the log instead of its path.
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def check_example() -> None:
    """Fail loudly if the example's episode drifted from the copy the TRL side uses."""
    sys.path.insert(0, str(EXAMPLE))
    import agent
    import yaml

    config = yaml.safe_load((EXAMPLE / "train.yaml").read_text())
    sampling = config["rollout"]["sampling"]
    expected = (SYSTEM_PROMPT, PREFILL, STOP)
    found = (agent.SYSTEM_PROMPT, agent.PREFILL, sampling["stop"])
    if found != expected or 'ANSWER_PREFILL = "The answer is "' not in (
        (EXAMPLE / "train_agent.py").read_text()
    ):
        raise SystemExit(f"the calculator example changed: update bench/vs_trl.py ({found})")


# --- TRL: its venv ----------------------------------------------------------------------------


def trl_venv(trl_version: str, torch_index: str | None) -> Path:
    """The venv with TRL and our torch/transformers/accelerate versions; made once, reused."""
    from importlib.metadata import version

    pins = [
        f"torch=={version('torch')}",
        f"transformers=={version('transformers')}",
        f"accelerate=={version('accelerate')}",
        f"trl=={trl_version}",
        "psutil",
    ]
    python = TRL_VENV / "bin" / "python"
    stamp = TRL_VENV / "pins.txt"
    if python.exists() and stamp.exists() and stamp.read_text().split() == pins:
        log(f"TRL venv reused: {TRL_VENV}")
        return python
    log(f"creating the TRL venv {TRL_VENV}: {' '.join(pins)}")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRL_VENV)], check=True)
    extra = ["--extra-index-url", torch_index] if torch_index else []
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *extra, *pins],
        capture_output=True,
        text=True,
    )
    # pip warns once per configured local index folder a package is missing from: noise.
    for line in (done.stdout + done.stderr).splitlines():
        if not line.startswith("WARNING: Location"):
            log(f"pip: {line}")
    if done.returncode != 0:
        raise SystemExit(f"installing {' '.join(pins)} failed ({done.returncode})")
    stamp.write_text("\n".join(pins) + "\n")
    return python


def run_trl(
    python: Path,
    steps: int,
    max_new_tokens: int,
    model: Path,
    seed: int,
    eval_tasks: int,
    work: Path,
) -> dict[str, Any]:
    """Run this file as `--trl-child` in the TRL venv; read its result file."""
    result_path = work / "trl-result.json"
    command = [
        str(python),
        str(Path(__file__).resolve()),
        "--trl-child",
        f"--steps={steps}",
        f"--max-new-tokens={max_new_tokens}",
        f"--model={model}",
        f"--seed={seed}",
        f"--eval-tasks={eval_tasks}",
        f"--out={result_path}",
    ]
    env = {
        **os.environ,
        # One thread per process, as ours (`trainer_threads: 1`, `engine.threads: 1`).
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "WANDB_DISABLED": "true",
    }
    log("TRL: GRPOTrainer in its venv")
    started = time.monotonic()
    with (work / "trl.log").open("w") as out:
        # The child's progress lines go to our stderr; library chatter to the log file.
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=subprocess.PIPE)
        memory = TreeMemory(proc.pid)
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode(errors="replace")
            if line.startswith("[vs_trl"):
                sys.stderr.write(line)
            else:
                out.write(line)
        proc.wait()
        memory.stop()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"the TRL run failed ({proc.returncode}):\n{_tail(work / 'trl.log')}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    result.update(
        wall_s=wall,
        peak_rss=memory.peak_rss,
        peak_pss=memory.peak_pss,
        peak_procs=memory.peak_procs,
    )
    return result


def final_weights(run_dir: Path, out: Path) -> Path:
    """A Hugging Face folder of the run's newest checkpoint (the weights after its last step):
    the base model's files with the checkpoint's tensors loaded (tied embeddings included)."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from omniloop.inference.models import resolve_model

    base = resolve_model("smollm2")
    newest = max((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(
        load_file(newest / "model.safetensors"), strict=False
    )
    # A tied output layer is saved once, under either name.
    if unexpected or set(missing) - {"lm_head.weight", "model.embed_tokens.weight"}:
        raise SystemExit(f"{newest}: not SmolLM2's weights ({missing=}, {unexpected=})")
    model.save_pretrained(out)
    for name in base.iterdir():
        if name.suffix != ".safetensors" and not (out / name.name).exists():
            shutil.copy(name, out / name.name)
    return out


def evaluate_ours(run_dir: Path, tasks: Path, max_new_tokens: int, work: Path) -> dict[str, Any]:
    """The run's final weights on the evaluation tasks: `omniloop rollout` with the example's
    episode, sandbox and sampling, `SAMPLES_PER_TASK` samples of each task."""
    import yaml

    folder = final_weights(run_dir, work / f"{run_dir.name}-final")
    rollout = yaml.safe_load((EXAMPLE / "train.yaml").read_text())["rollout"]
    rollout.update(
        tasks=str(tasks),
        num_tasks=None,
        agent=str(EXAMPLE / rollout["agent"]),
        rewards=[str(EXAMPLE / r) for r in rollout["rewards"]],
        samples_per_task=SAMPLES_PER_TASK,
        output=str(work / f"{run_dir.name}-eval.jsonl"),
    )
    rollout["engine"]["model"] = str(folder)
    rollout["sampling"]["max_new_tokens"] = max_new_tokens
    config = work / f"{run_dir.name}-eval.yaml"
    config.write_text(yaml.safe_dump(rollout))
    command = [str(ROOT / ".venv" / "bin" / "omniloop"), "rollout", str(config)]
    log(f"ours: evaluating the final weights of {run_dir.name} on {tasks.name}")
    with (work / f"{run_dir.name}-eval.log").open("w") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=out, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the evaluation failed:\n{_tail(Path(out.name))}")
    episodes = _read_jsonl(Path(rollout["output"]))
    scored = [e["reward"] for e in episodes if e["reward"] is not None]
    return {"eval_reward": statistics.fmean(scored), "eval_episodes": len(scored)}


# --- TRL: the child, run inside the TRL venv -------------------------------------------------


def trl_child(args: argparse.Namespace) -> None:
    """GRPOTrainer on the calculator episode; writes step seconds and rewards to `args.out`."""
    import copy

    import torch

    torch.set_num_threads(1)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import unwrap_model_for_generation

    started = time.monotonic()
    trained_lines, held_out_lines = task_split(args.steps, args.eval_tasks)
    tasks = [json.loads(line) for line in trained_lines]
    held_out = [json.loads(line) for line in held_out_lines]
    by_prompt = {task["prompt"]: task for task in [*tasks, *held_out]}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    python3 = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable

    def render(messages: list[dict[str, str]]) -> str:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return str(text)

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens, skip_special_tokens=True))

    def sample(trainer: Any, prompts: list[list[int]]) -> list[list[int]]:
        """One turn for each prompt: TRL's sampling settings, the example's stop strings."""
        config = copy.deepcopy(trainer.generation_config)
        config.max_new_tokens = args.max_new_tokens
        config.stop_strings = STOP
        width = max(len(p) for p in prompts)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        # As GRPOTrainer's own transformers path samples (`_generate_single_turn`).
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                generation_kwargs=trainer.generation_kwargs,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
        ):
            out = unwrapped.generate(
                input_ids=ids, attention_mask=mask, generation_config=config, tokenizer=tokenizer
            )
        return [_cut(row[width:].tolist()) for row in out]

    def _cut(tokens: list[int]) -> list[int]:
        # A finished row is padded: keep up to its own EOS, or up to the token that completed a
        # stop string (what the model sampled, as an engine that stops on a string returns).
        for k in range(1, len(tokens) + 1):
            if tokens[k - 1] == eos:
                return tokens[:k]
            if any(s in tokenizer.decode(tokens[:k]) for s in STOP):
                return tokens[:k]
        return tokens

    def run_call(text: str) -> str | None:
        """The `python` call of a turn, run as the example's sandbox would; None if unparsable."""
        start = text.find("<tool_call>")
        if start < 0:
            return None
        body = text[start + len("<tool_call>") :].split("</tool_call>")[0].strip()
        try:
            call, _ = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") != "python":
            return None
        arguments = call.get("arguments")
        if not isinstance(arguments, dict) or set(arguments) != {"code"}:
            return None
        code = arguments["code"]
        if not isinstance(code, str):
            return None
        try:
            done = subprocess.run(
                [python3, "-"], input=code, capture_output=True, text=True, timeout=10
            )
        except subprocess.TimeoutExpired:
            return "[timed out after 10.0s]"
        parts = [done.stdout, done.stderr]
        if done.returncode != 0:
            parts.append(f"[exit code {done.returncode}]")
        return "\n".join(p for p in parts if p)

    def rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
        """The example's two-turn episode for each prompt, `num_generations` times."""
        began = time.monotonic()
        repeat = 1 if len(prompts) == trainer.args.generation_batch_size else SAMPLES_PER_TASK
        out = episodes([p for p in prompts for _ in range(repeat)], trainer)
        rollout_seconds.append(time.monotonic() - began)
        return out

    def episodes(prompts: list[str], trainer: Any) -> dict[str, Any]:
        """The example's two-turn episode for each prompt."""
        opening = [
            render([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p}])
            for p in prompts
        ]
        prefills = [PREFILL + str(by_prompt[p]["metadata"]["expression"]) for p in prompts]
        prompt_ids = [
            tokenizer(o, add_special_tokens=False).input_ids
            + tokenizer(f, add_special_tokens=False).input_ids
            for o, f in zip(opening, prefills, strict=True)
        ]
        first = sample(trainer, prompt_ids)
        completions = [list(c) for c in first]
        masks = [[1] * len(c) for c in first]
        responses = []
        second: list[int] = []
        for i, turn in enumerate(first):
            call_text = prefills[i] + decode(turn)
            responses.append(call_text)
            output = run_call(call_text)
            if output is None:
                continue
            # The tool message and the answer prefill as the chat template renders them.
            history = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": prompts[i]},
                {"role": "assistant", "content": call_text},
                {"role": "tool", "content": output},
            ]
            glue = render(history)[len(opening[i]) + len(call_text) :]
            if turn and turn[-1] == eos:
                glue = glue.removeprefix("<|im_end|>")
            glue_ids = tokenizer(glue + ANSWER_PREFILL, add_special_tokens=False).input_ids
            completions[i] += glue_ids
            masks[i] += [0] * len(glue_ids)
            second.append(i)
        if second:
            answers = sample(trainer, [prompt_ids[i] + completions[i] for i in second])
            for i, turn in zip(second, answers, strict=True):
                completions[i] += turn
                masks[i] += [1] * len(turn)
                responses[i] = ANSWER_PREFILL + decode(turn)
        limit = trainer.max_completion_length
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [c[:limit] for c in completions],
            "logprobs": None,
            "env_mask": [m[:limit] for m in masks],
            "response": responses,
        }

    rewards: list[float] = []
    rollout_seconds: list[float] = []

    def exact_answer_reward(
        prompts: list[str], completions: list[str], response: list[str], **_: Any
    ) -> list[float]:
        scores = [
            exact_answer(by_prompt[p]["answer"], r) for p, r in zip(prompts, response, strict=True)
        ]
        rewards.append(statistics.fmean(scores))
        return scores

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            ends.append(time.monotonic())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            ends.append(time.monotonic())
            seconds = ends[-1] - ends[-2]
            reward = rewards[-1] if rewards else float("nan")
            log(f"TRL step {len(ends) - 1}/{args.steps}: {seconds:.1f} s, reward {reward:.3f}")

    config = GRPOConfig(
        output_dir=str(Path.cwd() / "trl-out"),
        max_steps=args.steps,
        # 8 prompts × 4 generations per optimizer step, in micro-batches of 4 as ours.
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=TASKS_PER_STEP * SAMPLES_PER_TASK // MICRO_BATCH,
        num_generations=SAMPLES_PER_TASK,
        max_completion_length=128,
        shuffle_dataset=False,  # tasks in file order, as ours takes them
        # The example's trainer settings (AdamW and its schedule are passed below): gradient
        # norm clipped to 1; PPO clip 0.2, no KL, token-mean over the batch (`dapo`).
        learning_rate=2e-5,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        gradient_checkpointing=False,  # TRL's default is True; ours keeps activations
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=args.seed,
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    # Ours warms up linearly from lr/2 at the first step to lr at the second, then stays; the
    # Hugging Face schedule `constant_with_warmup` would start at 0, so the same AdamW and
    # schedule are handed to the trainer instead.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=2e-5, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_answer_reward],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": t["prompt"]} for t in tasks]),
        processing_class=tokenizer,
        rollout_func=rollout,
        callbacks=[StepClock()],
        optimizers=(optimizer, schedule),
    )
    setup = time.monotonic() - started
    trainer.train()
    step_seconds = [b - a for a, b in itertools.pairwise(ends)]
    # The final weights on the held-out tasks, sampled as in training.
    eval_reward = None
    if held_out:
        log(f"TRL: evaluating the final weights on {len(held_out)} held-out tasks")
        prompts = [t["prompt"] for t in held_out for _ in range(SAMPLES_PER_TASK)]
        responses = episodes(prompts, trainer)["response"]
        eval_reward = statistics.fmean(
            exact_answer(by_prompt[p]["answer"], r) for p, r in zip(prompts, responses, strict=True)
        )
    result = {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "step_seconds": step_seconds,
        "rewards": rewards,
        "rollout_seconds": rollout_seconds,
        "setup_s": setup,
        "cpu_s": time.process_time(),
        "eval_reward": eval_reward,
        "eval_episodes": len(held_out) * SAMPLES_PER_TASK,
    }
    Path(args.out).write_text(json.dumps(result))


# --- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps, each side")
    parser.add_argument("--staleness", type=int, default=1, help="ours: max_staleness")
    parser.add_argument(
        "--on-policy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train ours with max_staleness=0 (reported as ours_on_policy_*)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=12, help="per turn, both sides")
    parser.add_argument("--trl-version", default=TRL_VERSION)
    parser.add_argument("--torch-index", default=None, help="extra index for the torch wheel")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-tasks",
        type=int,
        default=EVAL_TASKS,
        help="held-out tasks each side's final weights are evaluated on (0: none)",
    )
    parser.add_argument("--skip-ours", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(args)
        return
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"--steps must exceed the {WARMUP_STEPS} warm-up step(s)")
    if args.max_new_tokens > 128:
        raise SystemExit("--max-new-tokens is at most 128")
    check_example()
    from omniloop.inference.models import resolve_model

    model = resolve_model("smollm2")
    python = trl_venv(args.trl_version, args.torch_index)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        work = Path(tmp)
        held_out = work / "eval-tasks.jsonl"
        held_out.write_text("".join(f"{t}\n" for t in task_split(args.steps, args.eval_tasks)[1]))
        if not args.skip_ours:
            runs["ours"] = run_ours(args.steps, args.staleness, args.max_new_tokens, work)
            if args.on_policy and args.staleness != 0:
                runs["ours_on_policy"] = run_ours(args.steps, 0, args.max_new_tokens, work)
            if args.eval_tasks:
                for name in [n for n in runs if n.startswith("ours")]:
                    run_dir = work / f"ours-staleness{args.staleness if name == 'ours' else 0}"
                    runs[name].update(evaluate_ours(run_dir, held_out, args.max_new_tokens, work))
        runs["trl"] = run_trl(
            python, args.steps, args.max_new_tokens, model, args.seed, args.eval_tasks, work
        )
    gb = 1024**3
    per_hour = {name: 3600 / steady_seconds(run["step_seconds"]) for name, run in runs.items()}
    result: dict[str, Any] = {"bench": "vs_trl"}
    for name, run in runs.items():
        result[f"{name}_steps_per_hour"] = round(per_hour[name], 1)
        result[f"{name}_reward"] = round(run["rewards"][-1], 3)
        result[f"{name}_peak_gb"] = round(run["peak_rss"] / gb, 2)
        if run.get("eval_reward") is not None:
            result[f"{name}_eval_reward"] = round(run["eval_reward"], 3)
    if "ours" in runs:
        ours, trl = runs["ours"], runs["trl"]
        result.update(
            speedup=round(per_hour["ours"] / per_hour["trl"], 2),
            memory_ratio=round(ours["peak_rss"] / trl["peak_rss"], 2),
            memory_ratio_pss=round(ours["peak_pss"] / trl["peak_pss"], 2),
            ours_max_staleness=args.staleness,
        )
    for name, run in runs.items():
        result.update(
            {
                f"{name}_peak_pss_gb": round(run["peak_pss"] / gb, 2),
                f"{name}_step_seconds": [round(s, 1) for s in run["step_seconds"]],
                f"{name}_rollout_seconds": [round(s, 1) for s in run["rollout_seconds"]],
                f"{name}_rewards": [round(r, 3) for r in run["rewards"]],
                f"{name}_mean_reward": round(statistics.fmean(run["rewards"]), 3),
                f"{name}_processes": run["peak_procs"],
                f"{name}_wall_s": round(run["wall_s"], 1),
            }
        )
        if name == "trl":
            result.update(trl_setup_s=round(run["setup_s"], 1), trl_cpu_s=round(run["cpu_s"], 1))
        if "train_seconds" in run:
            result[f"{name}_train_seconds"] = [round(s, 1) for s in run["train_seconds"]]
            result[f"{name}_episode_errors"] = run["errors"]
            result[f"{name}_faults"] = run["faults"]
    result.update(
        steps=args.steps,
        eval_episodes=args.eval_tasks * SAMPLES_PER_TASK,
        warmup_steps_excluded=WARMUP_STEPS,
        max_new_tokens_per_turn=args.max_new_tokens,
        trl_version=runs["trl"]["trl_version"],
        transformers_version=runs["trl"]["transformers_version"],
        torch_version=runs["trl"]["torch_version"],
        cpus=os.cpu_count(),
        load_avg_1m=round(os.getloadavg()[0], 2),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
