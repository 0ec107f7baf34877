"""Where a training run's metrics go: the console, `metrics.jsonl`, and TensorBoard.

Keys are namespaced (`reward/…`, `perf/…`, `staleness/…`, `actor/…`, `episodes/…`); every value
is a float. One call to `MetricsSink.log` per trained step writes one JSON line
`{"step": k, "time": unix_seconds, **metrics}`, one TensorBoard scalar per key at global step
`k`, and one summary line on the console.

The step-level keys the controller reports (see `step_metrics` for the rollout-derived ones):

- `reward/mean`, `reward/std`: over the step's scored trajectories; infrastructure failures are
  left out (DESIGN.md §2), so they never pull the mean towards zero.
- `response_length/mean`: tokens after the prompt, per trajectory.
- `episodes/count`, `episodes/errors`: trajectories of the step, and how many of them ended in
  an infrastructure failure (excluded from training); `episodes/stop/{reason}` per stop reason.
- `kl`: KL(sampling policy ‖ trained policy) over the sampled tokens, as the mean of
  `log p_engine - log p_trainer` before the update (the k1 estimate; the actor passes the
  engine's logprobs as PPO's pi_old, so this is the trainer's `actor/ppo_kl`). It grows with
  staleness and with engine/trainer numerical mismatch, and can dip below 0 by noise. The KL to
  the reference policy is `actor/kl` when `trainer.loss.kl_coef > 0`.
- `entropy`: mean entropy of the trained policy over sampled tokens (`actor/entropy`).
- `staleness/max`, `staleness/mean`, `staleness/refused`, `staleness/count/{s}`: the trainer's
  staleness histogram for the step (`StalenessGate.metrics`).
- `perf/step_seconds`: wall time of the step in the control loop (from the end of the previous
  step); `perf/tokens_per_second`: tokens the policy sampled in the step per second of it;
  `perf/rollout_seconds`: from the first episode of the step starting to its partition being
  closed; `perf/train_seconds`: the optimizer step itself; `perf/train_wait_seconds`: how long
  the actor waited for the step's last micro-batch; `perf/sync_seconds`: weight sync.
- `actor/…`: what the trainer backend reports for its step (loss, grad norm, clip fractions…).
- `reference/…`, `teacher/…` (the scoring roles, when the run has them): `rows` scored,
  `reverse_kl` (mean over the sampled tokens of the sampling logprob minus the frozen model's;
  for the teacher, what on-policy distillation lowers) and `perf/{role}_seconds`.
- `critic/…` (with `trainer.critic`): `rows`, `value_loss`, `grad_norm`, `values_mean` (the
  values the step was scored with), `returns_mean`, `explained_variance`; `perf/critic_seconds`.
- `rollout/extra_groups`, `rollout/dropped_groups`, `actor/dropped_uniform_samples`: dynamic
  sampling's extra groups, the groups of equal rewards it left out, and their samples.
- Counters the episodes report (`tool_calls/…`, `media/…`, `gateway/…`) are summed over the
  step; `gateway/prefix_stability` is the step's stable calls over its resent calls.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from omniloop.platform.control.controller import EpisodeSummary


CONSOLE_KEYS: tuple[tuple[str, str, str], ...] = (
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/std", "±", "{:.3f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("kl", "kl", "{:.4f}"),
    ("entropy", "ent", "{:.3f}"),
    ("staleness/max", "stale", "{:.0f}"),
    ("episodes/errors", "err", "{:.0f}"),
    ("perf/step_seconds", "step", "{:.1f}s"),
    ("perf/rollout_seconds", "rollout", "{:.1f}s"),
    ("perf/train_seconds", "train", "{:.1f}s"),
)
"""(key, label, format) of the values shown on the console line of each step."""


def step_metrics(episodes: Sequence[EpisodeSummary]) -> dict[str, float]:
    """Reward, length, error and stop-reason metrics of one step's episodes."""
    scored = [float(e.reward) for e in episodes if e.reward is not None and not e.infra_failure]
    n = len(episodes)
    mean = sum(scored) / len(scored) if scored else math.nan
    var = sum((r - mean) ** 2 for r in scored) / len(scored) if scored else math.nan
    out: dict[str, float] = {
        "episodes/count": float(n),
        "episodes/errors": float(sum(e.infra_failure for e in episodes)),
        "reward/mean": mean,
        "reward/std": math.sqrt(var),
        "response_length/mean": sum(e.response_length for e in episodes) / n if n else 0.0,
        "turns/mean": sum(e.turns for e in episodes) / n if n else 0.0,
        "perf/sampled_tokens": float(sum(e.sampled_tokens for e in episodes)),
    }
    stops: dict[str, int] = {}
    for e in episodes:
        stops[e.stop_reason] = stops.get(e.stop_reason, 0) + 1
    out.update({f"episodes/stop/{reason}": float(count) for reason, count in stops.items()})
    totals: dict[str, float] = {}
    for e in episodes:
        for key, value in e.metrics.items():
            totals[key] = totals.get(key, 0.0) + value
    out.update(totals)
    if totals.get("gateway/resent_calls"):
        out["gateway/prefix_stability"] = (
            totals.get("gateway/stable_calls", 0.0) / totals["gateway/resent_calls"]
        )
    return out


class MetricsSink:
    """Writes each step's metrics to the console, `RUN_DIR/metrics.jsonl` and TensorBoard.

    TensorBoard event files go to `RUN_DIR/tensorboard/`; when the `tensorboard` package is not
    installed the sink says so once and writes the other two. Use as a context manager or call
    `close()`.
    """

    def __init__(self, run_dir: Path, console: Console, *, tensorboard: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._console = console
        self._stream = self.path.open("a")
        self._writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                console.print(
                    "[yellow]tensorboard is not installed; metrics go to metrics.jsonl only "
                    "(pip install tensorboard==2.21.0)[/yellow]"
                )
            else:
                self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def log(self, step: int, metrics: Mapping[str, float], *, total_steps: int) -> None:
        """Record the metrics of trained step `step` (0-based) everywhere."""
        record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        # NaN (e.g. the reward mean of a step whose episodes all failed) is written as null, so
        # the file stays strict JSON.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}  # fmt: skip
        self._stream.write(json.dumps(clean) + "\n")
        self._stream.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(key, float(value), global_step=step)
            self._writer.flush()
        self._console.print(
            format_line(step, total_steps, metrics), highlight=False, soft_wrap=True
        )

    def close(self) -> None:
        """Flush and close the files (idempotent)."""
        if not self._stream.closed:
            self._stream.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def format_line(step: int, total_steps: int, metrics: Mapping[str, float]) -> str:
    """The console summary of one step: the `CONSOLE_KEYS` that are present."""
    parts = [f"step {step + 1}/{total_steps}"]
    for key, label, fmt in CONSOLE_KEYS:
        if key not in metrics:
            continue
        value = fmt.format(metrics[key])
        if label == "±":
            parts[-1] += f" ± {value}"
        else:
            parts.append(f"{label} {value}")
    return "  ".join(parts)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file a run leaves (`metrics.jsonl`, `trained.jsonl`,
    `faults.jsonl`, `trajectories/step_{k}.jsonl`), in order; blank lines are skipped."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_jsonl(path: Path, keep: int) -> int:
    """Drop the lines of a per-step JSONL file whose `step` is `>= keep`; return how many.

    Used on resume: steps after the last checkpoint are redone, so their records (written by
    the interrupted run) are rolled back with the weights they describe.
    """
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] < keep]
    path.write_text("".join(ln + "\n" for ln in kept))
    return len(lines) - len(kept)
