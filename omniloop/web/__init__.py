"""The web dashboard (`dashboard.py`, pages in `static/`), served by `omniloop serve` at `/`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.routing import BaseRoute


def routes() -> list[BaseRoute]:
    """The dashboard's routes, for `create_app(..., extra_routes=routes())`.

    Imported lazily: `omniloop serve` looks this function up on every start.
    """
    from omniloop.web.dashboard import routes as dashboard_routes

    return dashboard_routes()
