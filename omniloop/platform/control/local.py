"""The roles of a training run, run in this process behind the interfaces of `controller`.

Each role talks to the others only through the data plane (its own client, as a separate
service would have) and answers the controller's directives:

- `EpisodeRunner.run_group` (behind `step_rollout.StepRollout.generate(k)`): runs step `k`'s
  episodes and writes each trajectory to partition `k` as soon as it ends. The reward stage
  runs inside the episode (`run_episode` scores it with the configured rewards), so the
  rollout writes the `reward` field itself, right after the rollout fields. An infrastructure
  failure is written too, with reward NaN: it is part of the step's record, and every later
  stage recognises it by `meta.stop_reason`.
- `LocalAdvantage.compute(k)`: reads rewards as they arrive and, for each complete GRPO group,
  writes the `advantages` field (group-normalised or leave-one-out, per token).
- `LocalScorer.compute(k)`: a frozen model's logprobs for every row, micro-batch by
  micro-batch as rows arrive: the reference's `ref_logprobs` (with
  `trainer.reference=external`), the teacher's `teacher_logprobs` (with `trainer.teacher`).
- `LocalActor.train(k)`: streams the step's micro-batches as they become ready (with their
  `ref_logprobs` and `teacher_logprobs` too when those roles compute them), drops
  infrastructure failures and samples past the staleness bound (counted), and takes one
  optimizer step on the rest. Exactly-once: the data plane never hands an id to the actor twice,
  and the ids it handed out are part of the actor's checkpoint.
- Weights reach the engines through the DCS (`omniloop.platform.dcs`): the actor's
  `WeightCoordinator.publish(v)` returns once every engine serves `v`.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import math
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from omniloop.agents.base import Agent, Task
from omniloop.agents.chat import ChatFormat
from omniloop.agents.media import MediaResolver
from omniloop.errors import RoleLost
from omniloop.inference.base import Engine
from omniloop.inference.router import for_session
from omniloop.platform.control.components import episode_plan
from omniloop.platform.control.controller import EpisodeSummary, TrainReport, production_window
from omniloop.platform.control.episode import EpisodeSettings, SandboxProvider, run_episode
from omniloop.platform.control.run_config import RunConfig
from omniloop.platform.control.staleness import StalenessGate
from omniloop.platform.control.writer import EpisodeWriter
from omniloop.platform.data import MicroBatch
from omniloop.rewards import RewardFn
from omniloop.trainer.advantages import row_gae, with_teacher
from omniloop.trainer.backend import Supervised, TrainerBackend
from omniloop.trainer.batch import TrainBatch, TrainRow, estimate
from omniloop.trainer.config import AdvantageConfig, CriticConfig, OldPolicy, TeacherConfig
from omniloop.trainer.reference import ReferencePolicy
from omniloop.trajectory import INFRA_STOP_REASONS, trajectory_id

if TYPE_CHECKING:
    from omniloop.platform.data import DataPlane
    from omniloop.platform.store import AsyncStore

T = TypeVar("T")
log = logging.getLogger(__name__)

PLANS_KEPT = 16
"""Steps whose episode plans an `EpisodeRunner` keeps: at most `max_staleness + 1` steps run
at once; past 15, a step's plan may be built more than once."""

ADVANTAGE_FIELDS = ("reward", "loss_mask", "meta")
"""What the advantage stage reads."""
TRAIN_FIELDS = (
    "input_ids",
    "loss_mask",
    "rollout_logprobs",
    "weight_version",
    "prompt_length",
    "advantages",
    "multimodal",
    "meta",
)
"""What the actor reads: a row is ready for training once its advantages are written (and its
`ref_logprobs` and `teacher_logprobs`, when those roles write them: `train_fields`)."""
ScoringRole = Literal["reference", "teacher"]
"""A role that scores a step's rows under a frozen model (`LocalScorer`)."""
SCORER_FIELDS = ("input_ids", "loss_mask", "rollout_logprobs", "multimodal", "meta")
"""What a scoring stage (reference, teacher) reads."""


def uses_reference_role(config: RunConfig) -> bool:
    """Whether the run's KL reference is scored by a `reference` role (else there is none, or
    the actor's backend keeps a frozen copy of its own)."""
    return config.trainer.loss.kl_coef > 0 and config.trainer.reference == "external"


def scoring_roles(config: RunConfig) -> list[ScoringRole]:
    """The scoring roles `config`'s run has (`LocalScorer`)."""
    roles: list[ScoringRole] = []
    if uses_reference_role(config):
        roles.append("reference")
    if config.trainer.teacher is not None:
        roles.append("teacher")
    return roles


def scored_by(config: RunConfig, role: ScoringRole) -> str:
    """The frozen model of a scoring role: the run's base model, or the teacher."""
    if role == "teacher" and config.trainer.teacher is not None:
        return config.trainer.teacher.model
    return config.model


def train_fields(config: RunConfig) -> tuple[str, ...]:
    """The fields the actor of `config`'s run waits for."""
    fields: tuple[str, ...] = TRAIN_FIELDS
    if uses_reference_role(config):
        fields = (*fields, "ref_logprobs")
    if config.trainer.teacher is not None:
        fields = (*fields, "teacher_logprobs")
    if config.dynamic_sampling:
        fields = (*fields, "dropped")
    return fields


class TorchThread:
    """One thread of its own for a role's torch work. OpenMP's thread count is a setting of
    the thread that makes it, so `trainer_threads` holds only in the thread it was set in;
    `nice`, when given, is the thread's scheduling priority (`trainer_nice`)."""

    def __init__(self, threads: int | None, name: str, nice: int | None = None) -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=name,
            initializer=_prepare_thread,
            initargs=(threads, nice, name),
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Let the thread end (after the work it has)."""
        self._executor.shutdown(wait=False)


EpisodeCallback = Callable[[int, int], None]
"""`(step, episodes)`: called when a step starts (with its episode count) and per episode."""


@asynccontextmanager
async def closing_stream(
    stream: AsyncIterator[MicroBatch],
) -> AsyncIterator[AsyncIterator[MicroBatch]]:
    """Close a reader at the end of the block, so that rows it fetched but never handed out
    return to the data plane at once (for the next reader of the step) instead of at GC."""
    try:
        yield stream
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


def step_tasks(tasks: Sequence[Task], step: int, per_step: int, extra: int = 0) -> list[Task]:
    """The tasks of rollout step `step`: the next `per_step` in file order, cycling; then
    `extra` more, those that follow (dynamic sampling's replacements, which may repeat tasks).

    The data position is the step: a resumed run meets exactly the tasks the interrupted one
    would have. Raises `ValueError` if a step would hold a task twice (duplicate episode ids).
    """
    if per_step > len(tasks):
        raise ValueError(f"tasks_per_step={per_step} but the task set holds only {len(tasks)}")
    start = step * per_step
    return [tasks[(start + i) % len(tasks)] for i in range(per_step + extra)]


def uniform_rewards(rewards: Sequence[float | None], valid: Sequence[bool]) -> bool:
    """Whether a group has nothing to learn from (dynamic sampling drops it): the rewards of its
    valid members are all equal, or it has none."""
    scored = [r for r, ok in zip(rewards, valid, strict=True) if ok and r is not None]
    return all(r == scored[0] for r in scored)


class EpisodeRunner:
    """Runs single episodes of a run and puts each where it belongs, so that whoever calls it
    (a `StepRollout` in this process, or a rollout replica) only hears back a summary.

    `run(step, index, attempt)` runs episode `index` of step `step`'s plan, writes its rollout
    fields and reward to partition `step`, appends it to `trajectories/step_{step}.jsonl` and
    records it in the run store (`EpisodeWriter`: episodes that end together are written
    together), and returns once it is written. Writes are keyed by trajectory id, which the
    attempt does not change. A re-run (`attempt` > 0) whose earlier attempt's row is in the
    data plane (its replica died after writing it, before it replied) is not run again: the
    earlier trajectory stands, since readers may have derived fields from it already.
    An episode whose work died with a replica of another role (its sandbox with the sandbox
    replica: the error's `failed_role`) is not written: `run` raises `RoleLost`, and the
    caller runs it again.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        tasks: Sequence[Task],
        agent: Agent,
        rewards: Sequence[RewardFn],
        chat: ChatFormat,
        engine: Engine,
        sandboxes: SandboxProvider,
        data: DataPlane,
        store: AsyncStore | None,
        media: MediaResolver | None = None,
    ) -> None:
        self._config = config
        self._media = media
        self._tasks = list(tasks)
        self._agent = agent
        self._rewards = list(rewards)
        self._chat = chat
        self._engine = engine
        self._sandboxes = sandboxes
        self._data = data
        self._limit = asyncio.Semaphore(config.rollout.concurrency)
        self._plans: OrderedDict[int, list[tuple[Task, EpisodeSettings]]] = OrderedDict()
        """Step -> its plan, the least recently asked for first (`plan`)."""
        self._out_dir = Path(config.rollout.output)
        self._out_dir.mkdir(parents=True, exist_ok=True)
        self._writer = EpisodeWriter(
            data, store, self._out_dir, run_id=config.run_id or "", agent=config.rollout.agent
        )

    def plan(self, step: int) -> list[tuple[Task, EpisodeSettings]]:
        """Step `step`'s episodes, in their stable order; after them, those of the extra groups
        dynamic sampling may run (`extra{j}/` in their episode and group ids). The plans of the
        latest `PLANS_KEPT` steps asked for are kept: every episode of a step looks its own
        up, and building the plan of a step of 512 episodes once per episode took 0.9 s of CPU."""
        plan = self._plans.get(step)
        if plan is None:
            plan = self._plans[step] = self._build_plan(step)
            while len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
        self._plans.move_to_end(step)
        return plan

    def _build_plan(self, step: int) -> list[tuple[Task, EpisodeSettings]]:
        per_step, extra = self._config.tasks_per_step, self._config.dynamic_sampling
        tasks = step_tasks(self._tasks, step, per_step, extra)
        plan = list(episode_plan(self._config.rollout, tasks[:per_step], prefix=f"step{step}/"))
        for j, task in enumerate(tasks[per_step:]):
            group = f"extra{j}/"
            plan += episode_plan(
                self._config.rollout, [task], prefix=f"step{step}/{group}", group_prefix=group
            )
        return plan

    def open_step(self, step: int) -> None:
        """Start step `step`'s trajectory file afresh (a redone step replaces its file)."""
        (self._out_dir / f"step_{step}.jsonl").write_text("")

    async def run(self, step: int, index: int, attempt: int = 0) -> EpisodeSummary:
        """Run episode `index` of step `step` and write it; see the class docstring."""
        task, settings = self.plan(step)[index]
        if attempt > 0:
            earlier = await self._writer.written_before(
                step, trajectory_id(settings.run_id, settings.episode_id)
            )
            if earlier is not None:
                log.info(
                    "step %d episode %d: attempt %d was written before its replica died; kept",
                    step,
                    index,
                    earlier.meta.attempt,
                )
                return EpisodeSummary.of(earlier)
        settings = dataclasses.replace(settings, attempt=attempt)
        async with self._limit:
            trajectory = await run_episode(
                self._agent,
                task,
                # One engine per episode while it can: its history stays in that prefix cache.
                engine=for_session(self._engine, settings.episode_id),
                chat=self._chat,
                sandbox_provider=self._sandboxes,
                rewards=self._rewards,
                settings=settings,
                media=self._media,
            )
        error = trajectory.meta.error
        if error is not None and error.failed_role is not None:
            raise RoleLost(f"step {step} episode {index}: {error.message}", error.failed_role)
        await self._writer.write(step, trajectory)
        return EpisodeSummary.of(trajectory)

    async def run_group(
        self, step: int, indices: Sequence[int], attempt: int = 0
    ) -> AsyncGenerator[list[tuple[int, EpisodeSummary]]]:
        """Run episodes `indices` of step `step` side by side (`run`), yielding `(index,
        summary)` for each as it is written, those written at the same moment in one list (in
        index order); then raise the first error one of them raised
        (`step_rollout.EpisodesCall`). Closed early, it cancels the episodes still running."""
        runs = {asyncio.ensure_future(self.run(step, i, attempt)): i for i in indices}
        pending = set(runs)
        failure: BaseException | None = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                written = []
                for run in done:
                    if (error := run.exception()) is None:
                        written.append((runs[run], run.result()))
                    else:
                        failure = failure or error
                if written:
                    yield sorted(written, key=lambda pair: pair[0])
        finally:
            for run in pending:
                run.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if failure is not None:
            raise failure

    async def close_step(self, step: int) -> None:
        """Close partition `step`: every episode of the step has been written."""
        await self._data.close_partition(step)


class LocalAdvantage:
    """The advantage stage in this process: group baselines over complete groups.

    A group is complete when `group_size` rows of it have arrived; the rows of a step's closed
    partition that are still grouped at the end (a group cut short) are scored as they are.
    Infrastructure failures get advantage 0 and are left out of their group's statistics.
    With `drop_uniform` (dynamic sampling) it also writes `dropped`, 1 for the rows of a group
    whose rewards are all equal (`uniform_rewards`), which the actor does not train. With a
    `critic` (estimator `gae`) each row is scored on its own as it arrives with its `values`:
    GAE over its sampled tokens, the reward on the last one; it writes `returns` too.
    """

    def __init__(
        self,
        data: DataPlane,
        config: AdvantageConfig,
        group_size: int,
        read_timeout: float,
        *,
        drop_uniform: bool = False,
        critic: CriticConfig | None = None,
    ) -> None:
        self._data = data
        self._config = config
        self._group_size = group_size
        self._read_timeout = read_timeout
        self._drop_uniform = drop_uniform
        self._critic = critic

    async def compute(self, step: int) -> dict[str, float]:
        """Write `advantages` for every row of step `step`; return `advantage/*` metrics."""
        # Every row of the step, even if a step's advantages were (partly) computed before:
        # after a replica death or an actor restore the step is computed again, whole.
        await self._data.reread(step, "advantage")
        if self._critic is not None:
            return await self._gae(step, self._critic)
        groups: dict[str, list[GroupMember]] = {}
        scored: list[tuple[float, bool]] = []
        stream = self._data.iter_micro_batches(
            step, ADVANTAGE_FIELDS, self._group_size, "advantage", timeout_s=self._read_timeout
        )
        async with closing_stream(stream) as batches:
            async for batch in batches:
                for i, row_id in enumerate(batch.ids):
                    meta = batch["meta"][i]
                    member = GroupMember(
                        id=row_id,
                        reward=float(batch["reward"][i]),
                        valid=meta["stop_reason"] not in INFRA_STOP_REASONS,
                        loss_mask=batch["loss_mask"][i],
                    )
                    members = groups.setdefault(meta["group_id"], [])
                    members.append(member)
                    if len(members) == self._group_size:
                        scored += await self._write(step, groups.pop(meta["group_id"]))
        for members in groups.values():
            scored += await self._write(step, members)
        valid_adv = [a for a, ok in scored if ok]
        n = max(len(valid_adv), 1)
        return {
            "advantage/abs_mean": sum(abs(a) for a in valid_adv) / n,
            "advantage/zero_frac": sum(a == 0.0 for a in valid_adv) / n,
        }

    async def _gae(self, step: int, critic: CriticConfig) -> dict[str, float]:
        """GAE advantages and returns of every row of `step`, from its values."""
        token_sum, tokens = 0.0, 0
        stream = self._data.iter_micro_batches(
            step,
            (*ADVANTAGE_FIELDS, "values"),
            self._group_size,
            "advantage",
            timeout_s=self._read_timeout,
        )
        async with closing_stream(stream) as batches:
            async for batch in batches:
                advantages, returns = [], []
                for i, meta in enumerate(batch["meta"]):
                    mask = batch["loss_mask"][i]
                    if meta["stop_reason"] in INFRA_STOP_REASONS:
                        mask = torch.zeros_like(mask)
                    adv, ret = row_gae(
                        batch["values"][i],
                        float(batch["reward"][i]) if mask.any() else 0.0,
                        mask,
                        gamma=critic.gamma,
                        lam=critic.lam,
                    )
                    advantages.append(adv)
                    returns.append(ret)
                    token_sum += float(adv.abs().sum())
                    tokens += int((mask != 0).sum())
                await self._data.put_field(step, batch.ids, "returns", returns)
                await self._data.put_field(step, batch.ids, "advantages", advantages)
        return {"advantage/abs_mean": token_sum / max(tokens, 1)}

    async def _write(self, step: int, members: list[GroupMember]) -> list[tuple[float, bool]]:
        valid = torch.tensor([m.valid for m in members])
        # Infrastructure failures have a NaN reward; they are left out of the statistics.
        rewards = torch.tensor([m.reward if m.valid else 0.0 for m in members])
        one_group = torch.zeros(len(members), dtype=torch.long)
        adv = estimate(rewards, one_group, valid, self._config)
        per_token = [(a * m.loss_mask.float()).tolist() for a, m in zip(adv, members, strict=True)]
        ids = [m.id for m in members]
        if self._drop_uniform:
            # Before the advantages: the actor takes a row once its advantages are written.
            drop = uniform_rewards([m.reward for m in members], [m.valid for m in members])
            await self._data.put_field(step, ids, "dropped", [int(drop)] * len(ids))
        await self._data.put_field(step, ids, "advantages", per_token)
        return [(float(a), m.valid) for a, m in zip(adv.tolist(), members, strict=True)]


@dataclass(frozen=True)
class GroupMember:
    """What the advantage stage reads of one row."""

    id: str
    reward: float
    """NaN for an infrastructure failure (`valid` False)."""
    valid: bool
    loss_mask: torch.Tensor


SCORES: dict[ScoringRole, str] = {"reference": "ref_logprobs", "teacher": "teacher_logprobs"}
"""The scoring roles and the field each writes."""


class LocalScorer:
    """A scoring stage in this process: the logprobs of every row of a step under a frozen
    model (`role` `reference`: the KL reference's `ref_logprobs`; `teacher`: the distillation
    teacher's `teacher_logprobs`).

    Rows are scored a micro-batch at a time as they arrive, in a torch thread of the stage's
    own. Infrastructure failures, which are never trained, get zeros without a forward pass.
    Metrics: `{role}/rows`, `perf/{role}_seconds`, and `{role}/reverse_kl`, the mean over the
    loss-masked tokens of the sampling logprob minus the frozen model's (an estimate of the
    per-token KL(policy || frozen model) at the weights that sampled the step).
    """

    def __init__(
        self,
        role: ScoringRole,
        data: DataPlane,
        policy: ReferencePolicy,
        micro_batch_size: int,
        read_timeout: float,
        threads: int | None,
        media: MediaResolver | None = None,
    ) -> None:
        self._role = role
        self._field = SCORES[role]
        self._data = data
        self._media = media
        self._policy = policy
        self._micro_batch_size = micro_batch_size
        self._read_timeout = read_timeout
        self._thread = TorchThread(threads, role)

    def close(self) -> None:
        """Let the stage's thread end."""
        self._thread.close()

    async def compute(self, step: int) -> dict[str, float]:
        """Write this role's field for every row of step `step`; return its metrics."""
        # Every row, as for the advantages: a replacement replica scores the step whole.
        await self._data.reread(step, self._role)
        scored = 0
        busy = 0.0
        gap = 0.0
        tokens = 0
        stream = self._data.iter_micro_batches(
            step,
            SCORER_FIELDS,
            self._micro_batch_size,
            self._role,
            timeout_s=self._read_timeout,
        )
        async with closing_stream(stream) as batches:
            async for batch in batches:
                sequences: list[torch.Tensor] = batch["input_ids"]
                values = [torch.zeros(len(ids)) for ids in sequences]
                trained = [
                    i
                    for i, meta in enumerate(batch["meta"])
                    if meta["stop_reason"] not in INFRA_STOP_REASONS
                ]
                if trained:
                    started = time.perf_counter()
                    inputs = await asyncio.to_thread(row_media, batch, self._media)
                    to_score = TrainBatch.for_scoring(
                        [sequences[i] for i in trained], media_inputs=[inputs[i] for i in trained]
                    )
                    logprobs = await self._thread.run(self._policy.logprobs, to_score)
                    busy += time.perf_counter() - started
                    for row, i in enumerate(trained):
                        values[i] = logprobs[row, : len(sequences[i])]
                        mask = batch["loss_mask"][i] != 0
                        sampled = batch["rollout_logprobs"][i]
                        gap += float((sampled[mask] - values[i][mask]).sum())
                        tokens += int(mask.sum())
                    scored += len(trained)
                await self._data.put_field(step, batch.ids, self._field, values)
        return {
            f"{self._role}/rows": float(scored),
            f"{self._role}/reverse_kl": gap / tokens if tokens else math.nan,
            f"perf/{self._role}_seconds": busy,
        }


def row_media(batch: MicroBatch, media: MediaResolver | None) -> list[Any]:
    """Each row's media forward inputs (None for a row without media), from the run's media
    store through the model's processor, as the rollout prepared them."""
    entries = batch["multimodal"] if "multimodal" in batch.fields else [[]] * len(batch)
    if media is None:
        if any(entries):
            raise ValueError("rows carry media, but this role was given no media resolver")
        return [None] * len(batch)
    return [media.model_inputs(e) for e in entries]


def train_rows(
    batch: MicroBatch,
    media: MediaResolver | None = None,
    teacher: TeacherConfig | None = None,
    old_policy: OldPolicy = "engine",
) -> list[TrainRow]:
    """The rows of a micro-batch read with `train_fields`, typed. PPO's pi_old is the policy
    that sampled each row (its rollout logprobs) or, with `old_policy="trainer"`, the trainer's
    policy as its step begins (rows without `old_logprobs`; `LossConfig.old_policy`). Media inputs
    come from `media` (see `row_media`). With a `teacher`, each row's advantages gain the
    teacher's per-token signal against the sampling logprobs (`advantages.with_teacher`)."""
    inputs = row_media(batch, media)

    def advantages(i: int) -> torch.Tensor:
        if teacher is None:
            return batch["advantages"][i]
        return with_teacher(
            batch["advantages"][i],
            batch["rollout_logprobs"][i],
            batch["teacher_logprobs"][i],
            batch["loss_mask"][i],
            coef=teacher.coef,
            reward_weight=teacher.reward_weight,
        )

    return [
        TrainRow(
            id=batch.ids[i],
            input_ids=batch["input_ids"][i],
            loss_mask=batch["loss_mask"][i],
            rollout_logprobs=batch["rollout_logprobs"][i],
            weight_version=batch["weight_version"][i],
            advantages=advantages(i),
            stop_reason=str(batch["meta"][i]["stop_reason"]),
            old_logprobs=batch["rollout_logprobs"][i] if old_policy == "engine" else None,
            ref_logprobs=batch["ref_logprobs"][i] if "ref_logprobs" in batch.fields else None,
            media_inputs=inputs[i],
        )
        for i in range(len(batch))
    ]


class LocalActor:
    """The actor role in this process: a `TrainerBackend` fed from the data plane.

    Its checkpoint holds the trainer's (weights, optimizer, version), the data position (the
    next step) and the ids handed to it by the data plane, so that a resumed actor trains every
    remaining id exactly once.
    """

    def __init__(
        self,
        backend: TrainerBackend,
        data: DataPlane,
        config: RunConfig,
        *,
        lock: asyncio.Lock | None = None,
        media: MediaResolver | None = None,
    ) -> None:
        """`media` reads the media of rows that have some (the run's store and processor)."""
        self._backend = backend
        self._media = media
        # Held around each optimizer step: weights are published only between steps.
        self._lock = lock or asyncio.Lock()
        self._data = data
        self._micro_batch_size = config.trainer.micro_batch_size
        self._read_timeout = config.data_plane.read_timeout
        # Trainer-side defence in depth (DESIGN.md §2): the producers are throttled by the
        # controller's gate; this one only audits what arrives.
        self._gate = StalenessGate(config.max_staleness)
        # After a restore (`restored`), rows sampled by weights newer than the checkpoint's,
        # which died with the lost actor, are trained as they are (their pi_old is their own
        # rollout logprobs) and counted; any other sample newer than the trainer is a bug.
        self._restored_from: int | None = None
        self._from_lost_weights = 0
        # The backend's work runs in one thread of its own, set to `trainer_threads`.
        self._compute = TorchThread(config.trainer_threads, "trainer", config.trainer_nice)
        self._fields = train_fields(config)
        self._teacher = config.trainer.teacher
        self._old_policy = config.trainer.loss.old_policy
        self._checkpoint_step = 0
        """The data position of the newest checkpoint saved or loaded (0: none yet)."""
        self._steps_under_way = production_window(config)

    def close(self) -> None:
        """Let the trainer's thread end (after the work it has)."""
        self._compute.close()

    @property
    def version(self) -> int:
        """The weight version: optimizer steps applied so far."""
        return self._backend.version

    def check_health(self) -> None:
        """Raise if the trainer can no longer train (a rank process of its was lost)."""
        if isinstance(self._backend, Supervised):
            self._backend.check_health()

    async def train(self, step: int) -> TrainReport:
        """One optimizer step on step `step`'s admitted samples (none: no step is taken)."""
        started = time.perf_counter()
        version = self._backend.version
        kept: list[TrainRow] = []
        trained: list[tuple[str, int]] = []
        excluded = 0
        dropped = 0
        stream = self._data.iter_micro_batches(
            step, self._fields, self._micro_batch_size, "actor", timeout_s=self._read_timeout
        )
        async with closing_stream(stream) as batches:
            async for batch in batches:
                rows = await asyncio.to_thread(
                    train_rows, batch, self._media, self._teacher, self._old_policy
                )
                uniform = batch["dropped"] if "dropped" in batch.fields else [0] * len(rows)
                for row, drop in zip(rows, uniform, strict=True):
                    if drop:  # its group has nothing to learn from (dynamic sampling)
                        dropped += 1
                        continue
                    if row.stop_reason in INFRA_STOP_REASONS:
                        excluded += 1
                        continue
                    sampled = row.sampled_versions
                    if not sampled or not self._admit(min(sampled), version):
                        continue
                    kept.append(row)
                    trained.append((row.id, min(sampled)))
        waited = time.perf_counter() - started
        metrics: dict[str, float] = {}
        if kept:
            # PPO's pi_old (`loss.old_policy`, `train_rows`): the engine's logprobs, or, rows
            # without `old_logprobs`, the trainer's policy as the step begins (the backend's
            # default, from the step's own forward), samples of older weights then weighed by
            # min(pi_trainer / pi_engine, tis_cap).
            batch_ = TrainBatch.from_rows(kept)
            async with self._lock:
                raw = await self._compute.run(self._backend.train_step, batch_)
            # The backend's own timing keys describe the optimizer step alone.
            renames = {
                "perf/step_seconds": "perf/train_seconds",
                "perf/step_cpu_seconds": "perf/train_cpu_seconds",
                "perf/tokens_per_second": "perf/train_tokens_per_second",
            }
            metrics = {renames.get(k, k): v for k, v in raw.items()}
        metrics.update(self._gate.metrics(reset=True))
        metrics["staleness/from_lost_weights"] = float(self._from_lost_weights)
        self._from_lost_weights = 0
        metrics["perf/train_wait_seconds"] = waited
        metrics["actor/excluded_infra_failures"] = float(excluded)
        metrics["actor/dropped_uniform_samples"] = float(dropped)
        await self._data.clear(step)
        return TrainReport(
            step=step,
            trained_version=version,
            version=self._backend.version,
            trained=trained,
            metrics=metrics,
        )

    def _admit(self, sample_version: int, version: int) -> bool:
        if self._restored_from is not None and sample_version > version:
            self._from_lost_weights += 1
            return True
        return self._gate.admit(sample_version, version)

    def restored(self) -> None:
        """This actor replaces a lost one: the engines may have served weights newer than the
        ones it restored."""
        self._restored_from = self._backend.version

    async def reopen_steps(self, from_step: int) -> None:
        """This actor replaces a lost one and goes on from step `from_step`: the steps from
        there that the lost one trained (and cleared) are produced again."""
        reopened = await self._data.reopen_cleared(from_step)
        if reopened:
            log.info("steps %s are produced again for the restored actor", reopened)

    async def forget_consumed(self) -> None:
        """Start the data position afresh: every row not trained since is handed out again."""
        empty = {**self._data.consumed_state(), "consumers": {}}
        self._data.restore_consumed(empty)

    async def save(self, path: Path, step: int) -> None:
        """Checkpoint to `path`: trainer state plus data position `step` and consumed ids."""
        position = {
            "step": step,
            "consumed": self._data.consumed_state(),
            "rng": {
                "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
                "python": _python_rng_state(),
            },
        }
        await self._compute.run(self._backend.save, path, position)
        # What marks the trained steps closed is kept for those a restore may reopen (from
        # this checkpoint on, or from the previous one should this one be lost) and those
        # whose production may still be under way (a stage re-running its work after its
        # replica died: at most `production_window` steps behind the next one to train).
        await self._data.forget_cleared(
            min(self._checkpoint_step, step - self._steps_under_way - 1)
        )
        self._checkpoint_step = step

    async def recover(self, checkpoint: Path | None) -> int:
        """An actor in this process keeps its state as long as the run: only its checkpoint
        can be restored, as `load` does."""
        if checkpoint is None:
            raise RuntimeError("an actor in this process has no state to lose or recover")
        return await self.load(checkpoint)

    async def load(self, path: Path) -> int:
        """Restore a `save` checkpoint; returns the step to continue from."""
        position = await self._compute.run(self._backend.load, path)
        self._data.restore_consumed(position["consumed"])
        state = base64.b64decode(position["rng"]["torch"])
        torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        version, internal, gauss = position["rng"]["python"]
        random.setstate((version, tuple(internal), gauss))
        self._checkpoint_step = int(position["step"])
        return self._checkpoint_step


def _prepare_thread(threads: int | None, nice: int | None, name: str) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    if nice is not None:
        set_thread_nice(nice, name)


def set_thread_nice(nice: int, name: str) -> None:
    """Give the calling thread scheduling priority `nice` (Linux schedules threads, so this
    leaves the process's other threads as they are). A priority above the default needs
    CAP_SYS_NICE: without it the thread keeps its own, and a warning says so."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as err:
        log.warning("%s thread: could not set nice %d (%s); it keeps its priority", name, nice, err)


def _python_rng_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]
