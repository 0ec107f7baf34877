"""Training losses: pure functions over tensors.

Conventions shared by every function here:

- Per-token tensors are `(B, T)` and aligned as the trainer aligns them: index `i` holds the
  quantity for token `i` of `input_ids` (its logprob given tokens `< i`); see `torch_backend`.
- `mask` is the loss mask (bool, int or float; nonzero counts). Values at unmasked positions
  never reach a loss or a metric, whatever they hold.
- Every loss returns `(loss, metrics)`. `loss` is a 0-dim tensor to call `backward()` on;
  `metrics` maps names to detached 0-dim tensors.
- Micro-batching: pass `total_tokens` (loss-masked tokens in the whole batch) and `total_seqs`
  (sequences with at least one loss-masked token in the whole batch). Each micro-batch then
  returns its share of the batch loss, so summing the losses (and gradients) of all
  micro-batches gives exactly the full-batch value. Token-level metrics are shares in the same
  way (token means over the batch once summed). Left as None, the tensors given are the batch.
- Log-ratios are clamped to [-20, 20] before `exp` so one wild token cannot overflow to inf
  (whose gradient through a mask would be NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from omniloop.trainer.config import LossConfig

AggregationMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLKind = Literal["k1", "k2", "k3"]
Metrics = dict[str, Tensor]

LOG_RATIO_CLAMP = 20.0


def _check_shapes(**tensors: Tensor | None) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must share one (B, T) shape, got {shapes}")
    for name, shape in shapes.items():
        if len(shape) != 2:
            raise ValueError(f"{name} must be (B, T), got {shape}")


def _zero_unmasked(mask: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Replace entries outside the mask by 0.

    `torch.where` alone hides a NaN or inf at a masked position in the forward pass but not in
    the backward pass (0 * inf = NaN); cleaning the inputs first keeps gradients finite.
    """
    m = mask != 0
    return tuple(torch.where(m, x, 0.0) for x in tensors)


def masked_mean(values: Tensor, mask: Tensor, total: float | None = None) -> Tensor:
    """Sum of `values` where `mask` is nonzero, divided by `total` (default: the mask's count).

    An empty mask gives 0, not NaN.
    """
    m = mask != 0
    s = torch.where(m, values, 0.0).sum()
    if total is not None:
        return s / max(float(total), 1.0)
    return s / m.sum().clamp(min=1)


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: AggregationMode = "token-mean",
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> Tensor:
    """Reduce per-token `values` `(B, T)` to a scalar under `mask`.

    - `token-mean`: sum over masked tokens / number of masked tokens (`total_tokens`).
    - `seq-mean-token-mean`: per sequence, mean over its masked tokens; then sum over sequences /
      number of sequences that have masked tokens (`total_seqs`).
    - `seq-mean-token-sum`: per sequence, sum over its masked tokens; then the same mean over
      sequences.

    Sequences without masked tokens contribute nothing and are not counted.
    """
    m = mask != 0
    v = torch.where(m, values, 0.0)
    if mode == "token-mean":
        denom = max(float(total_tokens), 1.0) if total_tokens is not None else m.sum().clamp(min=1)
        return v.sum() / denom
    tokens = m.sum(-1)
    if mode == "seq-mean-token-sum":
        per_seq = v.sum(-1)
    elif mode == "seq-mean-token-mean":
        per_seq = v.sum(-1) / tokens.clamp(min=1)
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}")
    n_seqs = (
        max(float(total_seqs), 1.0) if total_seqs is not None else (tokens > 0).sum().clamp(min=1)
    )
    return per_seq.sum() / n_seqs


def _rowwise(
    fn: Callable[..., Tensor], x: Tensor, *extra: Tensor, chunk_size: int | None
) -> Tensor:
    """Apply `fn` to chunks of rows of `x` (and the matching rows of `extra`).

    When autograd is recording and there is more than one chunk, each chunk is checkpointed:
    the backward pass recomputes the chunk's fp32 temporaries instead of keeping all of them.
    """
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    extra_rows = [e.reshape(-1) for e in extra]
    n = rows.shape[0]
    if chunk_size is None or chunk_size >= n:
        return fn(rows, *extra_rows).reshape(lead)
    grad = torch.is_grad_enabled() and x.requires_grad
    outs = []
    for start in range(0, n, chunk_size):
        args = (
            rows[start : start + chunk_size],
            *(e[start : start + chunk_size] for e in extra_rows),
        )
        outs.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    return torch.cat(outs).reshape(lead)


def _logprob_rows(logits: Tensor, labels: Tensor) -> Tensor:
    z = logits.float()
    return z.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _entropy_rows(logits: Tensor) -> Tensor:
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (F.softmax(z, dim=-1) * z).sum(-1)


def token_logprobs(logits: Tensor, labels: Tensor, chunk_size: int | None = None) -> Tensor:
    """`log softmax(logits)[label]` per position, in fp32; `logits` `(..., V)`, `labels` `(...)`.

    No alignment shift happens here: row `j` of `logits` scores `labels[j]`.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    return _rowwise(_logprob_rows, logits, labels, chunk_size=chunk_size)


def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """Entropy of `softmax(logits)` per position, in fp32: `logits` `(..., V)` → `(...)`.

    Computed as `logsumexp(z) - sum(softmax(z) * z)`, `chunk_size` rows at a time.
    """
    return _rowwise(_entropy_rows, logits, chunk_size=chunk_size)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    With `d = logprobs - ref_logprobs`: `k1 = d` (unbiased, high variance, can be negative);
    `k2 = d² / 2` (biased, low variance; its gradient is that of the reverse KL);
    `k3 = exp(-d) + d - 1` (unbiased, non-negative, low variance). Schulman, "Approximating KL
    Divergence" (2020).
    """
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        neg = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kind: KLKind = "k3",
    mode: AggregationMode = "token-mean",
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> tuple[Tensor, Metrics]:
    """KL penalty against a reference policy, aggregated like the policy loss.

    Metrics: `kl` (the same estimator as a token mean).
    """
    _check_shapes(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    logprobs, ref_logprobs = _zero_unmasked(mask, logprobs, ref_logprobs)
    per_token = kl_estimate(logprobs, ref_logprobs, kind)
    loss = aggregate(per_token, mask, mode, total_tokens=total_tokens, total_seqs=total_seqs)
    return loss, {"kl": masked_mean(per_token.detach(), mask, total_tokens)}


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    mode: AggregationMode = "token-mean",
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> tuple[Tensor, Metrics]:
    """Aggregated entropy (to be *subtracted*, times a coefficient, from the loss).

    `entropy` `(B, T)` from `entropy_from_logits`, aligned like logprobs. Metrics: `entropy` (token
    mean).
    """
    _check_shapes(entropy=entropy, mask=mask)
    (entropy,) = _zero_unmasked(mask, entropy)
    value = aggregate(entropy, mask, mode, total_tokens=total_tokens, total_seqs=total_seqs)
    return value, {"entropy": masked_mean(entropy.detach(), mask, total_tokens)}


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights `min(exp(old - rollout), cap)`, detached.

    `old_logprobs` are the trainer's logprobs of the sampled tokens before the update;
    `rollout_logprobs` the engine's. The weight corrects the policy gradient for the engine
    sampling from a slightly different distribution than the trainer computes (kernels,
    precision, or stale weights); truncation bounds its variance.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be positive, got {cap}")
    log_w = (old_logprobs - rollout_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_w).clamp(max=cap)


def _ratio(logprobs: Tensor, old_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


def _finish(
    per_token: Tensor,
    mask: Tensor,
    is_weights: Tensor | None,
    mode: AggregationMode,
    total_tokens: float | None,
    total_seqs: float | None,
) -> Tensor:
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    return aggregate(per_token, mask, mode, total_tokens=total_tokens, total_seqs=total_seqs)


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    is_weights: Tensor | None = None,
    mode: AggregationMode = "token-mean",
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO/GRPO clipped surrogate with clip-higher (DAPO) and optional dual clip.

    Per token, with `r = exp(logprobs - old_logprobs)`:
    `loss = max(-A r, -A clip(r, 1 - clip_eps_low, 1 + clip_eps_high))`. With `dual_clip_c`
    (> 1), tokens with `A < 0` are further bounded: `loss = min(loss, -A c)`. A clipped token
    contributes no gradient. `is_weights` (e.g. `tis_weights`) multiply each token's loss.

    Metrics: `pg_loss`; `clipfrac` (tokens where the clip is active), split into `clipfrac_high`
    (r > 1) and `clipfrac_low` (r < 1); `dual_clipfrac`; `ppo_kl` (token mean of
    `old - logprobs`, the k1 estimate of KL(old || new)).
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    logprobs, old_logprobs, advantages = _zero_unmasked(mask, logprobs, old_logprobs, advantages)
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    log_ratio, ratio = _ratio(logprobs, old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    dual = torch.zeros_like(is_clipped)
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
    loss = _finish(per_token, mask, is_weights, mode, total_tokens, total_seqs)
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "clipfrac": masked_mean(is_clipped.float(), mask, total_tokens),
            "clipfrac_high": masked_mean((is_clipped & (ratio > 1)).float(), mask, total_tokens),
            "clipfrac_low": masked_mean((is_clipped & (ratio < 1)).float(), mask, total_tokens),
            "dual_clipfrac": masked_mean(dual.float(), mask, total_tokens),
            "ppo_kl": masked_mean(-log_ratio, mask, total_tokens),
        }
    return loss, metrics


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    is_weights: Tensor | None = None,
    mode: AggregationMode = "seq-mean-token-mean",
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> tuple[Tensor, Metrics]:
    """GSPO: the clipped surrogate on the sequence-level ratio (GSPO-token form).

    `s = exp(mean over the sequence's masked tokens of (logprobs - old_logprobs))`, the
    length-normalized sequence likelihood ratio. Each token uses
    `s_t = sg(s) * exp(logprobs_t - sg(logprobs_t))`, equal to `s` in value, with gradient
    `s * d logprobs_t`; then `loss_t = max(-A s_t, -A clip(s_t, 1 - low, 1 + high))`. With a
    per-sequence advantage this is exactly the paper's sequence-level objective; a sequence whose
    ratio leaves the band contributes no gradient at all.

    Metrics: `pg_loss`, `clipfrac` (token share of clipped sequences), `ppo_kl`.
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    logprobs, old_logprobs, advantages = _zero_unmasked(mask, logprobs, old_logprobs, advantages)
    m = mask != 0
    tokens = m.sum(-1).clamp(min=1)
    seq_log_ratio = torch.where(m, logprobs - old_logprobs, 0.0).sum(-1) / tokens
    log_s = logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]
    s = torch.exp(log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = _finish(per_token, mask, is_weights, mode, total_tokens, total_seqs)
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "clipfrac": masked_mean((clipped > unclipped).float(), mask, total_tokens),
            "ppo_kl": masked_mean(old_logprobs - logprobs, mask, total_tokens),
        }
    return loss, metrics


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 1.0,
    clip_eps_high: float = 0.28,
    is_weights: Tensor | None = None,
    mode: AggregationMode = "token-mean",
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> tuple[Tensor, Metrics]:
    """CISPO: `loss_t = -sg(clip(r, 1 - low, 1 + high)) * A * logprobs_t` (MiniMax-M1).

    The importance weight is clipped and detached instead of the surrogate, so every token keeps
    a gradient (`-w A` with respect to its logprob), including those whose ratio left the band.
    `clip_eps_low=1` leaves the weight unbounded below, as in the paper. The loss *value* is
    not a surrogate of the return (it contains `logprobs` itself); only its gradient matters.

    Metrics: `pg_loss`, `clipfrac` (tokens whose weight was clipped), `ppo_kl`.
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    logprobs, old_logprobs, advantages = _zero_unmasked(mask, logprobs, old_logprobs, advantages)
    log_ratio, ratio = _ratio(logprobs, old_logprobs)
    weight = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high).detach()
    per_token = -weight * advantages * logprobs
    loss = _finish(per_token, mask, is_weights, mode, total_tokens, total_seqs)
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "clipfrac": masked_mean((weight != ratio).float(), mask, total_tokens),
            "ppo_kl": masked_mean(-log_ratio, mask, total_tokens),
        }
    return loss, metrics


def sapo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    is_weights: Tensor | None = None,
    mode: AggregationMode = "seq-mean-token-mean",
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> tuple[Tensor, Metrics]:
    """SAPO: a smooth gate instead of a hard clip (Soft Adaptive Policy Optimization).

    `loss_t = -A f(r)` with `f(r) = (4 / tau) * sigmoid(tau * (r - 1))`, `tau = tau_pos` where
    `A > 0` else `tau_neg`. At `r = 1`, `f' = 1` (the ordinary policy gradient); away from 1 the
    gradient decays smoothly instead of dropping to 0.

    Metrics: `pg_loss`, `ppo_kl`.
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    logprobs, old_logprobs, advantages = _zero_unmasked(mask, logprobs, old_logprobs, advantages)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be positive, got {tau_pos}, {tau_neg}")
    log_ratio, ratio = _ratio(logprobs, old_logprobs)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    per_token = -advantages * gate
    loss = _finish(per_token, mask, is_weights, mode, total_tokens, total_seqs)
    with torch.no_grad():
        metrics = {"pg_loss": loss.detach(), "ppo_kl": masked_mean(-log_ratio, mask, total_tokens)}
    return loss, metrics


def rl_loss(
    config: LossConfig,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> tuple[Tensor, Metrics]:
    """The full objective of `config`: policy loss (with TIS) + KL penalty - entropy bonus.

    `rollout_logprobs` are needed when `config.tis_cap` is set; `ref_logprobs` when
    `config.kl_coef > 0`. Without a coefficient, a given `ref_logprobs` or `entropy` is only
    measured. Metrics: those of the policy loss, plus `loss`, `kl`, `kl_loss`, `entropy`,
    `tis_weight_mean`, `tis_capped_frac`, and `rollout_k3` (k3 estimate of
    KL(engine || trainer) on the sampled tokens, from `rollout_logprobs` and `old_logprobs`).
    """
    _check_shapes(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        mask=mask,
        rollout_logprobs=rollout_logprobs,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
    )
    if rollout_logprobs is not None:
        (rollout_logprobs,) = _zero_unmasked(mask, rollout_logprobs)
    metrics: Metrics = {}
    scale = {"total_tokens": total_tokens, "total_seqs": total_seqs}
    is_weights: Tensor | None = None
    if config.tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap is set but no rollout_logprobs were given")
        (old_clean,) = _zero_unmasked(mask, old_logprobs)
        is_weights = tis_weights(old_clean, rollout_logprobs, config.tis_cap)
        metrics["tis_weight_mean"] = masked_mean(is_weights, mask, total_tokens)
        metrics["tis_capped_frac"] = masked_mean(
            (is_weights >= config.tis_cap).float(), mask, total_tokens
        )
    if rollout_logprobs is not None:
        with torch.no_grad():
            (old_clean,) = _zero_unmasked(mask, old_logprobs.detach())
            mismatch = kl_estimate(rollout_logprobs, old_clean, "k3")
            metrics["rollout_k3"] = masked_mean(mismatch, mask, total_tokens)

    agg = config.aggregation
    if config.policy_loss == "ppo":
        loss, pg_metrics = ppo_policy_loss(
            logprobs, old_logprobs, advantages, mask,
            clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high,
            dual_clip_c=config.dual_clip_c, is_weights=is_weights, mode=agg, **scale,
        )  # fmt: skip
    elif config.policy_loss == "gspo":
        loss, pg_metrics = gspo_policy_loss(
            logprobs, old_logprobs, advantages, mask,
            clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high,
            is_weights=is_weights, mode=agg, **scale,
        )  # fmt: skip
    elif config.policy_loss == "cispo":
        loss, pg_metrics = cispo_policy_loss(
            logprobs, old_logprobs, advantages, mask,
            clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high,
            is_weights=is_weights, mode=agg, **scale,
        )  # fmt: skip
    elif config.policy_loss == "sapo":
        loss, pg_metrics = sapo_policy_loss(
            logprobs, old_logprobs, advantages, mask,
            tau_pos=config.sapo_tau_pos, tau_neg=config.sapo_tau_neg,
            is_weights=is_weights, mode=agg, **scale,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown policy loss {config.policy_loss!r}")
    metrics.update(pg_metrics)

    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if ref_logprobs is not None:
        kl, kl_metrics = kl_loss(logprobs, ref_logprobs, mask, config.kl_type, agg, **scale)
        metrics.update(kl_metrics)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl
            metrics["kl_loss"] = kl.detach()
    if entropy is not None:
        ent, ent_metrics = entropy_bonus(entropy, mask, agg, **scale)
        metrics.update(ent_metrics)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * ent
    metrics["loss"] = loss.detach()
    return loss, metrics
