"""The api role's gateway is built by the first call that needs it, and only once."""

from __future__ import annotations

from typing import Any

from omniloop.platform.control.api_service import FirstCallGateway


def test_the_gateway_is_built_at_the_first_call_and_kept() -> None:
    built: list[Any] = []

    def build() -> Any:
        built.append(object())
        return built[-1]

    routes = FirstCallGateway(build)
    assert built == []  # nothing loads while the replica starts
    first = routes.gateway_for(None)
    assert routes.gateway_for("a-session") is first
    assert built == [first]
    assert routes.authorized(None, "")  # the replica's token guard decided before routing
