"""The data plane (DESIGN.md §1): trajectories meet here, one partition per rollout step.

Roles program against `DataBus`; `DataPlane` implements it on TransferQueue. Nothing outside
this package imports TransferQueue. `DataPlane` and `DataPlaneConfig` are loaded on first use,
so importing the contract alone does not pull in Ray and TransferQueue (~2 s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omniloop.platform.data.base import (
    FIELDS,
    ROLLOUT_FIELDS,
    DataBus,
    DataPlaneError,
    DataPlaneTimeoutError,
    FieldKind,
    FieldSpec,
    MicroBatch,
    PartitionClosedError,
    UnknownRowsError,
    partition_id,
)

if TYPE_CHECKING:
    from omniloop.platform.data.tq import DataPlane, DataPlaneConfig

__all__ = [
    "FIELDS",
    "ROLLOUT_FIELDS",
    "DataBus",
    "DataPlane",
    "DataPlaneConfig",
    "DataPlaneError",
    "DataPlaneTimeoutError",
    "FieldKind",
    "FieldSpec",
    "MicroBatch",
    "PartitionClosedError",
    "UnknownRowsError",
    "partition_id",
]


def __getattr__(name: str) -> Any:
    if name in ("DataPlane", "DataPlaneConfig"):
        from omniloop.platform.data import tq

        return getattr(tq, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
