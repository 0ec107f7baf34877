"""The REST API (`/v1`), served by `omniloop serve` (DESIGN.md §8).

`create_app(ApiSettings(...))` builds the FastAPI app; `app.py` says what its lifespan does and
where extra routes (the dashboard) plug in, `routes.py` lists the endpoints, `problems.py` the
error documents, `worker.py` how submitted episodes run, `cli.py` the `serve` and `episode`
commands.
"""

from omniloop.platform.api.app import create_app
from omniloop.platform.api.settings import TOKEN_ENV, AgentEntry, ApiLimits, ApiSettings

__all__ = ["TOKEN_ENV", "AgentEntry", "ApiLimits", "ApiSettings", "create_app"]
