"""The seccomp filter every command of a bwrap sandbox runs under.

bwrap loads it (`--seccomp FD`) after setting up the namespaces, so it binds the command and
everything it starts. It returns EPERM for each syscall in `DENIED_SYSCALL_TABLE` and kills any
process that uses a foreign syscall ABI (i386 on x86_64, arm32 on aarch64); on x86_64 the x32
range returns EPERM.
"""

from __future__ import annotations

import errno
import platform
import struct

# Denied syscalls and their numbers per architecture, from the kernel's uapi headers (x86_64:
# asm/unistd_64.h; aarch64: asm-generic/unistd.h; "-" where the syscall does not exist). Each
# either needs a capability the sandbox does not have, or is kernel attack surface that a tool
# command has no use for.
DENIED_SYSCALL_TABLE = """
# name                 x86_64  aarch64
ptrace                    101      117
process_vm_readv          310      270
process_vm_writev         311      271
kcmp                      312      272
pidfd_getfd               438      438
keyctl                    250      219
add_key                   248      217
request_key               249      218
bpf                       321      280
perf_event_open           298      241
userfaultfd               323      282
kexec_load                246      104
kexec_file_load           320      294
init_module               175      105
finit_module              313      273
delete_module             176      106
mount                     165       40
umount2                   166       39
pivot_root                155       41
swapon                    167      224
swapoff                   168      225
reboot                    169      142
setns                     308      268
unshare                   272       97
acct                      163       89
quotactl                  179       60
syslog                    103      116
open_by_handle_at         304      265
name_to_handle_at         303      264
iopl                      172        -
ioperm                    173        -
settimeofday              164      170
clock_settime             227      112
adjtimex                  159      171
clock_adjtime             305      266
vhangup                   153       58
lookup_dcookie            212       18
io_uring_setup            425      425
io_uring_enter            426      426
io_uring_register         427      427
open_tree                 428      428
move_mount                429      429
fsopen                    430      430
fsconfig                  431      431
fsmount                   432      432
fspick                    433      433
mount_setattr             442      442
"""
_MACHINES = ("x86_64", "aarch64")
DENIED_SYSCALLS: dict[str, dict[str, int]] = {
    machine: {
        row.split()[0]: int(row.split()[1 + i])
        for row in DENIED_SYSCALL_TABLE.strip().splitlines()[1:]
        if row.split()[1 + i] != "-"
    }
    for i, machine in enumerate(_MACHINES)
}
"""Machine → syscall name → number: each returns EPERM inside a sandbox."""
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_BPF_LD_W_ABS = 0x00 | 0x00 | 0x20
_BPF_JEQ_K = 0x05 | 0x10 | 0x00
_BPF_JGE_K = 0x05 | 0x30 | 0x00
_BPF_RET_K = 0x06 | 0x00
_SECCOMP_RET_KILL_PROCESS = 0x80000000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_RET_ALLOW = 0x7FFF0000


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The compiled seccomp filter bwrap loads (`--seccomp FD`), or None for an unknown machine.

    Layout: kill the process unless the syscall ABI is the host's native one; on x86_64 deny the
    x32 range; deny each listed syscall with EPERM; allow the rest.
    """
    machine = machine or platform.machine()
    table = DENIED_SYSCALLS.get(machine)
    if table is None:
        return None
    numbers = sorted(set(table.values()))
    n = len(numbers)
    insns: list[tuple[int, int, int, int]] = [
        (_BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_BPF_JEQ_K, 1, 0, _AUDIT_ARCH[machine]),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),
        (_BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":
        insns.append((_BPF_JGE_K, n + 1, 0, _X32_SYSCALL_BIT))  # over the n checks and ALLOW
    # From check i, DENY lies past the remaining n-1-i checks and ALLOW.
    insns.extend((_BPF_JEQ_K, n - i, 0, nr) for i, nr in enumerate(numbers))
    insns.append((_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW))
    insns.append((_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EPERM))
    return b"".join(struct.pack("=HBBI", *insn) for insn in insns)
