"""What every role replica does before it builds its role.

Kept free of heavy imports: a replica imports only what its role needs, and the light roles
(sandbox, reward, the engine's front, and the api until its gateway's first call) run without
torch.
"""

from __future__ import annotations

import os
import sys


def enter_run_folder(cwd: str, paths: list[str]) -> None:
    """Work from the controller's folder with its import path, so that relative paths and
    `file.py:name` components resolve in a replica exactly as in the controller."""
    os.chdir(cwd)
    for entry in reversed(paths):
        if entry not in sys.path:
            sys.path.insert(0, entry)
