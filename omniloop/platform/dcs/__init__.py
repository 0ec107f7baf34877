"""DCS, weight delivery: publish the trainer's weights to every inference engine.

Three backends of one `WeightSync` protocol, chosen by `WeightSyncConfig.method`:

- `distributed` (`DistributedWeightSync`, `dcs/distributed.py`): a torch.distributed broadcast
  in buckets, with SGLang's protocol. On the first publish the trainer creates a process group
  of its own (its own store and name; a default group, if the process has one, is left alone)
  in which it is rank 0, and asks each engine to join it (`/init_weights_update_group`, rank
  1..n). Then per bucket it announces names, dtypes and shapes to every engine
  (`/update_weights_from_distributed`) while it broadcasts the bytes: one broadcast per
  tensor by default, which omniloop's engine, when paused in place, receives straight into its
  model (nothing packed on the trainer, nothing copied on the engine); or, with `flattened`,
  the bucket as one uint8 broadcast (SGLang's `flattened_bucket`). gloo on CPU, NCCL on GPU:
  the same code, the backend string comes from the config.
- `tcp` (`TcpWeightSync`, `dcs/tcp.py`): the engines fetch checksummed buckets over HTTP from
  a bucket server in the trainer's process (`/update_weights_from_tcp`), resuming a broken
  transfer per bucket; for engines in another cluster or behind NAT. omniloop's engine only.
- `disk` (`DiskWeightSync`, `dcs/disk.py`): write a Hugging Face folder under `staging_dir`,
  then `/update_weights_from_disk` on every engine at once (one host, or a shared filesystem).

Contract of `publish(named_weights, version)`, every backend: when it returns, every engine
holds exactly those weights and reports `version`, and no request was aborted. How an update
meets the requests running at that moment is `update_mode`:

- `in_place` (the default): every engine is paused between two decode steps
  (`/pause_generation` with mode `in_place`, which keeps requests, never SGLang's aborting
  default) while the weights are loaded, then continued (`/continue_generation`, also when the
  publish fails). Running requests go on under the new weights; each token records the version
  that sampled it (omniloop's engine reports it per token), and no token is sampled by a mix.
  Generation stalls for the load alone (the transfer, for `distributed` and `tcp`), not for
  the slowest running request.
- `drain`: the engines let running requests finish under the old weights before they load
  (omniloop's engine admits nothing meanwhile, and between the first and the last bucket), so
  every response has one version. On SGLang, drain means pausing generation around a bucketed
  update yourself.

Failures raise `WeightSyncError` naming the engine. An engine left with part of a bucketed
update keeps admitting nothing (rather than sample with mixed weights) until a later publish
succeeds; in `in_place` mode it is also left paused. After a failed bucket the process group
is abandoned and the next publish builds a new one (under a new name): a blocked broadcast
cannot be cancelled, it ends at `timeout_s`.

Which engines a run publishes to, and how an engine that joins or fails is handled, is the
`WeightCoordinator`'s (`dcs/coordinator.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omniloop.platform.dcs.base import WeightSync, WeightSyncError, engines_paused, plan_buckets
from omniloop.platform.dcs.config import UpdateMode, WeightSyncConfig

__all__ = [
    "UpdateMode",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
    "engines_paused",
    "make_weight_sync",
    "plan_buckets",
]


def make_weight_sync(
    config: WeightSyncConfig,
    engine_urls: Sequence[str],
    *,
    model_dir: str | Path | None = None,
) -> WeightSync:
    """The `WeightSync` that `config.method` names, for the engines at `engine_urls`.

    `model_dir` (disk only): the model folder whose config and tokenizer files go with the
    weights; None: the folder the first engine reports in `/get_model_info`.
    """
    if config.method == "disk":
        from omniloop.platform.dcs.disk import DiskWeightSync

        return DiskWeightSync(
            engine_urls,
            config.staging_dir,
            model_dir=model_dir,
            timeout_s=config.timeout_s,
            update_mode=config.update_mode,
        )
    if config.method == "tcp":
        from omniloop.platform.dcs.tcp import TcpWeightSync

        return TcpWeightSync(
            engine_urls,
            bucket_mb=config.bucket_mb,
            host=config.tcp_host,
            port=config.tcp_port,
            advertise_url=config.tcp_advertise_url,
            retries=config.tcp_retries,
            timeout_s=config.timeout_s,
            update_mode=config.update_mode,
        )
    from omniloop.platform.dcs.distributed import DistributedWeightSync

    return DistributedWeightSync(
        engine_urls,
        backend=config.backend,
        bucket_mb=config.bucket_mb,
        master_addr=config.master_addr,
        master_port=config.master_port,
        group_name=config.group_name,
        flattened=config.flattened,
        ranks_per_engine=config.ranks_per_engine,
        timeout_s=config.timeout_s,
        update_mode=config.update_mode,
    )
