"""`RunConfig`: everything `omniloop run` needs, in one typed, documented model.

A run is the rollout of `omniloop rollout` (tasks, agent, rewards, engine, sandboxes, sampling)
repeated for `steps` steps, each followed by one optimizer step of the trainer. The rollout
section is a `RolloutConfig` as is, so a rollout config can be pasted under `rollout:`. Four of
its fields are owned by the run and filled in from it: `rollout.engine.model` (from `model`),
`rollout.seed` (from `seed`), `rollout.output` (the run's trajectory folder) and
`rollout.run_id` (from `run_id`). Setting them to something else is an error rather than
silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from omniloop.config import StrictModel
from omniloop.errors import ConfigError
from omniloop.platform.control.rollout_config import RolloutConfig
from omniloop.platform.control.staleness import MaxStaleness
from omniloop.platform.dcs.config import WeightSyncConfig
from omniloop.trainer.config import TrainerConfig

STALE_TIS_CAP = 2.0
"""`trainer.loss.tis_cap` of a run with `max_staleness` above 0 that sets none."""


class DataPlaneSettings(StrictModel):
    """The data plane (TransferQueue on the run's Ray cluster)."""

    num_cpus: int = Field(default=8, ge=1)
    """Logical CPUs of a private Ray instance (placement only; more than the cores is fine)."""
    ray_temp_dir: str | None = None
    """Temp dir of a private Ray instance (keep it short: Ray's socket paths live in it); None
    makes a fresh one under the system temp dir and removes it at the end of the run."""
    storage_node_resource: str | None = None
    """On a cluster: a Ray resource the nodes that hold the queue's storage must offer (a node
    that stays, the head's say); None: any node with a CPU. Rows on a node that is lost are
    lost with it, and the run with them."""
    read_timeout: float = Field(default=1800.0, gt=0)
    """Seconds a role may wait for the next row of a step before the run fails with a
    description of the stall. Generous: a step's slowest episode can take minutes."""


class RolePlacement(StrictModel):
    """Where a role's replicas may run on a Ray cluster."""

    resources: dict[str, float] = Field(default_factory=dict)
    """Ray custom resources each replica needs (`{"rollout_host": 1}`): it runs only on nodes
    that offer them."""
    max_replicas_per_node: int | None = Field(default=None, ge=1)
    """Most replicas of the role on one node (spreads them over nodes); None: no bound."""


class ServicesConfig(StrictModel):
    """How the roles run: as Ray Serve deployments (each its own process and failure domain) or
    inside the `omniloop run` process (for unit tests and debugging)."""

    mode: Literal["services", "in_process"] = "services"
    """`services`: rollout, advantage and actor are Ray Serve deployments on the run's Ray
    cluster; a replica that dies is replaced and its work retried. `in_process`: the same roles
    in this process, with no fault isolation."""
    rollout_replicas: int = Field(default=2, ge=1)
    """Replicas of the rollout deployment; they share the run's `rollout.concurrency` episodes.
    Each is a process of its own with torch, the tokenizer and a data-plane client loaded
    (~0.55 GB resident on the tiny model)."""
    rollout_groups_per_replica: int | None = Field(default=None, ge=1)
    """GRPO groups a rollout replica takes at once (its `max_ongoing_requests`: the rollout
    role's requests are groups); None: as many as fill its share of `rollout.concurrency`.
    Groups sent past these and `max_queued_requests` are refused and sent again."""
    max_queued_requests: int = Field(default=1024, ge=1)
    """Requests a deployment's callers may queue beyond what its replicas run at once; past it
    a call is refused (back-pressure) and retried after a pause, never dropped."""
    engine_replicas: int = Field(default=1, ge=1)
    """Engines, each fronted by a replica of the engine deployment that launches it (or
    adopts `rollout.engine.url`, then 1)."""
    engine_wait_s: float = Field(default=120.0, gt=0)
    """Seconds a generation request waits for an engine to answer again (a dead engine is
    replaced meanwhile) before the episode fails as `engine_error`."""
    reward_replicas: int = Field(default=2, ge=1)
    """Replicas of the reward deployment, where reward functions run (a reward that crashes
    its process takes down only the replica, and the episodes it was scoring)."""
    sandbox_replicas: int = Field(default=1, ge=1)
    """Replicas of the sandbox deployment (sandboxd: the only process of the run that creates
    sandboxes); on a cluster, spread them with `placement.sandbox.max_replicas_per_node`."""
    sandbox_wait_s: float = Field(default=60.0, gt=0)
    """Seconds an episode waits for a sandbox replica to answer (one is being replaced) before
    it fails as `sandbox_error`."""
    reward_batch_wait_s: float = Field(default=0.05, ge=0)
    """Seconds a rollout replica gathers the evaluations of a reward after the first, to send
    them to the reward role as one call (a GRPO group's episodes end close together); each
    result comes back as it finishes. 0: those that arrive at the same moment."""
    reward_memory_mb: int = Field(default=2048, ge=64)
    """Resident memory past which a reward replica ends itself (a runaway reward)."""
    api: bool = True
    """Serve the run's REST API and dashboard as the `api` role (Ray Serve's HTTP proxy, on
    the head node) at `api_host:api_port` for as long as the run lasts; the URL is printed at
    start. Reads only: episodes submitted there wait for an `omniloop serve` on the store."""
    api_host: str = "127.0.0.1"
    """Interface of the api role's HTTP proxy (beyond loopback needs `OMNILOOP_API_TOKEN`)."""
    api_port: int = Field(default=0, ge=0, le=65535)
    """Port of the api role's HTTP proxy; 0 picks a free one."""
    health_poll_s: float = Field(default=1.0, gt=0)
    """Seconds between the health monitor's polls of every role's deployment status."""
    health_poll_timeout_s: float = Field(default=5.0, gt=0)
    """Seconds the health monitor waits for Ray Serve's controller to answer a poll; one not
    answered in time counts as a failed poll (a controller alive but stuck)."""
    max_failed_polls: int = Field(default=30, ge=1)
    """Consecutive polls Ray Serve may fail to answer (an error, or no answer within
    `health_poll_timeout_s`) before the run fails."""
    placement: dict[
        Literal[
            "actor",
            "engine",
            "reward",
            "rollout",
            "advantage",
            "reference",
            "teacher",
            "critic",
            "sandbox",
            "api",
        ],
        RolePlacement,
    ] = Field(default_factory=dict)
    """Per role, the resources its replicas ask Ray for (default: none beyond the node's)."""
    health_check_period_s: float = Field(default=2.0, gt=0)
    """Seconds between Ray Serve's health checks of each replica (`check_health`)."""
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds a health check may take before the replica counts as failed and is replaced."""


class FaultsConfig(StrictModel):
    """What a run tolerates: retries of work cut off by a failed replica, and infra errors."""

    max_attempts: int = Field(default=3, ge=1)
    """Runs of one episode (or of one step's advantages) before its role's failure fails the
    run; each re-run after a replica died is `attempt + 1` under the same trajectory id."""
    max_infra_error_share: float = Field(default=0.5, ge=0.0, le=1.0)
    """Largest share of a step's episodes that may end in an infrastructure failure
    (`engine_error`, `sandbox_error`, `reward_error`, `cancelled`); past it the run fails with
    the cause instead of training on what is left."""
    retry_pause_s: float = Field(default=0.5, gt=0)
    """Seconds to wait before retrying a call a deployment refused or lost."""


class StopWhen(StrictModel):
    """Ends a run before `steps` once a step metric has reached a target (early stopping).

    Checked after each trained step, on the mean of the metric over the last `over_steps`
    steps (a resumed run counts the steps before its checkpoint). The run then writes its
    final checkpoint and ends `completed`. The rollouts of later steps that had started (up to
    `max_staleness + 1` of them: the step's weight sync releases the next rollout before the
    step is recorded) are cancelled; the episodes they finished stay in the run's database and
    trajectory files, untrained."""

    metric: str = "reward/mean"
    """The step metric watched: a key of the run's `metrics.jsonl` (`reward/mean`, `kl`...).
    A run whose steps do not report it fails at its first step, naming the keys they do."""
    at_least: float | None = None
    """Stop once the metric's mean over the last `over_steps` steps is at least this."""
    at_most: float | None = None
    """Stop once that mean is at most this (for a metric that falls)."""
    over_steps: int = Field(default=3, ge=1)
    """Steps the mean is taken over; fewer recorded steps never stop the run."""

    @model_validator(mode="after")
    def _one_target(self) -> StopWhen:
        if (self.at_least is None) == (self.at_most is None):
            raise ValueError(
                f"stop_when needs exactly one of at_least and at_most (got at_least="
                f"{self.at_least}, at_most={self.at_most}): set stop_when.at_least=0.8, say"
            )
        return self

    def value(self, step: int, metrics: Mapping[str, float]) -> float:
        """The watched metric of a step's metrics; `ConfigError` if the step has none."""
        if self.metric not in metrics:
            raise ConfigError(
                f"stop_when.metric={self.metric!r} is not a metric of step {step}; its metrics "
                f"are {', '.join(sorted(metrics))}"
            )
        return metrics[self.metric]

    def reached(self, history: Mapping[int, float], step: int) -> float | None:
        """The metric's mean over steps `step - over_steps + 1 .. step` of `history` (per step,
        its value) if it meets the target; None if not, or if one of those steps has no value
        or NaN."""
        if step + 1 < self.over_steps:
            return None
        window = range(step - self.over_steps + 1, step + 1)
        mean = sum(history.get(k, math.nan) for k in window) / self.over_steps
        if math.isnan(mean):
            return None
        if self.at_least is not None:
            return mean if mean >= self.at_least else None
        return mean if self.at_most is not None and mean <= self.at_most else None


class RunConfig(StrictModel):
    """An RL training run: rollouts, rewards, advantages, optimizer steps, weight syncs."""

    model: str = "smollm2"
    """The policy: `smollm2`, `tiny`, or a Hugging Face model folder. The trainer starts from
    it and a local engine serves it; both resolve it the same way (`resolve_model`)."""
    rollout: RolloutConfig
    """Tasks, agent, rewards, engine, sandboxes and sampling, exactly as for `omniloop rollout`.
    `rollout.samples_per_task` is the GRPO group size; `rollout.concurrency` bounds the episodes
    running at once across all steps in flight."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The trainer: optimizer, micro-batching, loss and advantage estimator."""
    sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """Weight sync from the trainer to the engines after every optimizer step (`distributed`:
    a gloo/NCCL broadcast; `disk`: a safetensors folder the engines load)."""
    steps: int = Field(default=10, ge=1)
    """Optimizer steps of the run (one per rollout step)."""
    tasks_per_step: int = Field(default=8, ge=1)
    """Tasks per rollout step; each gets `rollout.samples_per_task` episodes. Tasks are taken in
    file order, cycling, by data position: step `k` uses tasks `k*tasks_per_step ...`."""
    dynamic_sampling: int = Field(default=0, ge=0)
    """DAPO's dynamic sampling: a group whose rewards are all equal (it has no advantage to
    learn from) is not trained, and is replaced by another group, of the tasks that follow the
    step's own, until the step has `tasks_per_step` groups to train or this many extra groups
    ran (then the step trains fewer). 0 trains every group as it comes."""
    max_staleness: MaxStaleness = 1
    """How many optimizer steps the weights that sampled a trained token may lag behind the
    trainer: 0 is on-policy (rollout and training alternate), `k` lets rollouts run up to `k`
    steps ahead of training, `inf` is fully asynchronous. Above 0, samples of older weights are
    corrected for by PPO's ratio against the engine's logprobs (`trainer.loss.old_policy:
    engine`, the default) or, with `old_policy: trainer`, by truncated importance sampling
    (`trainer.loss.tis_cap`, 2 unless set; `null` turns it off)."""
    stop_when: StopWhen | None = None
    """End the run before `steps` once a metric has reached a target (`stop_when.at_least=0.9`
    stops when the mean reward of the last 3 steps is 0.9 or more); None runs every step."""
    checkpoint_every: int = Field(default=5, ge=1)
    """Save a checkpoint every this many steps (and always after the last one)."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Most checkpoints kept on disk; older ones are deleted after a newer one is complete."""
    run_dir: str = "runs/run"
    """Folder of the run: `config.yaml`, `metrics.jsonl`, `trained.jsonl`, `trajectories/`,
    `checkpoints/`, `tensorboard/`, `engine.log`."""
    seed: int = 0
    """Seeds the trainer's RNGs and, as `rollout.seed`, every episode's sampling."""
    trainer_threads: int | None = Field(default=None, ge=1)
    """torch threads of the trainer's optimizer steps (wherever the actor runs); None leaves
    torch's default. On a small machine give the engine and the trainer one thread each:
    OpenMP threads competing for the same cores wait on each other."""
    trainer_nice: int | None = Field(default=-10, ge=-20, le=19)
    """Scheduling priority (nice) of the thread that runs the optimizer steps, wherever the
    actor runs; None leaves it. When rollouts overlap training, the optimizer step bounds the
    step, and on a machine the roles share, every runnable process gets an equal share of the
    cores: at the default priority the trainer's thread ran at half speed beside the rollout's
    processes (engine, sandboxes, rewards, data plane). Below 0 needs CAP_SYS_NICE (root);
    without it the thread keeps its priority and the actor's log says so."""
    ray_address: str | None = None
    """Ray cluster to run on: an address (`auto` for the one `ray start` made on this host,
    `ray://head:10001`, `127.0.0.1:6379`); None starts a private local instance for the run."""
    data_plane: DataPlaneSettings = Field(default_factory=DataPlaneSettings)
    """The data plane."""
    services: ServicesConfig = Field(default_factory=ServicesConfig)
    """How the roles run (Ray Serve deployments by default)."""
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    """Retries and the infrastructure-error bound."""
    tensorboard: bool = True
    """Also write TensorBoard event files to `RUN_DIR/tensorboard` (needs `tensorboard`)."""
    database: str | None = None
    """Database the run is recorded in (the run, its metrics and every episode with its
    trajectory), where `omniloop serve` shows it: a SQLAlchemy URL; None uses
    `$OMNILOOP_DB_URL`, else `sqlite:///runs/omniloop.db`."""
    run_id: str | None = Field(default=None, min_length=1, max_length=64)
    """Id of the run in the database and in every trajectory id (so ids never clash across
    runs); None makes a new one. It is kept in `RUN_DIR/run_id`, and `--resume` reuses it."""

    @model_validator(mode="after")
    def _check_dynamic_sampling(self) -> RunConfig:
        if self.dynamic_sampling and self.trainer.critic is not None:
            raise ValueError(
                f"dynamic_sampling={self.dynamic_sampling} drops groups with equal rewards, which "
                "a critic's advantages (trainer.critic, estimator gae) do not have: set "
                "dynamic_sampling=0, or use a group estimator"
            )
        return self

    @model_validator(mode="after")
    def _correct_stale_samples(self) -> RunConfig:
        # Tokens sampled by weights up to `max_staleness` steps old are trained by the current
        # policy: with `loss.old_policy: trainer` their loss is weighted by min(pi_trainer /
        # pi_sampler, cap), the truncated importance sampling that also absorbs engine/trainer
        # numeric mismatch (with `engine` the weight is 1: PPO's ratio is already against the
        # sampler). A cap keeps the variance bounded; 2 is the value the TIS write-up and slime
        # use.
        loss = self.trainer.loss
        if self.max_staleness != 0 and "tis_cap" not in loss.model_fields_set:
            corrected = loss.model_copy(update={"tis_cap": STALE_TIS_CAP})
            self.trainer = self.trainer.model_copy(update={"loss": corrected})
        return self

    @model_validator(mode="after")
    def _derive_rollout(self) -> RunConfig:
        rollout = self.rollout
        trajectories = str(Path(self.run_dir) / "trajectories")
        owned = (
            ("rollout.engine.model", rollout.engine, "model", self.model, "model"),
            ("rollout.seed", rollout, "seed", self.seed, "seed"),
            ("rollout.output", rollout, "output", trajectories, "run_dir"),
            ("rollout.run_id", rollout, "run_id", self.run_id, "run_id"),
        )
        for dotted, section, name, value, source in owned:
            if name in section.model_fields_set and getattr(section, name) != value:
                raise ValueError(
                    f"{dotted} is set by the run from `{source}` ({value!r}); "
                    f"remove {dotted} (got {getattr(section, name)!r})"
                )
        engine = rollout.engine.model_copy(update={"model": self.model})
        derived: dict[str, Any] = {"engine": engine, "seed": self.seed, "output": trajectories}
        if self.run_id is not None:
            derived["run_id"] = self.run_id
        self.rollout = rollout.model_copy(update=derived)
        if self.rollout.samples_per_task < 2:
            raise ValueError(
                "rollout.samples_per_task must be at least 2: group baselines (GRPO, RLOO) "
                "give a group of one sample no advantage, so nothing would be learned"
            )
        return self


def config_yaml(config: RunConfig) -> str:
    """The resolved config as YAML, without the fields the run derives (they follow from
    `model`, `seed` and `run_dir`), so the file loads again with other overrides."""
    import yaml

    data = config.model_dump(mode="json")
    rollout = data["rollout"]
    for name in ("seed", "output", "run_id"):
        rollout.pop(name)
    rollout["engine"].pop("model")
    return yaml.safe_dump(data, sort_keys=False)
