"""Typed configuration of the trainer: optimizer, precision, micro-batching, loss, advantages.

The loss and advantage settings are read by the pure functions in `losses.py` and
`advantages.py` through `rl_loss` and `batch_from_trajectories`; everything else belongs to the
backend that owns the model and optimizer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from omniloop.config import StrictModel

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
"""How per-token losses become one number; see `losses.aggregate`."""

KLType = Literal["k1", "k2", "k3"]
"""Schulman's KL estimators; see `losses.kl_estimate`."""

PolicyLoss = Literal["ppo", "gspo", "cispo", "sapo"]
"""The policy-gradient surrogate; see the `*_policy_loss` functions in `losses.py`."""

OldPolicy = Literal["trainer", "engine"]
"""Whose logprobs are PPO's pi_old in a run (`LossConfig.old_policy`)."""


class LossConfig(StrictModel):
    """The training objective: policy surrogate + KL penalty - entropy bonus."""

    policy_loss: PolicyLoss = "ppo"
    """`ppo`: token-level clipped ratio (GRPO/DAPO/PPO); `gspo`: sequence-level ratio (set
    `clip_eps_low=3e-4`, `clip_eps_high=4e-4`, `aggregation=seq-mean-token-mean` as in the paper);
    `cispo`: clipped, detached IS weight times log-prob (`clip_eps_low=1` leaves it unbounded
    below, as in the paper); `sapo`: sigmoid-gated soft clip (ignores the clip settings)."""
    clip_eps_low: float = Field(default=0.2, gt=0, le=1)
    """Lower clip: the ratio is clipped below at `1 - clip_eps_low`."""
    clip_eps_high: float = Field(default=0.2, gt=0)
    """Upper clip: the ratio is clipped above at `1 + clip_eps_high` (DAPO's clip-higher: 0.28)."""
    dual_clip_c: float | None = Field(default=None, gt=1)
    """Dual-clip bound for negative advantages (`ppo` only): the loss of a token with A < 0 is
    at most `-A * dual_clip_c`; None disables it. Typical: 3."""
    aggregation: Aggregation = "token-mean"
    """`token-mean` averages over every loss-masked token of the batch (long answers weigh
    more); `seq-mean-token-mean` averages per sequence, then over sequences (GRPO paper, GSPO);
    `seq-mean-token-sum` sums per sequence, then averages over sequences."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty against the reference policy; 0 disables it."""
    kl_type: KLType = "k3"
    """Which KL estimator the penalty uses."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus (subtracted from the loss); 0 disables it."""
    tis_cap: float | None = Field(default=None, gt=0)
    """Truncated importance sampling: each token's policy loss is multiplied by
    `min(exp(old - rollout), tis_cap)` (detached), correcting for the engine's logprobs differing
    from the trainer's. None disables it; typical: 2."""
    old_policy: OldPolicy = "engine"
    """PPO's pi_old in a run, the policy the ratio and its clip are taken against. `engine`:
    the logprobs the engine sampled with (PPO over the behaviour policy): the clip bounds the
    distance from the sampling weights, which corrects for samples of older weights, but a
    token whose probability an earlier step already moved past the clip gives no gradient; the
    `tis_cap` weight is then 1 (its ratio is pi_old over the same logprobs). `trainer`: the
    trainer's own policy as the optimizer step begins (its logprobs come from the step's own
    forward, detached: no extra pass), so the clip bounds only this step's move, and the
    weights that sampled a token are corrected for by `tis_cap`'s `min(pi_trainer /
    pi_engine, cap)`: AReaL's decoupled PPO, whose proximal policy this is. On-policy the two
    differ by the engine's numerics alone. Trainer calls outside a run take `old_logprobs` from
    the batch (`train_step`)."""
    sapo_tau_pos: float = Field(default=1.0, gt=0)
    """SAPO gate temperature for tokens with a positive advantage."""
    sapo_tau_neg: float = Field(default=1.05, gt=0)
    """SAPO gate temperature for tokens with a non-positive advantage."""

    @model_validator(mode="after")
    def _check_dual_clip(self) -> LossConfig:
        if self.dual_clip_c is not None and self.policy_loss != "ppo":
            raise ValueError(
                f"dual_clip_c applies to policy_loss 'ppo' only, not {self.policy_loss!r}"
            )
        return self


class AdvantageConfig(StrictModel):
    """How rewards become advantages: group baselines, or the critic's values (GAE)."""

    estimator: Literal["grpo", "rloo", "gae"] = "grpo"
    """`grpo`: (r - group mean) / (group std + eps); `rloo`: r - mean of the other samples;
    `gae`: PPO's generalized advantage estimation over the sampled tokens from the critic's
    values (needs `trainer.critic`), the reward on the last sampled token."""
    normalize_std: bool = True
    """`grpo` only: divide by the group's standard deviation. False is Dr. GRPO."""
    eps: float = Field(default=1e-6, gt=0)
    """Added to the group std before dividing."""


class CriticConfig(StrictModel):
    """PPO's critic (the `critic` role): a value model trained on the returns of GAE."""

    model: str | None = None
    """The value model's base: a model alias or Hugging Face folder; None: the policy's."""
    lr: float = Field(default=1e-5, gt=0)
    """AdamW learning rate of the value model."""
    value_clip: float | None = Field(default=0.2, gt=0)
    """PPO's value clipping around the values the step was scored with; None disables it."""
    grad_clip: float = Field(default=1.0, gt=0)
    """The value model's global gradient-norm clip."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """GAE's discount per sampled token."""
    lam: float = Field(default=1.0, ge=0, le=1)
    """GAE's lambda."""


class TeacherConfig(StrictModel):
    """On-policy distillation: a frozen teacher scores every token the policy sampled, and the
    policy is trained toward it (each loss-masked token's advantage gains
    `coef * (teacher logprob - sampling logprob)`, the negative of the per-token reverse KL).
    In a run the `teacher` role does the scoring (a process of its own in services mode)."""

    model: str
    """The teacher: a model alias or a Hugging Face folder. It scores the policy's token ids as
    they are (never re-tokenized), so its tokenizer must be the policy's."""
    coef: float = Field(default=1.0, gt=0)
    """Weight of the teacher's per-token signal in the advantages."""
    reward_weight: float = Field(default=1.0, ge=0)
    """Weight of the reward advantages beside it; 0 trains on the teacher's signal alone (pure
    on-policy distillation: the rewards are still computed and reported)."""


class MegatronConfig(StrictModel):
    """`trainer.backend=megatron`'s own settings."""

    tensor_parallel: int = Field(default=1, ge=1)
    """Ranks that split each layer's weights (megatron-core tensor parallelism). Above 1 the
    trainer runs as that many processes in one process group, driven in lock step (a run's
    actor starts them: `trainer/ranks.py`). Checkpoints hold the whole weights and optimizer
    state, so a run resumes at any tensor-parallel size."""
    pipeline_parallel: int = Field(default=1, ge=1)
    """Pipeline stages, each holding a contiguous run of the layers (it must divide their
    number): a run's actor starts `data_parallel × tensor_parallel × pipeline_parallel`
    processes. One micro-batch is in flight at a time, so the stages divide the memory of the
    weights, gradients and optimizer state, not the time of a step
    (`trainer/megatron/pipeline.py`). Checkpoints hold the whole model, so a run resumes at any
    number of stages."""


class TrainerConfig(StrictModel):
    """The trainer backend: optimizer, precision, micro-batching and the objective."""

    backend: Literal["torch", "megatron"] = "torch"
    """The policy's model: `torch`, the Hugging Face model (any causal LM, or a multimodal
    conditional-generation model); `megatron`, megatron-core's `GPTModel` built from the
    Hugging Face Llama / Qwen2 folder (text only). The training loop, losses
    and optimizer are the same."""
    lr: float = Field(default=1e-6, gt=0)
    """AdamW learning rate (after warm-up)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW decoupled weight decay."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up over this many optimizer steps; 0 starts at `lr`."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value; None disables clipping (the norm is still
    reported). A step whose gradient norm is not finite is skipped."""
    data_parallel: int = Field(default=1, ge=1)
    """Data-parallel ranks: above 1 (or with megatron's `tensor_parallel` or
    `pipeline_parallel` above 1) the trainer runs as `data_parallel` × `tensor_parallel` ×
    `pipeline_parallel` rank processes (one Ray actor each) that the actor role drives in lock
    step (`trainer/ranks.py`). Each data-parallel rank trains its
    shard of every step's rows (each row by exactly one rank, shards balanced by tokens, rows
    sharing an opening in one shard: `pack_sequences`) and
    the ranks' gradients are summed before every optimizer step, so N ranks take the step one
    rank takes on all rows. One rank in all: the trainer runs in the actor's own process."""
    distributed_optimizer: bool = False
    """Shard AdamW's state over the data-parallel ranks (ZeRO stage 1, torch's
    `ZeroRedundancyOptimizer`): each rank keeps the state of its share of the parameters (whole
    tensors, shares balanced by size), updates them, and broadcasts them to the others. The
    same steps with about 1/N of the state per rank when no tensor dominates the model;
    checkpoints hold the whole state. With one data-parallel rank, plain AdamW."""
    micro_batch_size: int = Field(default=4, gt=0)
    """Sequences per forward/backward pass; gradients accumulate over the micro-batches of one
    `train_step`, which makes one optimizer step."""
    micro_batch_tokens: int | None = Field(default=None, gt=0)
    """Cut a step's rows into micro-batches by tokens instead of by `micro_batch_size` rows
    (veRL's dynamic batch size, slime's `--max-tokens-per-gpu`): consecutive rows, in the
    step's order (token order when `pack_sequences` shares openings), as many as hold at most
    this many tokens, an opening shared with the row before counted once where
    `pack_sequences` shares it; a longer row is a micro-batch of its own. A pass then carries
    about the same work whatever the rows' lengths and sharing: fewer passes over short rows
    or rows that share most of their tokens, none too large over long ones. The step's
    gradient does not depend on the cut. Logprobs (and the reference's) are scored in the same
    micro-batches; the critic keeps `micro_batch_size`. None: `micro_batch_size` rows each.
    (On the calculator example's steps, whose rows all open with one system prompt, no budget
    was faster than 4 rows: docs/benchmarks.md.)"""
    pack_sequences: bool = True
    """Run each micro-batch's rows packed into as few rows as fit (first-fit decreasing), each
    token attending only to the earlier tokens of its own row (`trainer/packing.py`): a short
    row's padding is filled by other rows' tokens instead of computed, and rows that open with
    the same `shared_prefix_min_tokens` or more tokens (a GRPO group's samples of one prompt)
    hold that opening once, so its forward and backward run once. A step orders its rows by
    their tokens first, so that rows sharing an opening fall into one micro-batch. The logprobs
    and steps of the padded batch, up to float rounding. Both backends; the torch backend packs
    text rows of Hugging Face models with `sdpa` or `eager` attention (others run padded)."""
    shared_prefix_min_tokens: int = Field(default=16, ge=0)
    """Rows share an opening (`pack_sequences`) when it is at least this many tokens; 0:
    packing without sharing."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """`fp32`, or `bf16` autocast (on CPU and GPU) over fp32 master weights and optimizer state."""
    device: str | None = None
    """Torch device (`cpu`, `cuda`, `cuda:1`); None picks `cuda` when available, else `cpu`."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% slower)."""
    keep_freed_memory: bool = True
    """On the CPU, have the trainer's (and the critic's) process keep the memory it frees for
    its next allocations instead of giving it back to the kernel and faulting it in again page
    by page (`trainer/host_memory.py`; glibc's malloc only): SmolLM2-135M's optimizer step on
    one thread ran 6-9 % faster. The process then holds the memory of its peak between steps."""
    logits_chunk_size: int = Field(default=1024, gt=0)
    """Token rows per chunk when turning logits into logprobs and entropy, so that the fp32 copy
    of the (tokens × vocabulary) logits never exists all at once."""
    reference: Literal["copy", "external"] = "copy"
    """Where KL reference logprobs come from when `loss.kl_coef > 0`: `copy` keeps a frozen copy of
    the initial policy beside the trainer's; `external` requires `ref_logprobs` on every batch,
    which in a run the `reference` role computes (a process of its own in services mode)."""
    teacher: TeacherConfig | None = None
    """On-policy distillation from a teacher model; None: no teacher."""
    critic: CriticConfig | None = None
    """PPO's critic, whose values make the advantages (`advantage.estimator: gae`); None: none."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Settings of `backend=megatron` (ignored by `torch`)."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The training objective."""
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """The advantage estimator."""

    @model_validator(mode="after")
    def _check_megatron(self) -> TrainerConfig:
        if self.backend == "megatron" and self.dtype != "fp32":
            raise ValueError(
                f"trainer.backend=megatron trains in fp32 (dtype {self.dtype!r}: autocast does "
                "not reach megatron's linear layers); set trainer.dtype=fp32"
            )
        return self

    @model_validator(mode="after")
    def _check_critic(self) -> TrainerConfig:
        gae = self.advantage.estimator == "gae"
        if gae and self.critic is None:
            raise ValueError(
                "trainer.advantage.estimator=gae needs a critic: set trainer.critic (e.g. "
                "trainer.critic={}) or choose grpo or rloo"
            )
        if self.critic is not None and not gae:
            raise ValueError(
                f"trainer.critic is set but trainer.advantage.estimator={self.advantage.estimator}"
                " ignores it: set the estimator to gae, or remove the critic"
            )
        return self

    @model_validator(mode="after")
    def _check_betas(self) -> TrainerConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must each lie in [0, 1), got {self.betas}")
        return self
