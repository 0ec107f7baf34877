"""A math-verify worker process: one JSON request per stdin line, one JSON answer per line.

Run as a script (not as part of the package, so it starts without importing omniloop).
math-verify bounds its work with `signal.alarm`, which only works on a process's main thread:
here every comparison runs on this process's main thread, so its timeouts are real, and the
parent can kill the whole process if something hangs in C code where no signal gets through.

Request: `{"gold": str, "pred": str, "parsing_timeout": int, "verify_timeout": int}`.
Answer: `{"equal": true|false}`, `{"equal": null}` when either side did not parse as math,
or `{"error": "..."}`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any


def _parse(text: str, parsing_timeout: int) -> list[Any]:
    from math_verify import parse

    # An extracted answer is usually bare math (`1 + x^2`, `\dfrac12`), which only parses
    # whole inside math delimiters (as plain text `1 + x^2` reads as `1`); prose (`the answer
    # is 42`) must be read as written, since in delimiters it becomes a product of symbols.
    has_delimiters = "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text
    prose = re.search(r"[A-Za-z]{3,}", re.sub(r"\\[A-Za-z]+", "", text)) is not None
    if has_delimiters:
        candidates = [text]
    elif prose:
        candidates = [text, f"${text}$"]
    else:
        candidates = [f"${text}$", text]
    for candidate in candidates:
        parsed = parse(candidate, parsing_timeout=parsing_timeout)
        if parsed:
            return list(parsed)
    return []


def compare(request: dict[str, Any]) -> dict[str, Any]:
    """Answer one request (see the module doc)."""
    from math_verify import verify

    parsing_timeout = int(request.get("parsing_timeout", 5))
    gold = _parse(str(request["gold"]), parsing_timeout)
    pred = _parse(str(request["pred"]), parsing_timeout)
    if not gold or not pred:
        return {"equal": None}
    equal = verify(gold, pred, timeout_seconds=int(request.get("verify_timeout", 5)))
    return {"equal": bool(equal)}


def main() -> None:
    # Answers go to a private copy of stdout; fd 1 itself (Python or C writes) now goes to
    # stderr, so nothing a library prints can corrupt the protocol.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import math_verify  # noqa: F401 -- import before the first request, not during it

    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = compare(json.loads(line))
        except Exception as err:
            answer = {"error": f"{type(err).__name__}: {err}"}
        out.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
