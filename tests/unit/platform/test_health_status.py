"""`health.deployment_status`: each role's state, running replicas and message, read from the
Serve controller's instance details as the controller sends them (enums, or their strings)."""

from __future__ import annotations

from ray.serve._private.common import DeploymentStatus, ReplicaState

from omniloop.platform.control.health import deployment_status


def test_roles_are_read_from_the_deployment_named_as_their_application() -> None:
    details = {
        "applications": {
            "rollout": {
                "deployments": {
                    "rollout": {
                        "status": DeploymentStatus.UNHEALTHY,
                        "message": "replica died\nmore",
                        "replicas": [
                            {"state": ReplicaState.RUNNING},
                            {"state": ReplicaState.STARTING},
                        ],
                    }
                }
            },
            "api": {
                "deployments": {
                    "api": {"status": "HEALTHY", "replicas": [{"state": "RUNNING"}]},
                    "helper": {"status": "UNHEALTHY", "replicas": []},
                }
            },
            "other": {"deployments": {"not_other": {"status": "HEALTHY", "replicas": []}}},
        }
    }
    assert deployment_status(details) == {
        "rollout": ("UNHEALTHY", 1, "replica died\nmore"),
        "api": ("HEALTHY", 1, ""),
    }


def test_no_applications_is_no_roles() -> None:
    assert deployment_status({}) == {}
    assert deployment_status({"applications": {}}) == {}
