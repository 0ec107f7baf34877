"""The light roles' replicas run without torch: importing torch costs a replica ~180 MB of
memory and over a second of CPU at start, and a run has several such replicas."""

from __future__ import annotations

import subprocess
import sys

import pytest

# What a replica of each role imports: the module of its class (Serve unpickles the class by
# reference), the run config it is given, and what its constructor imports.
LIGHT_ROLES = {
    "sandbox": [
        "omniloop.platform.control.sandbox_service",
        "omniloop.platform.control.run_config",
        "omniloop.platform.control.replica",
        "omniloop.sandboxes.factory",
        "omniloop.sandboxes.local",
    ],
    "reward": [
        "omniloop.platform.control.reward_service",
        "omniloop.platform.control.replica",
    ],
    # Until its first gateway call, which loads the model's tokenizer (`FirstCallGateway`).
    "api": [
        "omniloop.platform.control.api_service",
        "omniloop.platform.control.run_config",
        "omniloop.platform.control.replica",
        "omniloop.platform.api.settings",
        "omniloop.platform.api.app",
        "omniloop.platform.api.cli",
        "omniloop.platform.control.engine_routes",
        "omniloop.platform.control.deployments",
    ],
    "engine": [
        "omniloop.platform.control.engine_service",
        "omniloop.platform.control.run_config",
        "omniloop.platform.control.replica",
        "omniloop.platform.control.engines",
        "omniloop.processes",
    ],
}


@pytest.mark.parametrize("role", sorted(LIGHT_ROLES))
def test_a_light_role_s_replica_imports_no_torch(role: str) -> None:
    imports = "; ".join(f"import {module}" for module in LIGHT_ROLES[role])
    check = f"{imports}; import sys; print(sorted(m for m in sys.modules if m == 'torch'))"
    out = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", f"the {role} replica imports torch"
