"""The bwrap backend's seccomp filters, run through a classic-BPF interpreter for every syscall
number of every ABI that matters, on both supported machines (whatever the host is).

The reference below is the kernel's uapi syscall numbers; the expected verdicts are the
filters' contract: each listed syscall returns EPERM, the rest of the native ABI is allowed, the
x32 range of x86_64 returns EPERM, and any other ABI kills the process.
"""

from __future__ import annotations

import errno
import struct
import sys

import pytest

from omniloop.errors import SandboxError
from omniloop.sandboxes.bwrap import DENIED_SYSCALL_NAMES, denied_syscalls, seccomp_programs

# name → (x86_64, aarch64) from asm/unistd_64.h and asm-generic/unistd.h; None: no such syscall.
REFERENCE: dict[str, tuple[int | None, int | None]] = {
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "reboot": (169, 142),
    "setns": (308, 268),
    "unshare": (272, 97),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "syslog": (103, 116),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "iopl": (172, None),
    "ioperm": (173, None),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "adjtimex": (159, 171),
    "clock_adjtime": (305, 266),
    "vhangup": (153, 58),
    "lookup_dcookie": (212, 18),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
}
MACHINES = ("x86_64", "aarch64")
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
FOREIGN_ARCHES = (0x40000003, 0x40000028, 0xC00000B7, 0xC000003E, 0x12345678)  # i386, arm, ...
X32_BIT = 0x40000000

KILL_PROCESS = 0x80000000
ALLOW = 0x7FFF0000
EPERM = 0x00050000 | errno.EPERM

NUMBERS = [*range(0, 1024), *range(X32_BIT, X32_BIT + 1024), 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]


def denied_numbers(machine: str) -> set[int]:
    column = MACHINES.index(machine)
    return {nr for nrs in REFERENCE.values() if (nr := nrs[column]) is not None}


def run_bpf(program: bytes, arch: int, nr: int) -> int:
    """Run a classic-BPF seccomp program on `seccomp_data` {nr, arch}; return its verdict."""
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    words = {0: nr & 0xFFFFFFFF, 4: arch}
    acc = pc = 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = words[k]
            pc += 1
        elif code == 0x05:  # BPF_JMP | BPF_JA
            pc += 1 + k
        elif code in (0x15, 0x25, 0x35, 0x45):  # BPF_JMP | JEQ/JGT/JGE/JSET | BPF_K
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:  # BPF_RET | BPF_K
            return int(k)
        else:
            raise AssertionError(f"instruction {code:#x} at {pc} is not interpreted here")


def verdict(programs: tuple[bytes, ...], arch: int, nr: int) -> int:
    """What the kernel does with several filters: the most severe action wins."""

    def severity(action: int) -> int:
        signed = action & 0xFFFF0000
        return signed - (1 << 32) if signed & 0x80000000 else signed

    return min((run_bpf(p, arch, nr) for p in programs), key=severity)


def expected(machine: str, arch: int, nr: int) -> int:
    if arch != AUDIT_ARCH[machine]:
        return KILL_PROCESS
    if nr == 0xFFFFFFFF:
        # -1 is no syscall (the kernel answers ENOSYS); libseccomp lets it pass for tracers.
        return ALLOW
    if machine == "x86_64" and nr >= X32_BIT:
        return EPERM
    return EPERM if nr in denied_numbers(machine) else ALLOW


@pytest.mark.parametrize("machine", MACHINES)
def test_every_syscall_of_every_abi_gets_the_filters_verdict(machine: str) -> None:
    programs = seccomp_programs(machine)
    assert len(programs) == 2
    wrong = [
        (hex(arch), hex(nr), hex(got), hex(want))
        for arch in (AUDIT_ARCH[machine], *FOREIGN_ARCHES)
        for nr in NUMBERS
        if (got := verdict(programs, arch, nr)) != (want := expected(machine, arch, nr))
    ]
    assert wrong == []


@pytest.mark.parametrize("machine", MACHINES)
def test_libseccomp_resolves_each_denied_syscall_to_the_kernels_number(machine: str) -> None:
    column = MACHINES.index(machine)
    reference = {name: nrs[column] for name, nrs in REFERENCE.items() if nrs[column] is not None}

    assert set(DENIED_SYSCALL_NAMES) == set(REFERENCE)
    assert denied_syscalls(machine) == reference


def test_every_denied_syscall_is_refused_with_eperm() -> None:
    for machine in MACHINES:
        programs = seccomp_programs(machine)
        for name, nrs in REFERENCE.items():
            nr = nrs[MACHINES.index(machine)]
            if nr is not None:
                assert verdict(programs, AUDIT_ARCH[machine], nr) == EPERM, (machine, name)


def test_an_unknown_machine_has_no_filter() -> None:
    assert seccomp_programs("riscv64") == ()
    assert denied_syscalls("riscv64") == {}


def test_a_missing_libseccomp_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # import fails as without the library

    with pytest.raises(SandboxError, match="libseccomp2"):
        seccomp_programs("x86_64")
