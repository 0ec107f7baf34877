"""The trainer backends' contract, on the tiny random Llama, for each `trainer.backend` (the
Hugging Face model and megatron-core's `GPTModel`): alignment, invariances, learning,
checkpoints, exported weights."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from omniloop.trainer.backend import TrainerBackend
from omniloop.trainer.batch import batch_from_trajectories
from omniloop.trainer.config import AdvantageConfig, LossConfig, TrainerConfig
from omniloop.trainer.torch_backend import TorchTrainerBackend
from omniloop.trajectory import TrajectoryBuilder, TrajectoryMeta

BackendFactory = Callable[..., TorchTrainerBackend]


@pytest.fixture(params=["torch", "megatron"])
def backend(request: pytest.FixtureRequest) -> BackendFactory:
    """`backend(**trainer_config)`: a trainer of the tiny model with the parametrized policy."""

    def build(**config: object) -> TorchTrainerBackend:
        settings = {"device": "cpu", "backend": request.param, **config}
        return TorchTrainerBackend("tiny", TrainerConfig.model_validate(settings))

    return build


def checkpointing(b: TorchTrainerBackend) -> bool:
    """Whether the policy recomputes activations in the backward pass."""
    model: Any = b.model
    if b.config.backend == "megatron":
        return bool(model.gpt.config.recompute_granularity == "full")
    return bool(model.is_activation_checkpointing)


def grads(b: TorchTrainerBackend) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in b.model.named_parameters():
        assert p.grad is not None, name
        out[name] = p.grad.clone()
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name, **tol)  # type: ignore[arg-type]


def test_implements_the_protocol(backend: BackendFactory) -> None:
    assert isinstance(backend(), TrainerBackend)


def test_logprobs_are_aligned_to_the_token_they_score(
    backend: BackendFactory, tiny_model: Path, make_batch
) -> None:
    batch = make_batch([12])
    ids = batch.input_ids[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=ids[None]).logits[0]
    # Token i is scored by the distribution at position i - 1; token 0 has no logprob.
    manual = [0.0] + [
        torch.log_softmax(logits[i - 1], dim=-1)[ids[i]].item() for i in range(1, len(ids))
    ]
    got = backend().logprobs(batch)
    torch.testing.assert_close(got[0], torch.tensor(manual), atol=1e-5, rtol=0)


def test_padding_does_not_change_a_sequences_logprobs(backend: BackendFactory, make_batch) -> None:
    b = backend(micro_batch_size=4)
    batch = make_batch([9, 23, 15], seed=3)
    together = b.logprobs(batch)
    for row, n in enumerate([9, 23, 15]):
        alone = b.logprobs(batch.select([row]))
        torch.testing.assert_close(together[row, :n], alone[0, :n], atol=1e-5, rtol=0)
        assert bool((together[row, n:] == 0).all())


def embedded_tokens(b: TorchTrainerBackend) -> list[int]:
    """Per forward of `b`'s policy from now on, the token ids it embeds that are not 0 (the
    padding id of `make_batch`'s rows and of packed rows' room)."""
    seen: list[int] = []
    for name, module in b.model.named_modules():
        if name.endswith(("embed_tokens", "word_embeddings")):
            module.register_forward_pre_hook(lambda _, args: seen.append(int((args[0] != 0).sum())))
    return seen


def test_rows_sharing_an_opening_hold_it_once_and_train_as_padded_rows(
    backend: BackendFactory, make_batch
) -> None:
    """A GRPO group (four rows opening with the same 20 tokens, two of them equal) beside two
    rows of their own, in one micro-batch: packed with the opening held once
    (`trainer.pack_sequences`, the default), the logprobs and the gradient of the padded
    batch, from fewer embedded tokens."""
    lengths = [26, 31, 24, 26, 9, 17]
    batch = make_batch(lengths, prompt=20, advantages=[1.0, -0.5, 0.7, 0.2, -1.0, 0.4], seed=13)
    ids = batch.input_ids.clone()
    ids[1:3, :20] = ids[0, :20]
    ids[3] = ids[0]
    batch = batch.replace(input_ids=ids)
    results = []
    for pack in (True, False):
        b = backend(micro_batch_size=6, grad_clip=None, lr=1e-3, pack_sequences=pack)
        seen = embedded_tokens(b)
        logprobs = b.logprobs(batch)
        metrics = b.train_step(batch)
        results.append((logprobs, metrics, grads(b), seen))
    (packed_lp, packed_metrics, packed_grads, packed_seen) = results[0]
    (padded_lp, padded_metrics, padded_grads, padded_seen) = results[1]
    assert padded_seen == [sum(lengths)] * 2
    assert packed_seen == [sum(lengths) - 20 - 20 - 26] * 2  # rows 1, 2, 3 read row 0's opening
    torch.testing.assert_close(packed_lp, padded_lp, atol=1e-5, rtol=0)
    assert packed_metrics["actor/loss"] == pytest.approx(padded_metrics["actor/loss"], abs=1e-6)
    assert_same_tensors(packed_grads, padded_grads, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_eager_attention_packs_too_and_a_narrow_sliding_window_does_not(
    backend: BackendFactory, make_batch
) -> None:
    """A Hugging Face model with `eager` attention takes the packed rows' mask as an additive
    float (sdpa a boolean): the same logprobs from fewer tokens. A model whose sliding window
    is narrower than the packed rows runs padded (a given mask would replace the window)."""
    batch = make_batch([26, 26, 9], prompt=20, seed=17)
    ids = batch.input_ids.clone()
    ids[1, :20] = ids[0, :20]
    batch = batch.replace(input_ids=ids)
    b = backend(micro_batch_size=3)
    seen = embedded_tokens(b)
    sdpa = b.logprobs(batch)
    b.model.config._attn_implementation = "eager"
    eager = b.logprobs(batch)
    b.model.config.sliding_window = 30
    windowed = b.logprobs(batch)
    assert seen == [61 - 20, 61 - 20, 61]
    torch.testing.assert_close(eager, sdpa, atol=1e-5, rtol=0)
    torch.testing.assert_close(windowed, sdpa, atol=1e-5, rtol=0)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batching_gives_the_full_batch_gradient(
    backend: BackendFactory, make_batch, aggregation: str
) -> None:
    batch = make_batch([10, 19, 7, 14], advantages=[1.0, -0.5, 2.0, -1.5], seed=5)
    results = []
    cuts: list[dict[str, int]] = [
        {"micro_batch_size": 4},
        {"micro_batch_size": 2},
        {"micro_batch_size": 1},
        {"micro_batch_tokens": 30},
    ]
    for cut in cuts:
        b = backend(**cut, grad_clip=None, loss={"aggregation": aggregation}, lr=1e-3)
        metrics = b.train_step(batch)
        results.append((metrics, grads(b)))
    full_metrics, full_grads = results[0]
    for metrics, g in results[1:]:
        # Summation order differs between micro-batch splits (and with the thread count):
        # ~1e-5 at gradients of scale ~1; a wrong normaliser is off by the scale itself.
        assert_same_tensors(full_grads, g, atol=3e-5, rtol=1e-4)
        assert metrics["actor/loss"] == pytest.approx(full_metrics["actor/loss"], abs=1e-6)
        assert metrics["actor/entropy"] == pytest.approx(full_metrics["actor/entropy"], rel=1e-5)


def test_a_token_budget_cuts_a_step_into_passes_of_at_most_that_many_tokens(
    backend: BackendFactory, make_batch
) -> None:
    """`trainer.micro_batch_tokens`: the logprobs and the step run in passes of at most 30
    tokens each (rows of 3 to 25 tokens, 78 in all), every token in exactly one pass, fewer
    passes than rows; the logprobs are those of one row per pass."""
    lengths = [10, 19, 7, 14, 25, 3]
    batch = make_batch(lengths, seed=7)
    b = backend(micro_batch_tokens=30)
    seen = embedded_tokens(b)
    logprobs = b.logprobs(batch)
    scored, seen[:] = list(seen), []
    b.train_step(batch)
    for passes in (scored, seen):
        assert max(passes) <= 30
        assert sum(passes) == sum(lengths)
        assert 3 <= len(passes) < len(lengths)
    torch.testing.assert_close(
        logprobs, backend(micro_batch_size=1).logprobs(batch), atol=1e-5, rtol=0
    )


def test_train_step_raises_probability_of_positive_advantage_tokens(
    backend: BackendFactory, make_batch
) -> None:
    b = backend(lr=1e-3, micro_batch_size=2)
    batch = make_batch([12, 16, 10], seed=7)
    before = b.logprobs(batch)
    # Fixed pi_old, so the surrogate loss -A * ratio can move across steps.
    batch = batch.replace(old_logprobs=before)
    losses = [b.train_step(batch)["actor/pg_loss"] for _ in range(3)]
    after = b.logprobs(batch)
    mask = batch.loss_mask.bool()
    assert after[mask].mean() > before[mask].mean() + 0.01
    assert losses[0] == pytest.approx(-1.0, abs=1e-6)  # ratio 1 at the first step
    assert losses[2] < losses[1] < losses[0]
    assert b.version == 3


def test_tokens_outside_the_loss_mask_do_not_affect_the_update(
    backend: BackendFactory, make_batch
) -> None:
    batch = make_batch([11, 14], advantages=[1.0, -1.0], seed=9)
    outside = batch.loss_mask == 0
    garbage = batch.replace(
        advantages=torch.where(outside, 1e6, batch.advantages),
        rollout_logprobs=torch.where(outside, -50.0, batch.rollout_logprobs),
    )
    results = []
    for b_ in (batch, garbage):
        b = backend(grad_clip=None)
        b.train_step(b_)
        results.append(grads(b))
    assert_same_tensors(results[0], results[1], atol=0.0, rtol=0.0)


def test_only_trained_tokens_pass_the_output_layer_and_the_gradient_is_unchanged(
    backend: BackendFactory,
    make_batch,
) -> None:
    """The step scores the loss-masked tokens alone (`Scorer.token_logits`); its gradient is
    that of the loss over the whole logits (with entropy and a KL penalty in the loss)."""
    from omniloop.trainer.losses import entropy_from_logits, rl_loss
    from omniloop.trainer.torch_backend import shifted_logprobs

    batch = make_batch([11, 17, 6], prompt=5, advantages=[1.0, -0.5, 0.7], seed=11)
    config = {"grad_clip": None, "loss": {"entropy_coef": 0.01, "kl_coef": 0.1}}
    stepped = backend(**config)
    stepped.train_step(batch)
    got = grads(stepped)

    whole = backend(**config)
    whole.model.zero_grad()
    logits = whole.scorer.logits(whole.model, batch)
    with torch.no_grad():
        assert whole.reference is not None
        ref_logits = whole.scorer.logits(whole.reference, batch)
    lp = shifted_logprobs(logits, batch.input_ids, batch.attention_mask)
    ref = shifted_logprobs(ref_logits, batch.input_ids, batch.attention_mask)
    entropy = torch.nn.functional.pad(entropy_from_logits(logits)[:, :-1], (1, 0))
    loss, _ = rl_loss(
        whole.config.loss,
        lp,
        lp.detach(),
        batch.advantages,
        batch.loss_mask,
        rollout_logprobs=batch.rollout_logprobs,
        ref_logprobs=ref,
        entropy=entropy,
        total_tokens=float(batch.loss_mask.sum()),
        total_seqs=float(len(batch)),
    )
    loss.backward()
    assert_same_tensors(got, grads(whole), atol=1e-5, rtol=1e-4)


def test_save_then_load_restores_weights_optimizer_and_version(
    backend: BackendFactory, tmp_path: Path, make_batch
) -> None:
    batch = make_batch([10, 13], advantages=[1.0, -1.0], seed=11)
    a = backend(lr=1e-3, warmup_steps=5)
    a.train_step(batch)
    a.train_step(batch)
    a.save(tmp_path / "ckpt", data_position={"epoch": 1, "offset": 64})

    b = backend(lr=1e-3, warmup_steps=5)
    assert b.load(tmp_path / "ckpt") == {"epoch": 1, "offset": 64}
    assert b.version == 2
    assert_same_tensors(dict(a.named_weights()), dict(b.named_weights()), atol=0.0, rtol=0.0)
    state_a, state_b = a.optimizer.state_dict(), b.optimizer.state_dict()
    for key, slot in state_a["state"].items():
        for name, value in slot.items():
            torch.testing.assert_close(state_b["state"][key][name], value, atol=0.0, rtol=0.0)
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]

    # The resumed run continues exactly: a fresh optimizer (new moments, warm-up from the
    # start) would take a different step.
    a.train_step(batch)
    b.train_step(batch)
    assert b.version == 3
    assert_same_tensors(dict(a.named_weights()), dict(b.named_weights()), atol=0.0, rtol=0.0)


def test_save_hf_writes_a_folder_transformers_loads(
    backend: BackendFactory, tmp_path: Path, make_batch
) -> None:
    b = backend(lr=1e-3)
    b.train_step(make_batch([9, 12]))
    b.save_hf(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template
    weights = dict(b.named_weights())
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(weights)
    assert_same_tensors(
        weights, {n: p.detach() for n, p in loaded.named_parameters()}, atol=0.0, rtol=0.0
    )


# megatron refuses bf16, and gradient checkpointing on the CPU (test_megatron_backend.py).
@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_bf16_autocast_trains_over_fp32_weights(backend: BackendFactory, make_batch) -> None:
    batch = make_batch([10, 14], seed=13)
    b = backend(dtype="bf16", lr=1e-3)
    fp32_logprobs = backend().logprobs(batch)
    bf16_logprobs = b.logprobs(batch)
    mask = batch.attention_mask.bool()
    # bf16 keeps ~3 significant digits; on this model logprobs agree to ~1e-3.
    assert (bf16_logprobs[mask] - fp32_logprobs[mask]).abs().max() < 0.02
    metrics = b.train_step(batch)
    assert all(math.isfinite(v) for v in metrics.values())
    assert b.version == 1
    assert all(p.dtype == torch.float32 for p in b.model.parameters())


def test_kl_against_a_frozen_copy_of_the_initial_policy(
    backend: BackendFactory, make_batch
) -> None:
    batch = make_batch([10, 12], seed=15)
    b = backend(lr=1e-3, loss={"kl_coef": 0.1, "kl_type": "k3"})
    initial = b.logprobs(batch)
    first = b.train_step(batch)
    second = b.train_step(batch)
    assert first["actor/kl"] == pytest.approx(0.0, abs=1e-7)
    assert second["actor/kl"] > 1e-6
    torch.testing.assert_close(b.ref_logprobs(batch), initial, atol=0.0, rtol=0.0)


def test_external_reference_requires_ref_logprobs(backend: BackendFactory, make_batch) -> None:
    b = backend(loss={"kl_coef": 0.1}, reference="external")
    assert b.reference is None
    with pytest.raises(ValueError, match="ref_logprobs"):
        b.train_step(make_batch([8]))


def test_non_finite_gradient_skips_the_step(backend: BackendFactory, make_batch) -> None:
    batch = make_batch([10])
    poisoned = batch.replace(
        advantages=batch.advantages.masked_fill(batch.loss_mask.bool(), math.nan)
    )
    b = backend(lr=1e-3)
    before = {n: w.clone() for n, w in b.named_weights()}
    metrics = b.train_step(poisoned)
    assert metrics["actor/skipped_step"] == 1.0
    assert b.version == 0
    assert_same_tensors(before, dict(b.named_weights()), atol=0.0, rtol=0.0)


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_gradient_checkpointing_gives_the_same_gradient(
    backend: BackendFactory, make_batch
) -> None:
    batch = make_batch([10, 15], advantages=[1.0, -1.0], seed=17)
    results = []
    for recompute in (False, True):
        b = backend(gradient_checkpointing=recompute, grad_clip=None, loss={"entropy_coef": 0.01})
        assert checkpointing(b) is recompute
        b.train_step(batch)
        results.append(grads(b))
    assert_same_tensors(results[0], results[1], atol=1e-6, rtol=1e-5)


def test_trains_on_trajectories_and_reports_staleness(backend: BackendFactory) -> None:
    trajs = []
    for i, reward in enumerate([1.0, 0.0, 1.0, 0.0]):
        builder = TrajectoryBuilder([1, 100 + i, 200])
        builder.add_sampled([300 + i, 301], [-10.0, -10.5], version=0)
        builder.add_observation([400, 401])
        builder.add_sampled([302], [-11.0], version=1)
        traj = builder.build(TrajectoryMeta(episode_id=f"e{i}", group_id="g"))
        traj.reward = reward
        trajs.append(traj)
    batch, adv_metrics = batch_from_trajectories(trajs, AdvantageConfig())
    assert adv_metrics["advantage/excluded"] == 0.0
    b = backend(lr=1e-3)
    b.version = 2
    metrics = b.train_step(batch)
    # Sampled tokens came from versions 0, 0, 1 in every trajectory: staleness 2, 2, 1.
    assert metrics["actor/staleness_mean"] == pytest.approx(5 / 3)
    assert metrics["actor/staleness_max"] == 2.0
    assert metrics["actor/num_tokens"] == 12.0
    assert b.version == 3


def test_empty_loss_mask_is_refused(backend: BackendFactory, make_batch) -> None:
    batch = make_batch([6])
    with pytest.raises(ValueError, match="no loss-masked tokens"):
        backend().train_step(batch.replace(loss_mask=torch.zeros_like(batch.loss_mask)))


def test_loss_config_reaches_the_objective(backend: BackendFactory, make_batch) -> None:
    # A TIS cap with rollout logprobs far below the trainer's caps every weight.
    batch = make_batch([10, 12], seed=19)
    b = backend(loss=LossConfig(tis_cap=1.5).model_dump())
    metrics = b.train_step(batch.replace(rollout_logprobs=batch.loss_mask * -30.0))
    assert metrics["actor/tis_capped_frac"] == pytest.approx(1.0)
    assert metrics["actor/tis_weight_mean"] == pytest.approx(1.5)
