"""omniloop.trainer: turns scored trajectories into weight updates.

- `advantages` — group baselines (GRPO, Dr. GRPO, RLOO), GAE, distillation; pure tensor functions.
- `losses` — policy losses (PPO/GRPO clip and clip-higher, dual clip, GSPO, CISPO, SAPO), KL
  estimators, entropy, truncated importance sampling, aggregation modes; pure tensor functions.
- `batch` — `TrainBatch` (padded, aligned tensors) and `batch_from_trajectories`.
- `backend` — the `TrainerBackend` protocol; `torch_backend` — its PyTorch implementation.
- `config` — `TrainerConfig`, `LossConfig`, `AdvantageConfig`.

Submodules are imported explicitly (`from omniloop.trainer.losses import rl_loss`) so that
importing the package does not pull in torch.
"""
