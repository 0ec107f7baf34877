"""Advantage estimators: pure functions over tensors.

Shapes: per-sequence inputs are `(N,)`; per-token inputs are `(B, T)` and follow the trainer's
alignment (index `i` belongs to token `i`; see `torch_backend`). Masks may be bool, int or
float; nonzero means "counts".

Infrastructure failures (DESIGN.md §2) are never trained as a zero reward. The group estimators
take a boolean `valid` mask: an invalid sample gets advantage 0 and is left out of its group's
mean, standard deviation and leave-one-out baseline, so the rest of the group is scored as if it
had never been sampled. Callers still drop invalid samples from the training batch (a zero
advantage would still add their tokens to the token-mean denominator and to the KL term);
`batch.batch_from_trajectories` does both.

A group with fewer than two valid samples has no baseline and gets advantage 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _groups(group_ids: Tensor, valid: Tensor | None, n: int) -> tuple[Tensor, Tensor, int]:
    """Dense group index per sample, the valid mask as bool, and the number of groups."""
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected ({n},)")
    if valid is None:
        valid_b = torch.ones(n, dtype=torch.bool, device=group_ids.device)
    else:
        if valid.shape != (n,):
            raise ValueError(f"valid has shape {tuple(valid.shape)}, expected ({n},)")
        valid_b = valid.bool()
    _, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(index.max()) + 1 if n else 0
    return index, valid_b, num_groups


def _group_sum(values: Tensor, index: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, index, values
    )


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    valid: Tensor | None = None,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantages `(r - mean_group) / (std_group + eps)`; Dr. GRPO with `normalize_std=False`.

    `rewards` `(N,)`; `group_ids` `(N,)` integers, equal for samples of the same prompt (groups
    may be ragged and interleaved). The standard deviation is the unbiased one (Bessel's
    correction, `torch.std`'s default, as veRL and TRL use). Returns `(N,)` float32; invalid
    samples and samples of groups with fewer than two valid members get 0. A group whose valid
    rewards are all equal gets 0 as well (no signal).
    """
    n = rewards.shape[0]
    index, valid_b, num_groups = _groups(group_ids, valid, n)
    # Invalid rewards may be NaN or a placeholder; they must not reach any sum.
    r = torch.where(valid_b, rewards.float(), 0.0)
    w = valid_b.float()
    count = _group_sum(w, index, num_groups)
    mean = _group_sum(r, index, num_groups) / count.clamp(min=1.0)
    dev = torch.where(valid_b, r - mean[index], 0.0)
    adv = dev
    if normalize_std:
        var = _group_sum(dev * dev, index, num_groups) / (count - 1.0).clamp(min=1.0)
        adv = dev / (var.sqrt()[index] + eps)
    return torch.where(valid_b & (count[index] > 1), adv, 0.0)


def rloo_advantages(rewards: Tensor, group_ids: Tensor, valid: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out: `r_i - mean of the other valid rewards in the group`.

    Same inputs and invalid/singleton handling as `group_advantages`. Returns `(N,)` float32.
    """
    n = rewards.shape[0]
    index, valid_b, num_groups = _groups(group_ids, valid, n)
    r = torch.where(valid_b, rewards.float(), 0.0)
    count = _group_sum(valid_b.float(), index, num_groups)[index]
    total = _group_sum(r, index, num_groups)[index]
    baseline = (total - r) / (count - 1.0).clamp(min=1.0)
    return torch.where(valid_b & (count > 1), r - baseline, 0.0)


def token_advantages(sequence_advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """Broadcast one advantage per sequence `(B,)` to its loss-masked tokens `(B, T)`; 0 else."""
    if sequence_advantages.shape != loss_mask.shape[:1] or loss_mask.dim() != 2:
        raise ValueError(
            f"advantages {tuple(sequence_advantages.shape)} do not match "
            f"loss_mask {tuple(loss_mask.shape)}; expected (B,) and (B, T)"
        )
    return torch.where(loss_mask != 0, sequence_advantages.float()[:, None], 0.0)


def gae(
    values: Tensor,
    rewards: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """PPO generalized advantage estimation over the sampled tokens; returns (advantages, returns).

    All inputs `(B, T)`. The time axis is the sequence of loss-masked (sampled) tokens only:
    prompt, tool output and padding are not actions, so they are skipped, and the value after
    the last sampled token of a turn is the value of the first sampled token of the next turn.
    With `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lam * A_next`; after
    the last sampled token `V_next = A_next = 0`. `returns = A + V`. Both outputs are 0 where the
    mask is 0. A nonzero reward on an unmasked token is an error: it would silently vanish.
    """
    if not (values.shape == rewards.shape == loss_mask.shape) or values.dim() != 2:
        raise ValueError(
            f"values {tuple(values.shape)}, rewards {tuple(rewards.shape)} and loss_mask "
            f"{tuple(loss_mask.shape)} must share one (B, T) shape"
        )
    mask = loss_mask != 0
    if bool((rewards.masked_fill(mask, 0.0) != 0).any()):
        raise ValueError("rewards must be placed on loss-masked tokens (e.g. the last sampled one)")
    v = values.float()
    r = rewards.float()
    batch, length = v.shape
    next_value = torch.zeros(batch, device=v.device)
    next_adv = torch.zeros(batch, device=v.device)
    adv = torch.zeros_like(v)
    for t in range(length - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a_t, 0.0)
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, a_t, next_adv)
    returns = torch.where(mask, adv + v, 0.0)
    return adv, returns


def whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize `values` to zero mean and unit (unbiased) variance over the masked entries.

    With `shift_mean=False` the mean is added back (only the scale changes). Unmasked entries are
    returned as 0.
    """
    m = mask != 0
    n = m.sum().clamp(min=1)
    x = torch.where(m, values.float(), 0.0)
    mean = x.sum() / n
    var = torch.where(m, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1)
    out = (x - mean) / (var.sqrt() + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0.0)


def distillation_advantages(
    student_logprobs: Tensor, teacher_logprobs: Tensor, loss_mask: Tensor
) -> Tensor:
    """On-policy distillation: per-token advantage `teacher - student` (negative reverse KL).

    `student_logprobs` are the logprobs of the sampled tokens under the policy that sampled them,
    `teacher_logprobs` those of the same tokens under the teacher; both `(B, T)`. Trained with a
    policy-gradient loss, this lowers the per-token reverse KL(student || teacher). 0 where the
    mask is 0.
    """
    return torch.where(loss_mask != 0, teacher_logprobs.float() - student_logprobs.float(), 0.0)


def with_teacher(
    advantages: Tensor,
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    coef: float,
    reward_weight: float,
) -> Tensor:
    """`reward_weight * advantages + coef * distillation_advantages(...)`: the reward's
    advantages (per token, any shape the logprobs have) with the teacher's per-token signal
    added. 0 where the mask is 0."""
    signal = distillation_advantages(student_logprobs, teacher_logprobs, loss_mask)
    return torch.where(loss_mask != 0, reward_weight * advantages.float() + coef * signal, 0.0)


def row_gae(
    values: Tensor, reward: float, loss_mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """`gae` of one row `(T,)` whose reward comes at its end (on its last sampled token);
    returns (advantages, returns), both 0 where the mask is 0 (all 0 for a row with no sampled
    token)."""
    mask = loss_mask.float()
    if not mask.any():
        return torch.zeros_like(mask), torch.zeros_like(mask)
    rewards = torch.zeros_like(mask)
    rewards[int(mask.nonzero().max())] = reward
    advantages, returns = gae(values[None], rewards[None], mask[None], gamma=gamma, lam=lam)
    return advantages[0], returns[0]
