"""The health monitor's reading of Serve's instance details agrees with `serve.status()`.

The details are built with Ray Serve's own schema and serialised the way its controller sends
them; `serve.status()`'s view of the same details (`ServeInstanceDetails._get_status`) is the
oracle."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve.schema import (
    ApplicationDetails,
    DeploymentDetails,
    DeploymentSchema,
    ReplicaDetails,
    ServeInstanceDetails,
)

from omniloop.platform.control.health import statuses_from_details


def _deployment(name: str, status: str, replica_states: list[str], message: str) -> Any:
    replicas = [
        ReplicaDetails(replica_id=f"{name}-{i}", state=state, start_time_s=1.0)
        for i, state in enumerate(replica_states)
    ]
    return DeploymentDetails(
        name=name,
        status=status,
        status_trigger="CONFIG_UPDATE_STARTED",
        message=message,
        deployment_config=DeploymentSchema(name=name),
        target_num_replicas=len(replica_states),
        required_resources={"CPU": 0.1},
        replicas=replicas,
    )


def _app(name: str, deployments: list[Any]) -> Any:
    return ApplicationDetails(
        name=name,
        route_prefix=None,
        docs_path=None,
        status="RUNNING",
        message="",
        last_deployed_time_s=1.0,
        source="imperative",
        deployments={d.name: d for d in deployments},
        external_scaler_enabled=False,
    )


def _as_sent(details: ServeInstanceDetails) -> dict[str, Any]:
    """What `get_serve_instance_details` returns to a client."""
    return details._get_user_facing_json_serializable_dict(exclude_unset=True)  # type: ignore[no-any-return]


def _as_serve_status_sees_it(sent: dict[str, Any]) -> dict[str, tuple[str, int, str]]:
    out = {}
    for app_name, app in ServeInstanceDetails(**sent)._get_status().applications.items():
        deployment = app.deployments[app_name]
        running = sum(
            count
            for state, count in deployment.replica_states.items()
            if getattr(state, "value", state) == "RUNNING"
        )
        status = getattr(deployment.status, "value", deployment.status)
        out[app_name] = (str(status), running, deployment.message or "")
    return out


@pytest.mark.parametrize(
    ("status", "replica_states", "message"),
    [
        ("HEALTHY", ["RUNNING", "RUNNING"], ""),
        ("UNHEALTHY", ["RUNNING", "STARTING"], "replica failed its health check\nmore"),
        ("UPSCALING", ["STARTING", "PENDING_MIGRATION", "RUNNING"], ""),
        ("UPDATING", [], "waiting for resources"),
    ],
)
def test_details_as_sent_give_what_serve_status_gives(
    status: str, replica_states: list[str], message: str
) -> None:
    rollout = _deployment("rollout", status, replica_states, message)
    helper = _deployment("helper", "HEALTHY", ["RUNNING"], "")
    details = ServeInstanceDetails(
        proxies={},
        applications={
            "rollout": _app("rollout", [rollout, helper]),
            "reward": _app("reward", [_deployment("reward", "HEALTHY", ["RUNNING"], "")]),
        },
    )
    sent = _as_sent(details)
    seen = statuses_from_details(sent)
    assert seen == _as_serve_status_sees_it(sent)
    assert seen["rollout"] == (status, replica_states.count("RUNNING"), message)
    assert set(seen) == {"rollout", "reward"}  # the helper deployment is not a role


def test_an_application_without_its_ingress_deployment_is_not_reported() -> None:
    sent = _as_sent(
        ServeInstanceDetails(
            proxies={}, applications={"api": _app("api", [_deployment("web", "HEALTHY", [], "")])}
        )
    )
    assert statuses_from_details(sent) == {}
    assert statuses_from_details({}) == {}
