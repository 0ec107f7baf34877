"""The egress proxy of a sandbox in allowlist mode: a small HTTP proxy that lets through only
`host:port` pairs on its allowlist.

It runs in its own hardened container, attached to the sandbox's private `internal` network
and to the upstream network; the sandbox has no other way out. It is a standalone, stdlib-only
script (the Docker backend starts it with `python3 -c <this file>`), so any image with Python 3.8+
can host it.

Accepted: `CONNECT host:port` (HTTPS and any TCP protocol) and absolute-form plain HTTP requests
(`GET http://host:port/path`), each one connection. Refused with 403: hosts not on the list, ports
not on the list, IP literals, and names resolving to loopback, link-local (cloud metadata) or
unspecified addresses. Not covered: the allowed hosts themselves (what they relay), and traffic
volume (no rate limit).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import socket
import sys

_MAX_HEAD = 16 * 1024
_CONNECT_TIMEOUT = 5.0
_HEAD_TIMEOUT = 10.0


def parse_allowlist(entries: list[str]) -> list[tuple[str, int]]:
    """`host:port` strings as (lower-case host, port); a host `*.x.y` matches subdomains of x.y."""
    rules = []
    for entry in entries:
        host, _, port = entry.rpartition(":")
        rules.append((host.strip().lower().rstrip("."), int(port)))
    return rules


def is_allowed(rules: list[tuple[str, int]], host: str, port: int) -> bool:
    """True when `host:port` matches a rule; IP literals never match."""
    host = host.strip().lower().rstrip(".")
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    else:
        return False
    for rule_host, rule_port in rules:
        if rule_port != port:
            continue
        if rule_host == host:
            return True
        if rule_host.startswith("*.") and host.endswith(rule_host[1:]):
            return True
    return False


def _forbidden_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    return ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast


async def _open_upstream(
    host: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), _CONNECT_TIMEOUT
        )
    except (TimeoutError, OSError):
        return None
    for _family, _type, _proto, _name, sockaddr in infos:
        address = str(sockaddr[0])
        # A name on the list must not become a way to the metadata service or to loopback.
        if _forbidden_address(address):
            continue
        try:
            return await asyncio.wait_for(asyncio.open_connection(address, port), _CONNECT_TIMEOUT)
        except (TimeoutError, OSError):
            continue
    return None


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            chunk = await reader.read(64 * 1024)
            if not chunk:
                break
            writer.write(chunk)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            pass


async def _reply(writer: asyncio.StreamWriter, status: str) -> None:
    body = (status + "\n").encode()
    writer.write(
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    try:
        await writer.drain()
    except OSError:
        pass


def _split_target(authority: str, default_port: int) -> tuple[str, int] | None:
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = authority.partition(":")
    if not port_text:
        return host, default_port
    if not port_text.isdigit():
        return None
    return host, int(port_text)


async def _handle(
    rules: list[tuple[str, int]], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT)
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
        writer.close()
        return
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        await _reply(writer, "400 Bad Request")
        writer.close()
        return
    method, target, version = parts
    if method.upper() == "CONNECT":
        split = _split_target(target, 443)
        rest = b""
    elif target.lower().startswith("http://"):
        authority, slash, path = target[7:].partition("/")
        split = _split_target(authority, 80)
        kept = [
            line
            for line in lines[1:]
            if line and not line.lower().startswith(("proxy-", "connection:", "keep-alive:"))
        ]
        rest = (
            f"{method} /{path if slash else ''} {version}\r\n".encode("latin-1")
            + "".join(line + "\r\n" for line in kept).encode("latin-1")
            + b"Connection: close\r\n\r\n"
        )
    else:
        await _reply(writer, "400 Bad Request")
        writer.close()
        return
    if split is None or not is_allowed(rules, split[0], split[1]):
        await _reply(writer, "403 Forbidden")
        writer.close()
        return
    upstream = await _open_upstream(*split)
    if upstream is None:
        await _reply(writer, "502 Bad Gateway")
        writer.close()
        return
    up_reader, up_writer = upstream
    if rest:
        up_writer.write(rest)
    else:
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    up_writer.close()
    writer.close()


async def serve(port: int, allow: list[str]) -> None:
    """Serve on every address of the container, forever."""
    rules = parse_allowlist(allow)
    server = await asyncio.start_server(
        lambda r, w: _handle(rules, r, w), host="0.0.0.0", port=port, limit=_MAX_HEAD
    )
    # The sandbox backend waits for this line before it starts the sandbox.
    print("egress proxy ready", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=3128)
    parser.add_argument("--allow", action="append", default=[])
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.allow))


if __name__ == "__main__":
    main(sys.argv[1:])
