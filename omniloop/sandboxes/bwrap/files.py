"""Safe access to a bwrap sandbox's workspace from the host, for `read_file` / `write_file`.

The workspace is a host folder that the sandbox's commands can change at any moment, so every
path is walked one component at a time with `O_NOFOLLOW` directory descriptors; symlinks are
resolved here, in the sandbox's view (an absolute target is taken as a path inside the
sandbox), and anything that leaves the workspace is refused. Only regular, singly linked files
are opened: no FIFOs (they could hang the service), no hard links to files outside.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from pathlib import Path

from omniloop.errors import SandboxError

_MAX_SYMLINKS = 40
_READ_CHUNK = 1 << 20


class WorkspaceFiles:
    """Reads and writes files of one sandbox's workspace (blocking: call from a thread).

    `workspace` is the host folder mounted at `workdir` inside the sandbox; files and folders
    made here are owned by `host_uid`, the sandbox's uid on the host.
    """

    def __init__(self, workspace: Path, workdir: str, host_uid: int) -> None:
        self.workspace = workspace
        self.workdir = workdir
        self._workdir_parts = [p for p in workdir.split("/") if p]
        self.host_uid = host_uid

    def write(self, path: str, data: bytes) -> None:
        """Write a regular file in the workspace (parents created); refuse paths leaving it."""
        fd = self._open_file(path, os.O_WRONLY | os.O_CREAT, create=True)
        try:
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchown(fd, self.host_uid, self.host_uid)
        except OSError as err:
            raise SandboxError(f"cannot write {path!r} in the workspace: {err}") from err
        finally:
            os.close(fd)

    def read(self, path: str) -> bytes:
        """Read a regular file of the workspace; refuse paths leaving it."""
        fd = self._open_file(path, os.O_RDONLY, create=False)
        try:
            chunks = []
            while chunk := os.read(fd, _READ_CHUNK):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _parts(self, path: str) -> list[str]:
        """`path` as components relative to the workspace (may hold `..`; checked while walking)."""
        if "\0" in path:
            raise SandboxError(f"path {path!r} contains a NUL byte")
        parts = [p for p in path.split("/") if p and p != "."]
        if path.startswith("/"):
            if parts[: len(self._workdir_parts)] != self._workdir_parts:
                raise SandboxError(f"path {path!r} is outside the workspace {self.workdir}")
            parts = parts[len(self._workdir_parts) :]
        return parts

    def _walk(self, path: str, *, create: bool) -> tuple[int, str]:
        """Resolve `path` as the sandbox would, one component at a time.

        Returns an open directory descriptor (the caller closes it) and the final name, which
        was not a symlink when checked. Folders are entered with `O_NOFOLLOW`, so a component
        swapped for a symlink after its check fails instead of being followed.
        """
        todo = deque(self._parts(path))
        stack = [os.open(self.workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]
        links = 0
        try:
            while todo:
                name = todo.popleft()
                if name in ("", "."):
                    continue
                if name == "..":
                    if len(stack) == 1:
                        raise SandboxError(f"path {path!r} leaves the workspace")
                    os.close(stack.pop())
                    continue
                try:
                    st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
                except FileNotFoundError:
                    if not todo:
                        return stack.pop(), name
                    if not create:
                        raise SandboxError(f"no folder {name!r} on the way to {path!r}") from None
                    os.mkdir(name, 0o755, dir_fd=stack[-1])
                    os.chown(
                        name, self.host_uid, self.host_uid, dir_fd=stack[-1], follow_symlinks=False
                    )
                    st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    links += 1
                    if links > _MAX_SYMLINKS:
                        raise SandboxError(f"too many symlinks in {path!r}")
                    target = os.readlink(name, dir_fd=stack[-1])
                    if target.startswith("/"):
                        try:
                            parts = self._parts(target)
                        except SandboxError:
                            raise SandboxError(
                                f"path {path!r} goes through a symlink to {target!r}, "
                                "outside the workspace"
                            ) from None
                        while len(stack) > 1:
                            os.close(stack.pop())
                    else:
                        parts = target.split("/")
                    todo.extendleft(reversed(parts))
                    continue
                if not todo:
                    return stack.pop(), name
                if not stat.S_ISDIR(st.st_mode):
                    raise SandboxError(f"{name!r} in {path!r} is not a folder")
                flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                stack.append(os.open(name, flags, dir_fd=stack[-1]))
            raise SandboxError(f"path {path!r} names a folder, not a file")
        except OSError as err:
            raise SandboxError(f"cannot resolve {path!r} in the workspace: {err}") from err
        finally:
            for fd in stack:
                os.close(fd)

    def _open_file(self, path: str, flags: int, *, create: bool) -> int:
        folder, name = self._walk(path, create=create)
        # O_NOFOLLOW: a symlink put there after the walk is refused, not followed.
        # O_NONBLOCK: opening a FIFO the sandbox made must not hang the service.
        flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=folder)
        except OSError as err:
            raise SandboxError(f"cannot open {path!r} in the workspace: {err}") from err
        finally:
            os.close(folder)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            raise SandboxError(f"{path!r} is not a regular, singly linked file")
        return fd
