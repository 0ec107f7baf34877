"""The seccomp filters every command of a bwrap sandbox runs under, built with libseccomp.

bwrap loads them (`--add-seccomp-fd`, one per filter) after setting up the namespaces, so they
bind the command and everything it starts. The kernel runs every filter on each syscall and
keeps the most severe verdict:

- the syscall filter, for the host's native ABI: each syscall in `DENIED_SYSCALL_NAMES` returns
  EPERM, the rest is allowed; a syscall through any other ABI returns EPERM as well (that is
  what refuses the x32 range on x86_64);
- the ABI filter: kills the process on a syscall through an ABI other than the native one and,
  on x86_64, x32 (so i386 on x86_64 and arm32 on aarch64), and allows everything else.

Two filters because libseccomp gives a filter one action for every foreign ABI, and x32 is
refused with EPERM while the other ABIs are killed. libseccomp resolves the names to each
architecture's numbers (`denied_syscalls`). Syscall number -1 (no syscall; the kernel answers
ENOSYS) passes, as libseccomp lets it through for tracers that skip a syscall.
"""

from __future__ import annotations

import errno
import platform
import tempfile
from types import ModuleType
from typing import Any

from omniloop.errors import SandboxError

DENIED_SYSCALL_NAMES = (
    # Tracing and reading other processes.
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    # The kernel keyring.
    "keyctl",
    "add_key",
    "request_key",
    # Kernel attack surface a tool command has no use for.
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "lookup_dcookie",
    "vhangup",
    # Kernel code, swap, power.
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "swapon",
    "swapoff",
    "reboot",
    # Mounts and namespaces.
    "mount",
    "umount2",
    "pivot_root",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "setns",
    "unshare",
    # Host-wide state.
    "acct",
    "quotactl",
    "syslog",
    "open_by_handle_at",
    "name_to_handle_at",
    "iopl",
    "ioperm",
    "settimeofday",
    "clock_settime",
    "adjtimex",
    "clock_adjtime",
)
"""Syscalls that return EPERM inside a sandbox (where the machine has them). Each either needs a
capability the sandbox does not have, or is kernel attack surface that a tool command has no
use for."""

_ARCHES = {"x86_64": "X86_64", "aarch64": "AARCH64"}
"""Machines with filters → libseccomp's name for their native ABI."""
_TOLERATED_ABIS = {"x86_64": ("X32",), "aarch64": ()}
"""ABIs besides the native one that the ABI filter lets through (the syscall filter refuses
them with EPERM)."""


def _libseccomp() -> ModuleType:
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as err:  # RuntimeError: no libseccomp.so
        raise SandboxError(
            f"cannot build the sandbox's seccomp filter: {err}; install libseccomp "
            "(Debian: apt-get install libseccomp2) and the pyseccomp package"
        ) from err
    return pyseccomp


def _arch(seccomp: Any, machine: str) -> int:
    return int(getattr(seccomp.Arch, _ARCHES[machine]))


def _filter(seccomp: Any, machine: str, bad_abi_action: int, abis: tuple[str, ...]) -> Any:
    """An allow-by-default libseccomp filter for `machine` and `abis`, `bad_abi_action` for
    syscalls through any other ABI."""
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    f.remove_arch(seccomp.Arch.NATIVE)  # the filter is for `machine`, not necessarily this host
    f.add_arch(_arch(seccomp, machine))
    for abi in abis:
        f.add_arch(getattr(seccomp.Arch, abi))
    f.set_attr(seccomp.Attr.ACT_BADARCH, bad_abi_action)
    return f


def _export(f: Any) -> bytes:
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def denied_syscalls(machine: str | None = None) -> dict[str, int]:
    """Syscall name → number on `machine` (default: this host) of each denied syscall the
    machine has, as libseccomp resolves them; empty for a machine without filters."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        return {}
    seccomp = _libseccomp()
    arch = _arch(seccomp, machine)
    numbers = {name: int(seccomp.resolve_syscall(arch, name)) for name in DENIED_SYSCALL_NAMES}
    return {name: nr for name, nr in numbers.items() if nr >= 0}  # < 0: not on this machine


def seccomp_programs(machine: str | None = None) -> tuple[bytes, ...]:
    """The compiled filters (classic BPF, as bwrap's `--add-seccomp-fd` reads them) for
    `machine` (default: this host): the syscall filter, then the ABI filter. Empty for a
    machine without filters; `SandboxError` when libseccomp is missing or does not know a
    denied syscall."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        return ()
    seccomp = _libseccomp()
    syscalls = _filter(seccomp, machine, seccomp.ERRNO(errno.EPERM), ())
    for name in DENIED_SYSCALL_NAMES:
        try:
            # By name: libseccomp translates it to the filter's machine, and skips a syscall
            # that machine does not have (iopl and ioperm on aarch64).
            syscalls.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except OSError as err:
            raise SandboxError(
                f"libseccomp cannot deny syscall {name!r} on {machine} ({err}): it is too old "
                "for this filter; install libseccomp2 >= 2.5.4"
            ) from err
    abis = _filter(seccomp, machine, seccomp.KILL_PROCESS, _TOLERATED_ABIS[machine])
    return _export(syscalls), _export(abis)
