"""Runs an MCP stdio server for one exchange inside a sandbox (`python3 -c` of this source).

argv: the id of the last request, then the server's command line. The exchange (the
client's JSON-RPC lines) comes on stdin; it is written to the server, whose stdout is
copied out line by line until the answer to that id has passed, and only then is the
server's stdin closed: a stdio server ends on end of input, and would drop a request still
being handled. Python's standard library only: it runs on the sandbox's `python3`.
"""

import json
import subprocess
import sys


def main() -> int:
    last = json.loads(sys.argv[1])
    server = subprocess.Popen(sys.argv[2:], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert server.stdin is not None
    assert server.stdout is not None
    server.stdin.write(sys.stdin.buffer.read())
    server.stdin.flush()
    for line in server.stdout:
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict) and message.get("id") == last and "method" not in message:
            break
    server.stdin.close()
    try:
        server.wait(timeout=5)
    except subprocess.TimeoutExpired:
        server.kill()
    return server.returncode if server.returncode is not None else 0


if __name__ == "__main__":
    sys.exit(main())
