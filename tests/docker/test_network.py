"""SANDBOX-CHECKLIST.md C17–C21: network isolation, against runc and gVisor.

Traffic goes only to loopback and to this suite's own containers. Probes of outside addresses
run only after the sandbox proved, from inside, that it has no interface but loopback, so no
packet can leave it whatever the probe does.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from docker.api.client import APIClient

from omniloop.errors import ConfigError
from omniloop.sandboxes.config import SandboxConfig
from omniloop.sandboxes.docker import DockerSandbox, create_docker_sandbox, host_config_for

# Exits 3 before any probe unless loopback is the only interface and there is no route.
LOOPBACK_ONLY_GUARD = textwrap.dedent(
    """\
    import json, socket, sys, time
    interfaces = [l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]]
    routes = open('/proc/net/route').read().splitlines()[1:]
    if interfaces != ['lo'] or routes:
        print(json.dumps({'interfaces': interfaces, 'routes': routes}))
        sys.exit(3)
    results = {}
    def probe(name, fn):
        start = time.monotonic()
        try:
            fn()
            outcome = 'connected'
        except Exception as e:
            outcome = type(e).__name__ + ': ' + str(e)
        results[name] = [outcome, round(time.monotonic() - start, 3)]
    """
)


async def probe(sandbox: DockerSandbox, body: str) -> dict[str, list[Any]]:
    result = await sandbox.exec(["python3", "-c", LOOPBACK_ONLY_GUARD + textwrap.dedent(body)])
    assert result.exit_code != 3, f"sandbox has more than loopback: {result.stdout}"
    assert result.ok, result
    outcomes: dict[str, list[Any]] = json.loads(result.stdout.splitlines()[-1])
    return outcomes


async def test_c17_egress_is_blocked_and_fails_fast_without_network(make_sandbox: Any) -> None:
    sandbox = await make_sandbox()
    outcomes = await probe(
        sandbox,
        """
        probe('https_by_name', lambda: socket.create_connection(('example.com', 443), timeout=5))
        probe('raw_ip_dns_tcp', lambda: socket.create_connection(('1.1.1.1', 53), timeout=5))
        probe('dns_lookup', lambda: socket.getaddrinfo('example.com', 443))
        probe('raw_ip_udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
              .sendto(b'x', ('1.1.1.1', 53)))
        print(json.dumps(results))
        """,
    )
    for name, (outcome, seconds) in outcomes.items():
        assert outcome != "connected", (name, outcome)
        assert seconds < 2, f"{name} took {seconds}s to fail"


async def test_c19_internal_services_and_docker_api_are_unreachable(make_sandbox: Any) -> None:
    sandbox = await make_sandbox()
    # A service of the host on loopback (what the reward service, queue or database would be).
    server = await asyncio.start_server(lambda r, w: w.close(), host="127.0.0.1", port=0)
    port = server.sockets[0].getsockname()[1]
    try:
        outcomes = await probe(
            sandbox,
            f"""
            import os
            probe('metadata', lambda: socket.create_connection(('169.254.169.254', 80), timeout=5))
            probe('host_docker_internal', lambda: socket.getaddrinfo('host.docker.internal', 80))
            probe('host_loopback_service', lambda: socket.create_connection(('127.0.0.1', {port}),
                                                                            timeout=5))
            probe('docker_tcp_api', lambda: socket.create_connection(('127.0.0.1', 2375),
                                                                     timeout=5))
            for path in ('/var/run/docker.sock', '/run/docker.sock', '/run/omniloop-docker.sock'):
                results[path] = ['present' if os.path.exists(path) else 'absent', 0]
            print(json.dumps(results))
            """,
        )
    finally:
        server.close()
    for name, (outcome, seconds) in outcomes.items():
        assert outcome not in ("connected", "present"), (name, outcome)
        assert seconds < 2, f"{name} took {seconds}s to fail"


SERVER = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', 8000)); s.listen()\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(sys.argv[1].encode()); c.close()\n"
)
CLIENT = (
    "import socket, sys\n"
    "try:\n"
    "    print(socket.create_connection((sys.argv[1], 8000), timeout=3).recv(10).decode())\n"
    "except OSError as e:\n"
    "    print('refused', type(e).__name__)\n"
)


async def start_server(sandbox: DockerSandbox, name: str) -> None:
    # Output redirected: the server outlives its exec (only strays holding output are stopped).
    started = await sandbox.exec(["sh", "-c", f'python3 -c "$0" {name} >/dev/null 2>&1 &', SERVER])
    assert started.ok, started
    for _ in range(50):
        answer = await sandbox.exec(["python3", "-c", CLIENT, "127.0.0.1"])
        if answer.stdout.strip() == name:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"server {name} did not come up")


async def test_c20_sandboxes_cannot_reach_each_other_and_may_bind_the_same_port(
    make_sandbox: Any,
) -> None:
    a = await make_sandbox()
    b = await make_sandbox()
    await start_server(b, "B")
    # Before A listens, its loopback has nothing on 8000: B's server is not there.
    alone = await a.exec(["python3", "-c", CLIENT, "127.0.0.1"])
    assert alone.stdout.startswith("refused"), alone
    await start_server(a, "A")  # the same port, bound in both at once
    again = await a.exec(["python3", "-c", CLIENT, "127.0.0.1"])
    assert again.stdout.strip() == "A"
    own = await b.exec(["python3", "-c", CLIENT, "127.0.0.1"])
    assert own.stdout.strip() == "B"


async def test_c21_raw_sockets_and_network_administration_are_denied(make_sandbox: Any) -> None:
    sandbox = await make_sandbox()
    script = textwrap.dedent(
        """\
        import errno, os, socket, struct
        out = {}
        try:
            socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)  # ping
            out['raw'] = 'allowed'
        except OSError as e:
            out['raw'] = errno.errorcode[e.errno]
        # `ip addr add 127.0.0.2/32 dev lo` over rtnetlink: like iptables, needs CAP_NET_ADMIN.
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
        attr = struct.pack('HH4s', 8, 2, socket.inet_aton('127.0.0.2'))  # IFA_LOCAL
        body = struct.pack('BBBBI', socket.AF_INET, 32, 0, 0, 1) + attr  # ifaddrmsg, lo
        flags = 0x1 | 0x4 | 0x400 | 0x200  # REQUEST | ACK | CREATE | EXCL
        s.send(struct.pack('IHHII', 16 + len(body), 20, flags, 1, 0) + body)  # RTM_NEWADDR
        reply = s.recv(4096)
        code = -struct.unpack('i', reply[16:20])[0]
        out['net_admin'] = errno.errorcode.get(code, 'allowed') if code else 'allowed'
        print(out['raw'], out['net_admin'])
        """
    )
    result = await sandbox.exec(["python3", "-c", script])
    assert result.ok, result
    raw, net_admin = result.stdout.split()
    assert raw in ("EPERM", "EACCES")
    assert net_admin in ("EPERM", "EACCES")


# --- allowlist mode (C18) ------------------------------------------------------------------------


@pytest.fixture
def upstream(docker_api: APIClient, sandbox_image: str) -> Iterator[dict[str, str]]:
    """An internal network with two web servers of our own: `allowed` (ports 8080 and 8081)
    and `other` (8080), standing in for the hosts behind the egress proxy."""
    tag = secrets.token_hex(4)
    labels = {"omniloop.sandbox": "1", "omniloop.expires_at": str(int(time.time() + 600))}
    network = docker_api.create_network(
        f"omniloop-test-up-{tag}", driver="bridge", internal=True, labels=labels
    )["Id"]
    containers = []
    config = SandboxConfig(image=sandbox_image)
    host_config = host_config_for(
        docker_api, config, runtime=None, network_mode=f"omniloop-test-up-{tag}"
    )
    names = {"allowed": f"allowed-{tag}", "other": f"other-{tag}"}
    commands = {
        "allowed": "python3 -m http.server 8080 & exec python3 -m http.server 8081",
        "other": "exec python3 -m http.server 8080",
    }
    try:
        for key, name in names.items():
            container = docker_api.create_container(
                sandbox_image,
                command=["sh", "-c", commands[key]],
                name=name,
                user="1000:1000",
                labels=labels,
                host_config=host_config,
            )["Id"]
            containers.append(container)
            docker_api.start(container)
        address = docker_api.inspect_container(containers[0])["NetworkSettings"]["Networks"][
            f"omniloop-test-up-{tag}"
        ]["IPAddress"]
        yield {**names, "network": f"omniloop-test-up-{tag}", "allowed_ip": address}
    finally:
        for container in containers:
            docker_api.remove_container(container, force=True)
        docker_api.remove_network(network)


@pytest.fixture
async def allowlisted(upstream: dict[str, str], sandbox_image: str) -> AsyncIterator[DockerSandbox]:
    limits = SandboxConfig().limits.model_copy(
        update={"memory_mb": 512, "tmp_mb": 64, "workspace_mb": 64}
    )
    config = SandboxConfig(
        image=sandbox_image,
        limits=limits,
        egress_allowlist=[f"{upstream['allowed']}:8080"],
        egress_network=upstream["network"],
    )
    sandbox = await create_docker_sandbox(config, episode_id="allowlist")
    yield sandbox
    await sandbox.close()


FETCH = textwrap.dedent(
    """\
    import json, os, socket, sys, urllib.request, urllib.error
    out = {}
    for url in sys.argv[1:]:
        try:
            out[url] = urllib.request.urlopen(url, timeout=10).status
        except urllib.error.HTTPError as e:
            out[url] = e.code
        except OSError as e:
            out[url] = type(e).__name__
    proxy = os.environ['HTTP_PROXY'][len('http://'):].rstrip('/')
    host, port = proxy.split(':')
    for target in sys.argv[1:]:
        authority = target.split('/')[2]
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(f'CONNECT {authority} HTTP/1.1\\r\\nHost: {authority}\\r\\n\\r\\n'.encode())
        out['CONNECT ' + authority] = int(s.recv(100).split()[1])
    print(json.dumps(out))
    """
)


async def test_c18_allowlist_reaches_the_listed_host_and_nothing_else(
    allowlisted: DockerSandbox, upstream: dict[str, str], docker_api: APIClient
) -> None:
    allowed, other, ip = upstream["allowed"], upstream["other"], upstream["allowed_ip"]
    urls = [
        f"http://{allowed}:8080/",
        f"http://{other}:8080/",
        f"http://{allowed}:8081/",
        f"http://{ip}:8080/",
    ]
    for _ in range(50):  # the web servers may still be starting
        result = await allowlisted.exec(["python3", "-c", FETCH, urls[0]])
        if result.ok and json.loads(result.stdout)[urls[0]] == 200:
            break
        await asyncio.sleep(0.2)
    result = await allowlisted.exec(["python3", "-c", FETCH, *urls])
    assert result.ok, result
    outcome = json.loads(result.stdout)
    assert outcome[urls[0]] == 200
    assert outcome[f"CONNECT {allowed}:8080"] == 200
    for url in urls[1:]:
        assert outcome[url] == 403, (url, outcome)
        assert outcome["CONNECT " + url.split("/")[2]] == 403, (url, outcome)
    # Around the proxy there is no way: no route to the allowed host's address, no DNS for it.
    direct = await allowlisted.exec(
        [
            "python3",
            "-c",
            "import socket, sys\n"
            "for target in ((sys.argv[1], 8080), (sys.argv[2], 8080)):\n"
            "    try:\n"
            "        socket.create_connection(target, timeout=3); print('connected')\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__)\n",
            ip,
            allowed,
        ]
    )
    assert "connected" not in direct.stdout, direct
    # Closing removes the proxy and the private network with the sandbox.
    name = f"omniloop-egress-{allowlisted.id}"
    await allowlisted.close()
    assert docker_api.containers(all=True, filters={"name": name}) == []
    assert docker_api.networks(names=[name]) == []


async def test_c18_allowlist_sandboxes_cannot_reach_each_other(
    upstream: dict[str, str], sandbox_image: str
) -> None:
    config = SandboxConfig(
        image=sandbox_image,
        egress_allowlist=[f"{upstream['allowed']}:8080"],
        egress_network=upstream["network"],
    )
    a = await create_docker_sandbox(config)
    b = await create_docker_sandbox(config)
    try:
        await start_server(b, "B")
        own_address = "import socket; print(socket.gethostbyname(socket.gethostname()))"
        b_ip = (await b.exec(["python3", "-c", own_address])).stdout.strip()
        reach = await a.exec(["python3", "-c", CLIENT, b_ip])
        assert reach.stdout.startswith("refused"), reach
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_c18_allowlist_is_refused_on_gvisor(
    sandbox_image: str, docker_api: APIClient
) -> None:
    config = SandboxConfig(
        backend="gvisor", image=sandbox_image, egress_allowlist=["example.com:443"]
    )
    with pytest.raises(ConfigError, match="not available with the gvisor backend"):
        await create_docker_sandbox(config)


def test_loopback_guard_rejects_a_networked_namespace() -> None:
    # The guard itself, run on this host (which has real interfaces), must refuse to probe.
    namespace: dict[str, Any] = {}
    with pytest.raises(SystemExit) as exit_info:
        exec(LOOPBACK_ONLY_GUARD, namespace)
    assert exit_info.value.code == 3
