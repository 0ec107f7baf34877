"""Build the sandbox image (`docker/sandbox/Dockerfile`) with or without a reachable registry.

The Dockerfile takes its base as `ARG BASE_IMAGE`. Where a registry answers, the public default
(`python:3.11-slim-bookworm`) is pulled and used. Where none does, a base is made locally:

- `debootstrap`: `debootstrap --variant=minbase --include=python3,procps bookworm` from the
  Debian mirror (about 45 s, root only), trimmed of docs and locales, kept as a tarball under
  `~/.cache/omniloop/images/` so later builds import it in seconds, then `docker import`;
- `busybox`: `/bin/busybox` of busybox-static plus its applet links (no Python; the fallback
  when debootstrap is missing or fails, and the fast image for lifecycle tests).

The image is then built with Docker's classic builder (the Engine API's `/build`, what
`DOCKER_BUILDKIT=0 docker build` uses; buildx is not needed). A built image carries the hash of
its Dockerfile and base in a label, so an unchanged image is not rebuilt.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Literal

from docker.api.client import APIClient
from docker.errors import APIError, DockerException, ImageNotFound

from omniloop.cache import cache_root
from omniloop.errors import SandboxError

logger = logging.getLogger(__name__)

SANDBOX_IMAGE = "omniloop-sandbox:latest"
"""The default sandbox image (`SandboxConfig.image`)."""
BUSYBOX_SANDBOX_IMAGE = "omniloop-sandbox:busybox"
"""The same Dockerfile on a busybox base: no Python, starts fastest."""
PUBLIC_BASE = "python:3.11-slim-bookworm"
"""The base where a registry is reachable (the Dockerfile's default)."""
DEBIAN_BASE = "omniloop-base:bookworm-python3"
"""The locally made Debian base (debootstrap)."""
BUSYBOX_BASE = "omniloop-base:busybox"
"""The locally made busybox base."""
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = ("python3", "procps")
_HASH_LABEL = "omniloop.build_hash"

BaseChoice = Literal["auto", "public", "debootstrap", "busybox"]


def cache_dir() -> Path:
    """Where base tarballs are kept: the cache folder (`omniloop.cache`)."""
    return cache_root()


def dockerfile_dir() -> Path:
    """The folder of the sandbox Dockerfile in the source tree (`docker/sandbox`)."""
    folder = Path(__file__).resolve().parents[2] / "docker" / "sandbox"
    if not (folder / "Dockerfile").is_file():
        raise SandboxError(
            f"sandbox Dockerfile not found at {folder}: build from a source checkout of omniloop"
        )
    return folder


def _image_exists(api: APIClient, name: str) -> bool:
    try:
        api.inspect_image(name)
    except ImageNotFound:
        return False
    return True


def _try_pull(api: APIClient, image: str) -> bool:
    repository, _, tag = image.rpartition(":")
    try:
        api.pull(repository, tag=tag)
    except (APIError, DockerException) as err:
        logger.info("cannot pull %s (%s); making a base locally", image, str(err).splitlines()[0])
        return False
    return True


def debian_tarball(*, mirror: str | None = None, refresh: bool = False) -> Path:
    """The cached debootstrap root file system as a tarball, made on first use (needs root)."""
    target = cache_dir() / "images" / f"debian-{DEBIAN_SUITE}-{'-'.join(DEBIAN_PACKAGES)}.tar"
    if target.is_file() and not refresh:
        return target
    if shutil.which("debootstrap") is None:
        raise SandboxError("debootstrap is not installed (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise SandboxError("debootstrap needs root to make the Debian base")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="omniloop-debootstrap-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        command = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(DEBIAN_PACKAGES)}",
            DEBIAN_SUITE,
            str(rootfs),
        ]
        if mirror:
            command.append(mirror)
        logger.info("making the Debian base: %s", " ".join(command))
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SandboxError(f"debootstrap failed ({done.returncode}): {done.stdout[-2000:]}")
        # Documentation, man pages, locales and apt's lists are a third of the size and
        # nothing a tool command reads.
        for sub in ("usr/share/doc", "usr/share/man", "usr/share/locale", "var/lib/apt/lists"):
            for child in (rootfs / sub).glob("*"):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        for cache in (rootfs / "var/cache/apt").glob("*.bin"):
            cache.unlink()
        partial = target.with_suffix(".tar.partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(rootfs, arcname=".")
        partial.replace(target)
    return target


def _busybox_tarball(folder: Path) -> Path:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise SandboxError("busybox is not installed (apt-get install busybox-static)")
    applets = subprocess.run(
        [busybox, "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    root = folder / "rootfs"
    (root / "bin").mkdir(parents=True)
    for sub in ("etc", "tmp", "workspace"):
        (root / sub).mkdir()
    shutil.copy2(busybox, root / "bin" / "busybox")
    for applet in applets:
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    tarball = folder / "busybox.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(root, arcname=".")
    return tarball


def _import(api: APIClient, tarball: Path, name: str) -> None:
    repository, _, tag = name.rpartition(":")
    try:
        api.import_image_from_file(
            str(tarball),
            repository=repository,
            tag=tag,
            changes=["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        )
    except (APIError, DockerException) as err:
        raise SandboxError(f"docker import of {tarball} as {name} failed: {err}") from err
    if not _image_exists(api, name):
        raise SandboxError(f"docker import of {tarball} did not produce {name}")


def ensure_base(api: APIClient, choice: BaseChoice = "auto", *, mirror: str | None = None) -> str:
    """Name of a usable base image, made or pulled as `choice` says.

    `auto`: the public base if present or pullable, else the Debian base (debootstrap), else
    busybox. Raises `SandboxError` when the chosen way fails."""
    if choice in ("auto", "public"):
        if _image_exists(api, PUBLIC_BASE) or _try_pull(api, PUBLIC_BASE):
            return PUBLIC_BASE
        if choice == "public":
            raise SandboxError(f"cannot pull {PUBLIC_BASE}: no registry is reachable")
    if choice in ("auto", "debootstrap"):
        if _image_exists(api, DEBIAN_BASE):
            return DEBIAN_BASE
        try:
            _import(api, debian_tarball(mirror=mirror), DEBIAN_BASE)
            return DEBIAN_BASE
        except SandboxError as err:
            if choice == "debootstrap":
                raise
            logger.warning("no Debian base (%s); falling back to busybox (no Python)", err)
    if not _image_exists(api, BUSYBOX_BASE):
        with tempfile.TemporaryDirectory(prefix="omniloop-busybox-") as tmp:
            _import(api, _busybox_tarball(Path(tmp)), BUSYBOX_BASE)
    return BUSYBOX_BASE


def _build_hash(api: APIClient, folder: Path, base: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(folder).as_posix().encode())
            digest.update(path.read_bytes())
    digest.update(str(api.inspect_image(base)["Id"]).encode())
    return digest.hexdigest()[:16]


def build_sandbox_image(
    api: APIClient,
    *,
    tag: str = SANDBOX_IMAGE,
    base: BaseChoice | str = "auto",
    mirror: str | None = None,
    force: bool = False,
) -> str:
    """Build `docker/sandbox/Dockerfile` as `tag` on `base` (a `BaseChoice`, or any image name
    to use as is); return the image id. An image already built from the same Dockerfile and base
    is kept unless `force`."""
    if base in ("auto", "public", "debootstrap", "busybox"):
        base_image = ensure_base(api, base, mirror=mirror)
    else:
        base_image = base
        if not _image_exists(api, base_image) and not _try_pull(api, base_image):
            raise SandboxError(f"base image {base_image} is neither present nor pullable")
    folder = dockerfile_dir()
    build_hash = _build_hash(api, folder, base_image)
    if not force and _image_exists(api, tag):
        labels = api.inspect_image(tag).get("Config", {}).get("Labels") or {}
        if labels.get(_HASH_LABEL) == build_hash:
            return str(api.inspect_image(tag)["Id"])
    logger.info("building %s from %s", tag, base_image)
    log: list[str] = []
    try:
        for chunk in api.build(
            path=str(folder),
            tag=tag,
            buildargs={"BASE_IMAGE": base_image},
            labels={_HASH_LABEL: build_hash, "omniloop.base": base_image},
            rm=True,
            forcerm=True,
            pull=False,
            decode=True,
        ):
            _collect(chunk, log)
    except (APIError, DockerException) as err:
        raise SandboxError(f"building {tag} failed: {err}\n{''.join(log[-20:])}") from err
    if not _image_exists(api, tag):
        raise SandboxError(f"building {tag} failed:\n{''.join(log[-20:])}")
    return str(api.inspect_image(tag)["Id"])


def _collect(chunk: dict[str, Any], log: list[str]) -> None:
    if "error" in chunk:
        raise SandboxError(f"docker build: {chunk['error']}\n{''.join(log[-20:])}")
    if "stream" in chunk:
        log.append(str(chunk["stream"]))
