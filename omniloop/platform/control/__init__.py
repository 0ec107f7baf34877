"""The control plane and the roles it directs (DESIGN.md §1, §7).

- `controller`: the role protocols, what they report, and `train_loop`, the one loop.
- `run`: a training run start to finish (`omniloop run`); `record`: what it leaves behind.
- `local`: the roles in this process; `episode`: one episode; `rollout`: `omniloop rollout`.
- `rollout_config`, `run_config`: the typed configs; `components`: what they name, built.
- `staleness`: the staleness gate; `metrics`: step metrics and their sinks; `engines`: local
  engine processes; `console`: the shared console; `cli`: the commands.
"""
