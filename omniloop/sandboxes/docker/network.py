"""Networks of allowlist mode: a sandbox alone on a private `internal` network whose only other
member is its egress proxy (`egress_proxy.py`), itself also on `config.egress_network`.

The proxy lets through the listed `host:port` pairs and refuses everything else; the sandbox
reaches it through `HTTP(S)_PROXY`. Without an allowlist a sandbox has `--network none` and none
of this exists.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

from docker.errors import APIError
from docker.types import IPAMConfig, IPAMPool

from omniloop.errors import SandboxError
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.docker.client import DockerHost
from omniloop.sandboxes.docker.ownership import EGRESS_PREFIX, LABEL_ROLE
from omniloop.sandboxes.docker.profile import INIT_UID, host_config_for

PROXY_PORT = 3128
"""The port the egress proxy listens on."""


async def wait_for_log(host: DockerHost, container: str, text: bytes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        logs: bytes = await host.call(host.api.logs, container, stdout=True, stderr=True)
        if text in logs:
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"{container} did not become ready: {logs[-2000:]!r}")
        await asyncio.sleep(0.05)


async def create_private_network(host: DockerHost, name: str, labels: dict[str, str]) -> str:
    """An `internal` bridge network of its own for one sandbox: no route out, and no address
    for the host on it (`inhibit_ipv4`), so host services on 0.0.0.0 stay out of reach.

    Each gets a random /28 from 10.213.0.0/16: Docker's default pools hold about 30 networks,
    too few for one per sandbox; a clash with another network is retried."""
    last: BaseException | None = None
    for _ in range(8):
        block = secrets.randbelow(4096)
        subnet = f"10.213.{block // 16}.{(block % 16) * 16}/28"
        ipam = IPAMConfig(pool_configs=[IPAMPool(subnet=subnet)])
        try:
            network = await host.call(
                host.api.create_network,
                name,
                driver="bridge",
                internal=True,
                ipam=ipam,
                options={"com.docker.network.bridge.inhibit_ipv4": "true"},
                labels=labels,
                check_duplicate=True,
            )
        except APIError as err:
            if "overlap" not in str(err).lower():
                raise
            last = err
            continue
        return str(network["Id"])
    raise SandboxError(f"no free subnet for network {name}: {last}")


async def create_egress(
    host: DockerHost,
    sandbox_id: str,
    config: SandboxConfig,
    labels: dict[str, str],
    made: list[tuple[str, str]],
) -> tuple[str, str, str]:
    """Create the sandbox's private internal network and its egress proxy; return (network id,
    proxy container id, proxy address)."""
    from omniloop.sandboxes import egress_proxy

    name = EGRESS_PREFIX + sandbox_id
    network_id = await create_private_network(host, name, {**labels, LABEL_ROLE: "network"})
    made.append(("network", network_id))
    allow = [arg for entry in config.egress_allowlist or [] for arg in ("--allow", entry)]
    proxy_limits = config.limits.model_copy(
        update={"memory_mb": 256, "tmp_mb": 16, "workspace_mb": 16, "pids": 64, "cpus": 0.5}
    )
    proxy_config = config.model_copy(update={"limits": proxy_limits, "read_only_paths": []})
    host_config = host_config_for(host.api, proxy_config, runtime=None, network_mode=name)
    source = await asyncio.to_thread(Path(egress_proxy.__file__).read_text)
    proxy = await host.call(
        host.api.create_container,
        config.image,
        command=["python3", "-c", source, "--port", str(PROXY_PORT), *allow],
        name=name,
        user=f"{INIT_UID}:{INIT_UID}",
        labels={**labels, LABEL_ROLE: "egress-proxy"},
        host_config=host_config,
        working_dir="/tmp",
    )
    proxy_id: str = proxy["Id"]
    made.append(("container", proxy_id))
    await host.call(host.api.connect_container_to_network, proxy_id, config.egress_network)
    await host.call(host.api.start, proxy_id)
    await wait_for_log(host, proxy_id, b"egress proxy ready", timeout=30)
    info = await host.call(host.api.inspect_container, proxy_id)
    address: str = info["NetworkSettings"]["Networks"][name]["IPAddress"]
    return network_id, proxy_id, address
