"""Losses against numbers worked out by hand in each test, plus gradient checks."""

from __future__ import annotations

import math

import pytest
import torch

from omniloop.trainer.config import LossConfig
from omniloop.trainer.losses import (
    aggregate,
    cispo_policy_loss,
    entropy_from_logits,
    gspo_policy_loss,
    kl_estimate,
    kl_loss,
    ppo_policy_loss,
    rl_loss,
    sapo_policy_loss,
    tis_weights,
    token_logprobs,
)

torch.set_num_threads(1)


def t(values: list[float] | list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def close(
    actual: torch.Tensor, expected: float | list[float] | list[list[float]] | torch.Tensor
) -> None:
    if not isinstance(expected, torch.Tensor):
        expected = torch.tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.detach(), expected.detach(), atol=1e-5, rtol=0)


def logs(ratios: list[float]) -> torch.Tensor:
    """Logprobs giving these ratios against old logprobs of 0, as a leaf needing grad."""
    return t([[math.log(r) for r in ratios]]).requires_grad_(True)


# -- aggregation -------------------------------------------------------------------------------

VALUES = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]  # the last row has nothing to train


AGGREGATES = [
    ("token-mean", (1 + 2 + 4) / 3),
    ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
    ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
]


@pytest.mark.parametrize(("mode", "expected"), AGGREGATES)
def test_aggregation_modes(mode: str, expected: float) -> None:
    close(aggregate(t(VALUES), torch.tensor(MASK), mode), expected)


@pytest.mark.parametrize(("mode", "expected"), AGGREGATES)
def test_aggregation_ignores_whatever_masked_positions_hold(mode: str, expected: float) -> None:
    values = t(VALUES)
    values[0, 2] = float("nan")
    values[2] = float("inf")
    close(aggregate(values, torch.tensor(MASK), mode), expected)


@pytest.mark.parametrize(("mode", "expected"), AGGREGATES)
def test_aggregation_shares_of_micro_batches_sum_to_the_batch(mode: str, expected: float) -> None:
    values, mask = t(VALUES), torch.tensor(MASK)
    # The whole batch has 3 masked tokens in 2 sequences that have any.
    first = aggregate(values[:1], mask[:1], mode, total_tokens=3.0, total_seqs=2.0)
    rest = aggregate(values[1:], mask[1:], mode, total_tokens=3.0, total_seqs=2.0)
    close(first + rest, expected)


# -- PPO / GRPO clipped surrogate --------------------------------------------------------------


def test_ppo_clip_and_clip_higher_by_hand() -> None:
    lp = logs([0.5, 1.0, 1.3, 1.1, 0.5])
    adv = t([[1.0, 1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 5)
    loss, m = ppo_policy_loss(
        lp, torch.zeros(1, 5), adv, mask, clip_eps_low=0.2, clip_eps_high=0.28
    )
    # Band [0.8, 1.28]. Per token max(-A r, -A clip(r)):
    #   r=0.5, A=+1: max(-0.5, -0.8) = -0.5   (a low ratio with A > 0 is not clipped)
    #   r=1.0, A=+1: -1
    #   r=1.3, A=+1: max(-1.3, -1.28) = -1.28 (clipped high)
    #   r=1.1, A=-1: max(1.1, 1.1) = 1.1
    #   r=0.5, A=-1: max(0.5, 0.8) = 0.8      (clipped low)
    close(loss, (-0.5 - 1.0 - 1.28 + 1.1 + 0.8) / 5)
    close(m["clipfrac"], 2 / 5)
    close(m["clipfrac_high"], 1 / 5)
    close(m["clipfrac_low"], 1 / 5)
    close(m["ppo_kl"], -(math.log(0.5) + math.log(1.3) + math.log(1.1) + math.log(0.5)) / 5)
    loss.backward()
    # d(-A r)/d logprob = -A r; clipped tokens get exactly 0.
    assert lp.grad is not None
    close(lp.grad, [[-0.5 / 5, -1.0 / 5, 0.0, 1.1 / 5, 0.0]])


def test_ppo_dual_clip_bounds_negative_advantage_tokens() -> None:
    lp = logs([4.0, 2.0, 4.0])
    adv = t([[-1.0, -1.0, 1.0]])
    loss, m = ppo_policy_loss(lp, torch.zeros(1, 3), adv, torch.ones(1, 3), dual_clip_c=3.0)
    # r=4, A=-1: max(4, 1.2) = 4, bounded by -A c = 3 -> 3 (no gradient)
    # r=2, A=-1: max(2, 1.2) = 2 < 3 -> 2
    # r=4, A=+1: max(-4, -1.2) = -1.2 (ordinary clip; the dual clip is for A < 0 only)
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    close(m["dual_clipfrac"], 1 / 3)
    loss.backward()
    assert lp.grad is not None
    close(lp.grad, [[0.0, 2.0 / 3, 0.0]])


def test_ppo_rejects_dual_clip_at_or_below_one() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_policy_loss(x, x, x, x, dual_clip_c=1.0)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo", "sapo"])
def test_masked_tokens_get_no_gradient_whatever_they_hold(policy_loss: str) -> None:
    lp = torch.zeros(1, 3, requires_grad=True)
    adv = t([[float("inf"), 1.0, float("nan")]])
    garbage = t([[float("nan"), 0.0, float("-inf")]])
    config = LossConfig(policy_loss=policy_loss, kl_coef=0.1, tis_cap=2.0)
    mask = torch.tensor([[0, 1, 0]])
    loss, metrics = rl_loss(
        config, lp, garbage, adv, mask, rollout_logprobs=garbage, ref_logprobs=garbage,
        entropy=garbage,
    )  # fmt: skip
    loss.backward()
    assert lp.grad is not None
    assert bool(torch.isfinite(lp.grad).all())
    assert lp.grad[0, 0] == 0
    assert lp.grad[0, 2] == 0
    assert lp.grad[0, 1] < 0  # the one trained token, with A = 1, is pushed up
    assert all(bool(torch.isfinite(v)) for v in metrics.values())


# -- truncated importance sampling -------------------------------------------------------------


def test_tis_weights_are_truncated_and_detached() -> None:
    old = t([[0.5, -0.2, 0.0]]).requires_grad_(True)
    rollout = torch.zeros(1, 3, requires_grad=True)
    w = tis_weights(old, rollout, cap=1.5)
    # exp(0.5) = 1.6487 -> capped at 1.5; exp(-0.2) = 0.81873; exp(0) = 1.
    close(w, [[1.5, 0.8187308, 1.0]])
    assert not w.requires_grad


def test_tis_multiplies_the_policy_loss() -> None:
    old = t([[0.5, -0.2, 0.0]])
    lp = old.clone().requires_grad_(True)  # ratio 1: the surrogate is -A per token
    adv = t([[1.0, 1.0, 2.0]])
    config = LossConfig(tis_cap=1.5)
    loss, m = rl_loss(config, lp, old, adv, torch.ones(1, 3), rollout_logprobs=torch.zeros(1, 3))
    # Per token -A * w: [-1.5, -0.8187308, -2.0]
    close(loss, -(1.5 + 0.8187308 + 2.0) / 3)
    close(m["tis_weight_mean"], (1.5 + 0.8187308 + 1.0) / 3)
    close(m["tis_capped_frac"], 1 / 3)
    loss.backward()
    assert lp.grad is not None
    close(lp.grad, [[-1.5 / 3, -0.8187308 / 3, -2.0 / 3]])


def test_tis_without_rollout_logprobs_is_an_error() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        rl_loss(LossConfig(tis_cap=2.0), x, x, x, torch.ones(1, 2))


# -- KL ----------------------------------------------------------------------------------------


def test_kl_estimators_by_hand() -> None:
    lp, ref = t([[0.0, -1.0]]), t([[-0.5, 0.0]])  # d = lp - ref = [0.5, -1]
    close(kl_estimate(lp, ref, "k1"), [[0.5, -1.0]])
    close(kl_estimate(lp, ref, "k2"), [[0.125, 0.5]])  # d^2 / 2
    # k3 = exp(-d) + d - 1: exp(-0.5) + 0.5 - 1 = 0.1065307; exp(1) - 1 - 1 = 0.7182818
    close(kl_estimate(lp, ref, "k3"), [[0.1065307, 0.7182818]])


def test_k3_gradient_by_hand() -> None:
    lp = t([[0.0, -1.0]]).requires_grad_(True)
    loss, m = kl_loss(lp, t([[-0.5, 0.0]]), torch.ones(1, 2), "k3")
    close(m["kl"], (0.1065307 + 0.7182818) / 2)
    loss.backward()
    # d k3 / d lp = 1 - exp(-d): 1 - exp(-0.5) = 0.3934693; 1 - e = -1.7182818; token mean / 2.
    assert lp.grad is not None
    close(lp.grad, [[0.3934693 / 2, -1.7182818 / 2]])


def test_k3_is_never_negative_and_zero_at_equality() -> None:
    lp = t([[-3.0, -1.0, 0.0, 2.0]])
    assert bool((kl_estimate(lp, torch.zeros(1, 4), "k3") >= 0).all())
    close(kl_estimate(lp, lp, "k3"), [[0.0, 0.0, 0.0, 0.0]])


# -- logprobs and entropy from logits ----------------------------------------------------------


def test_token_logprobs_by_hand() -> None:
    logits = t([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])  # softmax = [0.25, 0.75]
    close(token_logprobs(logits, torch.tensor([1, 0])), [-0.2876821, -1.3862944])


def test_entropy_by_hand() -> None:
    logits = t([[0.0, 0.0], [0.0, math.log(3.0)]])
    # ln 2; -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.3465736 + 0.2157616
    close(entropy_from_logits(logits), [0.6931472, 0.5623351])


@pytest.mark.parametrize("fn", ["entropy", "logprobs"])
def test_chunked_computation_equals_unchunked_in_value_and_gradient(fn: str) -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    results = []
    for chunk in (None, 3):
        logits = base.clone().requires_grad_(True)
        if fn == "entropy":
            out = entropy_from_logits(logits, chunk_size=chunk)
        else:
            out = token_logprobs(logits, labels, chunk_size=chunk)
        (out * torch.arange(10.0).reshape(2, 5)).sum().backward()
        assert logits.grad is not None
        results.append((out.detach(), logits.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


# -- GSPO, CISPO, SAPO -------------------------------------------------------------------------


def test_gspo_uses_one_ratio_per_sequence() -> None:
    lp = t([[0.1, 0.3], [-0.2, 0.0]]).requires_grad_(True)
    adv = t([[1.0, 1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, m = gspo_policy_loss(
        lp, torch.zeros(2, 2), adv, mask, clip_eps_low=0.2, clip_eps_high=0.3
    )
    # Sequence 0: s = exp((0.1 + 0.3) / 2) = exp(0.2) = 1.2214028, inside [0.8, 1.3]: -A s.
    # Sequence 1: s = exp(-0.2) = 0.8187308, A = -1: max(0.8187, 0.8187) = 0.8187.
    # seq-mean-token-mean: (-1.2214028 + 0.8187308) / 2.
    close(loss, (-1.2214028 + 0.8187308) / 2)
    close(m["clipfrac"], 0.0)
    loss.backward()
    # Each token of sequence 0 gets -A s / L / num_seqs, the same for both tokens although
    # their token ratios differ: -1.2214028 / 2 / 2. Sequence 1: +0.8187308 / 1 / 2.
    assert lp.grad is not None
    close(lp.grad, [[-1.2214028 / 4, -1.2214028 / 4], [0.8187308 / 2, 0.0]])


def test_gspo_clipped_sequence_gets_no_gradient() -> None:
    lp = t([[0.1, 0.3]]).requires_grad_(True)
    loss, m = gspo_policy_loss(
        lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), clip_eps_high=0.2
    )
    close(loss, -1.2)  # s = 1.2214 clipped to 1.2
    close(m["clipfrac"], 1.0)
    loss.backward()
    assert lp.grad is not None
    close(lp.grad, [[0.0, 0.0]])


def test_cispo_clips_a_detached_weight_and_keeps_every_gradient() -> None:
    lp = logs([1.5, 0.5, 1.0])
    adv = t([[1.0, 1.0, -1.0]])
    loss, m = cispo_policy_loss(
        lp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_eps_low=0.2, clip_eps_high=0.28
    )
    # Weights clip(r, 0.8, 1.28) = [1.28, 0.8, 1.0]; per token -w A logprob.
    per_token = [-1.28 * math.log(1.5), -0.8 * math.log(0.5), 0.0]
    close(loss, sum(per_token) / 3)
    close(m["clipfrac"], 2 / 3)
    loss.backward()
    # Gradient -w A per token, nonzero even where the weight was clipped.
    assert lp.grad is not None
    close(lp.grad, [[-1.28 / 3, -0.8 / 3, 1.0 / 3]])


def test_sapo_soft_gate_by_hand() -> None:
    lp = t([[0.0, 0.5]]).requires_grad_(True)
    adv = t([[1.0, -1.0]])
    loss, _ = sapo_policy_loss(
        lp, torch.zeros(1, 2), adv, torch.ones(1, 2), tau_pos=1.0, tau_neg=1.05, mode="token-mean"
    )
    # Token 0: r = 1, tau = 1: gate = sigmoid(0) * 4 = 2, loss -2, d gate/dr = 4 * 0.25 = 1.
    # Token 1: r = exp(0.5), tau = 1.05: x = 1.05 (r - 1), sigma = 1 / (1 + exp(-x)).
    r = math.exp(0.5)
    sigma = 1.0 / (1.0 + math.exp(-1.05 * (r - 1.0)))
    gate1 = sigma * 4.0 / 1.05
    close(loss, (-2.0 + gate1) / 2)
    loss.backward()
    # d loss / d lp = -A * (4 / tau) * sigma (1 - sigma) * tau * r = -A * 4 sigma (1 - sigma) r.
    assert lp.grad is not None
    close(lp.grad, [[-1.0 / 2, 4.0 * sigma * (1.0 - sigma) * r / 2]])


# -- the combined objective --------------------------------------------------------------------


def test_rl_loss_adds_kl_and_subtracts_entropy() -> None:
    lp = t([[0.0, -1.0]])
    config = LossConfig(kl_coef=0.1, kl_type="k2", entropy_coef=0.01)
    loss, m = rl_loss(
        config,
        lp,
        lp,
        t([[1.0, 0.5]]),
        torch.ones(1, 2),
        ref_logprobs=t([[-0.5, 0.0]]),
        entropy=t([[2.0, 1.0]]),
    )
    # policy: ratio 1 -> -(1 + 0.5) / 2 = -0.75; k2 of d = [0.5, -1] -> (0.125 + 0.5) / 2 = 0.3125;
    # entropy (2 + 1) / 2 = 1.5. Total -0.75 + 0.1 * 0.3125 - 0.01 * 1.5.
    close(loss, -0.75 + 0.03125 - 0.015)
    close(m["pg_loss"], -0.75)
    close(m["kl"], 0.3125)
    close(m["entropy"], 1.5)


def test_rl_loss_with_kl_coef_needs_reference_logprobs() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_loss(LossConfig(kl_coef=0.1), x, x, x, torch.ones(1, 2))


def test_rl_loss_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="one \\(B, T\\) shape"):
        rl_loss(
            LossConfig(), torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 2)
        )


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo", "sapo"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_losses_and_gradients_sum_to_the_full_batch(
    policy_loss: str, aggregation: str
) -> None:
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 6, generator=gen) * 3
    base = old + 0.3 * torch.randn(4, 6, generator=gen)
    adv = torch.randn(4, 6, generator=gen)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    mask[:, 0] = 0
    mask[2] = 0  # a sequence with nothing to train
    ref = old + 0.1
    ent = torch.rand(4, 6, generator=gen)
    config = LossConfig(
        policy_loss=policy_loss,
        aggregation=aggregation,
        kl_coef=0.05,
        entropy_coef=0.01,
        tis_cap=1.5,
        dual_clip_c=3.0 if policy_loss == "ppo" else None,
    )
    rollout = old + 0.05
    full_lp = base.clone().requires_grad_(True)
    full, _ = rl_loss(
        config, full_lp, old, adv, mask, rollout_logprobs=rollout, ref_logprobs=ref, entropy=ent
    )
    full.backward()
    totals = {"total_tokens": float(mask.sum()), "total_seqs": float((mask.sum(-1) > 0).sum())}
    split_lp = base.clone().requires_grad_(True)
    parts = torch.zeros(())
    for rows in (slice(0, 1), slice(1, 4)):
        part, _ = rl_loss(
            config,
            split_lp[rows],
            old[rows],
            adv[rows],
            mask[rows],
            rollout_logprobs=rollout[rows],
            ref_logprobs=ref[rows],
            entropy=ent[rows],
            **totals,
        )
        part.backward()
        parts = parts + part.detach()
    torch.testing.assert_close(parts, full.detach())
    torch.testing.assert_close(split_lp.grad, full_lp.grad)


def test_trained_tokens_are_scored_from_the_logits_before_them() -> None:
    from omniloop.trainer.torch_backend import at_tokens, shifted_logprobs, trained_tokens

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, requires_grad=True)
    ids = torch.randint(0, 50, (3, 7))
    mask = torch.tensor(
        [[0, 0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]],
        dtype=torch.float32,
    )
    rows, positions = trained_tokens(mask)
    # Token i was drawn from the distribution at i - 1.
    picked = logits[rows, positions - 1]
    got_lp = at_tokens(token_logprobs(picked, ids[rows, positions]), rows, positions, mask.shape)
    got_entropy = at_tokens(entropy_from_logits(picked), rows, positions, mask.shape)
    every_lp = shifted_logprobs(logits, ids, torch.ones_like(ids))
    every_entropy = torch.nn.functional.pad(entropy_from_logits(logits)[:, :-1], (1, 0))
    torch.testing.assert_close(got_lp, torch.where(mask != 0, every_lp, 0.0))
    torch.testing.assert_close(got_entropy, torch.where(mask != 0, every_entropy, 0.0))
    (got_lp + got_entropy).sum().backward()
    assert logits.grad is not None
    seen = logits.grad.clone()
    logits.grad = None
    (torch.where(mask != 0, every_lp + every_entropy, 0.0)).sum().backward()
    torch.testing.assert_close(seen, logits.grad)
    assert not seen[2].any(), "a row with nothing masked was scored"
