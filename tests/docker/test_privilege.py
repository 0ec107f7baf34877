"""SANDBOX-CHECKLIST.md D22–D30: privilege, filesystem and secrets, against runc and gVisor."""

from __future__ import annotations

import hashlib
import textwrap
from typing import Any

import pytest
from docker.api.client import APIClient

from omniloop.errors import SandboxError
from omniloop.sandboxes.docker import DockerSandbox
from omniloop.sandboxes.remote import SandboxClient

SYSCALLS = textwrap.dedent(
    """\
    import ctypes, errno, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    def call(name, number, *args):
        ctypes.set_errno(0)
        result = libc.syscall(number, *args)
        code = ctypes.get_errno()
        print(name, 'ok' if result >= 0 else errno.errorcode.get(code, code))
    """
)


def outcomes(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.strip().splitlines())


async def test_d22_runs_as_non_root_without_privilege_escalation(
    make_sandbox: Any, docker_api: APIClient
) -> None:
    sandbox = await make_sandbox()
    host_config = docker_api.inspect_container(sandbox.container_id)["HostConfig"]
    assert host_config["Privileged"] is False
    assert "no-new-privileges:true" in host_config["SecurityOpt"]
    no_new_privs = "import ctypes; print(ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))"  # PR_GET_...
    ids = await sandbox.exec(["sh", "-c", f"id -u; id -g; python3 -c '{no_new_privs}'"])
    assert ids.stdout.split() == ["1000", "1000", "1"], ids
    # A setuid-root binary keeps our uid: mount finds itself unprivileged (with a raised euid it
    # would instead fail later, dropping the privileges it cannot hold without capabilities).
    found = await sandbox.exec(["sh", "-c", "find / -xdev -perm -4000 -type f 2>/dev/null"])
    assert "/usr/bin/mount" in found.stdout.split()
    mount = await sandbox.exec(["sh", "-c", "mkdir -p /tmp/m; mount -t tmpfs none /tmp/m"])
    assert mount.exit_code != 0
    assert "must be superuser" in mount.stderr, mount
    su = await sandbox.exec(["su", "-c", "id -u", "root"], stdin="")
    assert su.exit_code != 0
    assert "0" not in su.stdout.split()


async def test_d23_all_capabilities_are_dropped(make_sandbox: Any) -> None:
    sandbox = await make_sandbox()
    caps = await sandbox.exec(["grep", "^Cap", "/proc/self/status"])
    values = dict(line.split(":\t") for line in caps.stdout.strip().splitlines())
    assert values["CapEff"] == values["CapPrm"] == values["CapBnd"] == "0000000000000000", values
    script = SYSCALLS + textwrap.dedent(
        """\
        os.makedirs('/tmp/m', exist_ok=True)
        call('mount', 165, b'none', b'/tmp/m', b'tmpfs', 0, None)
        open('/tmp/f', 'w').close()
        call('chown_root', 92, b'/tmp/f', 0, 0)
        call('init_module', 175, None, 0, b'')                # what modprobe does
        call('finit_module', 313, -1, b'', 0)
        """
    )
    result = await sandbox.exec(["python3", "-c", script])
    assert result.ok, result
    for name, outcome in outcomes(result.stdout).items():
        assert outcome in ("EPERM", "EACCES", "ENOSYS"), (name, outcome)


GVISOR_EXEC_SECCOMP = (
    "runsc 0.0~20221219 (Debian bookworm) applies the OCI seccomp profile (--oci-seccomp) to the "
    "container's init only, not to processes started by `docker exec`"
)


def gvisor_known_gap(request: pytest.FixtureRequest, backend: str, reason: str) -> None:
    """Mark a check that this host's gVisor is known to fail; it turns red once gVisor passes."""
    if backend == "gvisor":
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


async def test_d23_user_namespaces_cannot_be_created(
    make_sandbox: Any, backend: str, request: pytest.FixtureRequest
) -> None:
    gvisor_known_gap(request, backend, GVISOR_EXEC_SECCOMP)
    sandbox = await make_sandbox()
    script = SYSCALLS + "call('unshare_user', 272, 0x10000000)\n"  # unshare -U
    result = await sandbox.exec(["python3", "-c", script])
    assert result.ok, result
    assert outcomes(result.stdout)["unshare_user"] in ("EPERM", "EACCES"), result.stdout


async def test_d24_default_seccomp_filter_is_installed(
    make_sandbox: Any, backend: str, request: pytest.FixtureRequest
) -> None:
    gvisor_known_gap(request, backend, GVISOR_EXEC_SECCOMP)
    sandbox = await make_sandbox()
    status = await sandbox.exec(["grep", "^Seccomp:", "/proc/self/status"])
    assert status.stdout.split()[-1] == "2", status


async def test_d24_keyctl_bpf_and_ptrace_of_pid1_fail(make_sandbox: Any) -> None:
    sandbox = await make_sandbox()
    script = SYSCALLS + textwrap.dedent(
        """\
        call('keyctl', 250, 0, -3)                            # KEYCTL_GET_KEYRING_ID, session
        call('bpf', 321, 5, None, 0)                          # BPF_PROG_LOAD
        call('ptrace_attach_pid1', 101, 16, 1, None, None)    # PTRACE_ATTACH to PID 1
        """
    )
    result = await sandbox.exec(["python3", "-c", script])
    assert result.ok, result
    for name, outcome in outcomes(result.stdout).items():
        assert outcome in ("EPERM", "EACCES", "ENOSYS"), (name, outcome)


async def test_d25_root_filesystem_is_read_only(make_sandbox: Any, docker_api: APIClient) -> None:
    sandbox = await make_sandbox()
    assert docker_api.inspect_container(sandbox.container_id)["HostConfig"]["ReadonlyRootfs"]
    mounts = await sandbox.exec(["cat", "/proc/mounts"])
    root = next(line.split() for line in mounts.stdout.splitlines() if line.split()[1] == "/")
    assert "ro" in root[3].split(","), root
    for script in ("echo x > /usr/bin/x", "echo x > /bin/bash", "cp /bin/sh /bin/bash"):
        result = await sandbox.exec(["sh", "-c", script])
        assert result.exit_code != 0, (script, result)
    intact = await sandbox.exec(["bash", "-c", "echo intact"])
    assert intact.stdout == "intact\n"


async def test_d26_no_docker_socket_and_no_host_bind_mounts(
    make_sandbox: Any, docker_api: APIClient
) -> None:
    sandbox = await make_sandbox()
    info = docker_api.inspect_container(sandbox.container_id)
    assert info["Mounts"] == []
    assert not info["HostConfig"].get("Binds")
    assert not info["HostConfig"].get("Mounts")
    mounts = await sandbox.exec(["cat", "/proc/mounts"])
    points = {line.split()[1] for line in mounts.stdout.splitlines()}
    # Docker's own per-container files are the only binds; nothing of the host's file system.
    binds = {"/etc/resolv.conf", "/etc/hostname", "/etc/hosts"}
    binds |= {"/sbin/docker-init", "/usr/sbin/docker-init"}  # --init: Docker's tini, read-only
    allowed_prefixes = ("/proc", "/dev", "/sys")
    unexpected = {
        p
        for p in points
        if p not in binds | {"/", "/tmp", "/workspace"} and not p.startswith(allowed_prefixes)
    }
    assert unexpected == set(), unexpected
    paths = ["/var/run/docker.sock", "/run/docker.sock", "/run/omniloop-docker.sock"]
    exists = "import os, sys; print([os.path.lexists(p) for p in sys.argv[1:]])"
    sockets = await sandbox.exec(["python3", "-c", exists, *paths])
    assert sockets.stdout.strip() == "[False, False, False]", sockets


SECRETS = {
    "OMNILOOP_TEST_API_KEY": "sk-omniloop-test-9f1c2e",
    "HF_TOKEN": "hf_omniloop_test_77aa",
    "OPENAI_API_KEY": "sk-openai-omniloop-test-31",
}


async def test_d27_secrets_of_the_host_are_not_visible(
    make_sandbox: Any, docker_api: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    sandbox = await make_sandbox()
    env = " ".join(docker_api.inspect_container(sandbox.container_id)["Config"]["Env"] or [])
    seen = await sandbox.exec(
        [
            "sh",
            "-c",
            "env; cat /proc/1/environ /proc/self/environ 2>&1 | tr '\\0' '\\n'; "
            "grep -rs . /etc /workspace /tmp 2>/dev/null | head -c 2000000",
        ]
    )
    for key, value in SECRETS.items():
        assert value not in env
        assert value not in seen.stdout + seen.stderr
        assert key not in seen.stdout


@pytest.mark.parametrize("path", ["../../etc/x", "/etc/x", "a/../../x", "/workspace/../etc/x"])
async def test_d28_file_api_refuses_traversal(make_sandbox: Any, path: str) -> None:
    sandbox = await make_sandbox()
    with pytest.raises(SandboxError, match="leaves the workspace"):
        await sandbox.write_file(path, b"x")
    with pytest.raises(SandboxError, match="leaves the workspace"):
        await sandbox.read_file(path)


async def test_d28_file_api_refuses_symlinks_out_of_the_workspace(make_sandbox: Any) -> None:
    sandbox = await make_sandbox()
    made = await sandbox.exec(
        ["sh", "-c", "ln -s / root && ln -s /etc/passwd passwd && mkdir d && ln -s /tmp d/t"]
    )
    assert made.ok, made
    for path in ("root/etc/passwd", "passwd", "d/t/x", "root/tmp/planted"):
        with pytest.raises(SandboxError, match="symlink"):
            await sandbox.read_file(path)
        with pytest.raises(SandboxError, match="symlink"):
            await sandbox.write_file(path, b"planted")
    listing = await sandbox.exec(["python3", "-c", "import os; print(os.listdir('/tmp'))"])
    assert listing.stdout == "[]\n"
    # Inside the workspace the API works as usual.
    await sandbox.write_file("d/ok.txt", b"fine")
    assert await sandbox.read_file("/workspace/d/ok.txt") == b"fine"


async def test_d29_files_of_one_episode_are_absent_in_the_next(make_sandbox: Any) -> None:
    first = await make_sandbox()
    await first.write_file("notes/answer.txt", b"episode A")
    # Listed with Python: coreutils' ls fails on this host's gVisor (its statx gets EINVAL).
    listing = "import os; print(sorted(os.listdir('/tmp')), sorted(os.listdir('/workspace')))"
    assert (await first.exec(["sh", "-c", "echo A > /tmp/a"])).ok
    assert (await first.exec(["python3", "-c", listing])).stdout == "['a'] ['notes']\n"
    await first.close()
    second = await make_sandbox()
    assert (await second.exec(["python3", "-c", listing])).stdout == "[] []\n"
    with pytest.raises(SandboxError, match="no such file"):
        await second.read_file("notes/answer.txt")


VERIFIER = b"#!/bin/sh\ngrep -qx 42 /workspace/answer.txt && echo PASS || echo FAIL\n"


async def test_d30_verifier_copied_in_after_the_agent_cannot_be_tampered_with(
    make_sandbox: Any,
) -> None:
    sandbox: DockerSandbox = await make_sandbox()
    # The agent answers wrongly and tries to win anyway: it plants a fake verifier, a symlink
    # for the real one to land on, and a daemon that keeps rewriting the verifier's path.
    attack = textwrap.dedent(
        """\
        echo 41 > /workspace/answer.txt
        mkdir -p /workspace/tests
        printf '#!/bin/sh\\necho PASS\\n' > /tmp/fake.sh
        ln -s /tmp/fake.sh /workspace/tests/verify.sh
        nohup sh -c 'while :; do printf "#!/bin/sh\\necho PASS\\n" > /workspace/tests/verify.sh \\
            2>/dev/null; done' >/dev/null 2>&1 &
        """
    )
    assert (await sandbox.exec(["sh", "-c", attack])).ok
    # Verification phase: stop everything the agent left running, replace its planted files,
    # copy the verifier in, check its hash, run it.
    assert await sandbox.signal_all("KILL")
    assert (await sandbox.exec(["rm", "-rf", "/workspace/tests"])).ok
    await sandbox.write_file("tests/verify.sh", VERIFIER)
    copied = await sandbox.read_file("tests/verify.sh")
    assert hashlib.sha256(copied).digest() == hashlib.sha256(VERIFIER).digest()
    verdict = await sandbox.exec(["sh", "/workspace/tests/verify.sh"])
    assert verdict.stdout.strip() == "FAIL", verdict
    # With the right answer the same verifier passes.
    await sandbox.write_file("answer.txt", b"42\n")
    assert (await sandbox.exec(["sh", "/workspace/tests/verify.sh"])).stdout.strip() == "PASS"


async def test_d28_service_refuses_traversal_and_symlinks(sandboxd: Any) -> None:
    async with SandboxClient(sandboxd.url) as client:
        sandbox = await client.create(episode_id="d28-service")
        try:
            assert (await sandbox.exec(["ln", "-s", "/etc", "/workspace/etc"])).ok
            for path in ("../../etc/x", "/etc/passwd", "etc/passwd"):
                with pytest.raises(SandboxError, match=r"\(400\)"):
                    await sandbox.read_file(path)
                with pytest.raises(SandboxError, match=r"\(400\)"):
                    await sandbox.write_file(path, b"x")
            await sandbox.write_file("fine/ok.txt", b"ok")
            assert await sandbox.read_file("fine/ok.txt") == b"ok"
        finally:
            await sandbox.close()
