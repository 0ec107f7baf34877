"""The host's process tree as /proc shows it: what runs below a sandbox's launcher."""

from __future__ import annotations

import os
from collections import deque


def parent_of(pid: int) -> int | None:
    """The parent pid of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def descendants(root_pid: int) -> list[int]:
    """Every living (not zombie) descendant of `root_pid`; for a sandbox that is all of it, as
    orphans reparent to its pid 1 (or to the launcher, a subreaper)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            state, ppid = fields[0], int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
        if state not in ("Z", "X"):
            children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = deque(children.get(root_pid, []))
    while todo:
        pid = todo.popleft()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found
