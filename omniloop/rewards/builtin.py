"""Built-in rewards: `exact_match`, `math_equal` and `format_reward`.

Each is a ready-to-use instance with default options; the classes (`ExactMatch`, `MathEqual`,
`FormatReward`) make configured ones. All read the model's final answer the same way
(`final_answer`):

1. Reasoning (`<think>` blocks) and tool calls are dropped: an answer is never in them.
2. If the rest holds `<answer>...</answer>`, the last one is the answer's scope.
3. In that scope, the content of the last `\\boxed{...}` (or `\\fbox{...}`) is the answer.
4. Otherwise the `<answer>` content, or failing that the last non-empty line, is the answer.

A task without the reference answer these rewards compare against is an error (`RewardError`:
the episode is not trained on), not a zero. A reference answer that is a list means "any of
these".
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
import unicodedata
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from omniloop.errors import RewardError
from omniloop.rewards.base import RewardScore, Transcript
from omniloop.tools.parser import THINK_CLOSE, parse_tool_calls
from omniloop.trajectory import Trajectory

logger = logging.getLogger(__name__)

_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\b")


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}`/`\\fbox{...}` in `text`, or None.

    Braces are matched (escaped `\\{`/`\\}` do not count), so `\\boxed{\\frac{1}{2}}` gives
    `\\frac{1}{2}`; `\\boxed 5` gives `5`. An unterminated box (a truncated answer) is skipped.
    """
    for match in reversed(list(_BOXED_RE.finditer(text))):
        pos = match.end()
        while pos < len(text) and text[pos] == " ":
            pos += 1
        if pos < len(text) and text[pos] != "{":
            token = re.match(r"[^\s$]+", text[pos:])
            if token and match.end() < pos:
                return token.group(0)
            continue
        depth = 0
        i = pos
        while i < len(text):
            char = text[i]
            if char == "\\":
                i += 2
                continue
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    return text[pos + 1 : i]
            i += 1
    return None


def final_answer(response: str) -> str | None:
    """The model's final answer in `response` (see the module doc for the rule), or None."""
    content = parse_tool_calls(response).text
    tags = _ANSWER_TAG_RE.findall(content)
    scope = tags[-1] if tags else content
    boxed = last_boxed(scope)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    if tags:
        return tags[-1].strip() or None
    lines = [line.strip() for line in content.splitlines() if line.strip()]
    return lines[-1] if lines else None


def normalize_answer(text: str, *, case_sensitive: bool = False) -> str:
    """Normalize an answer for string comparison.

    Unicode NFKC; outer whitespace, `$...$` delimiters and a trailing period removed; runs of
    whitespace collapsed to one space; case folded unless `case_sensitive`.
    """
    text = unicodedata.normalize("NFKC", text).strip()
    while len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text[1:-1].strip()
    text = text.rstrip(".").strip()
    text = " ".join(text.split())
    return text if case_sensitive else text.casefold()


def _reference_answers(task: dict[str, Any], key: str, reward_name: str) -> list[str]:
    value = task.get(key)
    if value is None:
        raise RewardError(
            f"reward {reward_name!r}: task {task.get('id', '?')!r} has no {key!r}; "
            "it needs a reference answer"
        )
    values = value if isinstance(value, list | tuple) else [value]
    return [v if isinstance(v, str) else json.dumps(v) for v in values]


class ExactMatch:
    """1.0 when the final answer equals the task's answer after `normalize_answer`, else 0.0."""

    inputs = frozenset({"task", "response"})
    """What of an episode it reads (`reward_inputs`)."""

    def __init__(
        self,
        *,
        answer_key: str = "answer",
        case_sensitive: bool = False,
        name: str = "exact_match",
        weight: float = 1.0,
        timeout: float | None = None,
    ) -> None:
        self.answer_key = answer_key
        self.case_sensitive = case_sensitive
        self.name = name
        self.weight = weight
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"<reward {self.name}>"

    async def evaluate(
        self,
        task: dict[str, Any],
        response: str,
        *,
        transcript: Transcript | None = None,
        trajectory: Trajectory | None = None,
    ) -> RewardScore:
        """Score the final answer of `response` against `task[answer_key]`."""
        references = _reference_answers(task, self.answer_key, self.name)
        answer = final_answer(response)
        if answer is None:
            return RewardScore(0.0, {})
        got = normalize_answer(answer, case_sensitive=self.case_sensitive)
        hit = any(
            got == normalize_answer(ref, case_sensitive=self.case_sensitive) for ref in references
        )
        return RewardScore(1.0 if hit else 0.0, {})


# ---------------------------------------------------------------------------------------------
# math-verify in worker processes

_WORKER_SCRIPT = Path(__file__).with_name("_math_worker.py")


class _WorkerHung(Exception):
    pass


class _Worker:
    """One math-verify worker process, spoken to in JSON lines."""

    def __init__(self, start_timeout: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(_WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self._buffer = b""
        ready = self._read_line(time.monotonic() + start_timeout)
        if ready.get("ready") is not True:
            self.kill()
            raise RuntimeError(f"math-verify worker sent {ready!r} instead of ready")

    def _read_line(self, deadline: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _WorkerHung
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.poll()
                raise RuntimeError(f"math-verify worker exited (code {code})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(payload).encode() + b"\n")
        self.proc.stdin.flush()
        return self._read_line(time.monotonic() + timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def _kill_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        try:
            worker.kill()
        except OSError:
            pass
    workers.clear()


class MathVerifyPool:
    """A few long-lived math-verify processes, each driven by one thread of a private executor.

    Started on first use. A comparison that overruns its deadline (stuck where math-verify's
    own alarm cannot interrupt it) kills only its worker; the next request starts a new one.
    Workers are killed when the pool is closed or collected, and at interpreter exit; they
    also exit by themselves when their stdin closes (the parent died).
    """

    def __init__(self, workers: int = 2, *, start_timeout: float = 60.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self.start_timeout = start_timeout
        self._local = threading.local()
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._finalizer = weakref.finalize(self, _kill_all, self._live)

    def _compare_blocking(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        worker: _Worker | None = getattr(self._local, "worker", None)
        if worker is None or worker.proc.poll() is not None:
            worker = _Worker(self.start_timeout)
            with self._lock:
                self._live.add(worker)
            self._local.worker = worker
        try:
            return worker.request(payload, timeout)
        except BaseException:
            self._local.worker = None
            with self._lock:
                self._live.discard(worker)
            worker.kill()
            raise

    async def compare(self, payload: dict[str, Any], limit: float) -> dict[str, Any]:
        """Send one request; raise `RewardError` if the worker takes over `limit` seconds
        (it is killed) or dies."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="math-verify")
            executor = self._executor
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(executor, self._compare_blocking, payload, limit)
        except _WorkerHung:
            raise RewardError(
                f"math-verify did not answer within {limit:g}s; its worker was killed"
            ) from None
        except (OSError, RuntimeError, ValueError) as err:
            raise RewardError(f"math-verify worker failed: {err}") from err

    def close(self) -> None:
        """Kill the workers; a later request starts new ones."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            _kill_all(self._live)


class MathEqual:
    """1.0 when the final answer is mathematically equal to the task's answer (math-verify).

    `1/2`, `0.5`, `\\frac{1}{2}` and `\\boxed{\\dfrac12}` are all equal. Answers that are equal
    as normalized strings score 1.0 without math-verify; when either side does not parse as
    math (`yes`, `Paris`) the normalized strings decide. math-verify runs in worker processes
    (`MathVerifyPool`) so its `signal.alarm` timeouts work and a hang cannot stall the event
    loop: `parsing_timeout` and `verify_timeout` are its own limits (whole seconds), and a
    worker that exceeds all of them together is killed and the reward raises `RewardError`.
    """

    inputs = frozenset({"task", "response"})
    """What of an episode it reads (`reward_inputs`)."""

    def __init__(
        self,
        *,
        answer_key: str = "answer",
        parsing_timeout: int = 5,
        verify_timeout: int = 5,
        workers: int = 2,
        name: str = "math_equal",
        weight: float = 1.0,
        timeout: float | None = None,
    ) -> None:
        if parsing_timeout < 1 or verify_timeout < 1:
            raise ValueError("math-verify timeouts are whole seconds, at least 1")
        self.answer_key = answer_key
        self.parsing_timeout = int(parsing_timeout)
        self.verify_timeout = int(verify_timeout)
        self.name = name
        self.weight = weight
        self.timeout = timeout
        self.pool = MathVerifyPool(workers)

    def __repr__(self) -> str:
        return f"<reward {self.name}>"

    @property
    def hard_timeout(self) -> float:
        """Seconds after which a comparison is considered hung: both sides' parses (two tries
        each), and verify over up to two parsed forms of each side, plus slack."""
        return 4 * self.parsing_timeout + 4 * self.verify_timeout + 5

    async def equal(self, reference: str, answer: str) -> bool:
        """Whether `answer` equals `reference` (see the class doc)."""
        if normalize_answer(answer) == normalize_answer(reference):
            return True
        result = await self.pool.compare(
            {
                "gold": reference,
                "pred": answer,
                "parsing_timeout": self.parsing_timeout,
                "verify_timeout": self.verify_timeout,
            },
            self.hard_timeout,
        )
        if "error" in result:
            raise RewardError(f"reward {self.name!r}: math-verify failed: {result['error']}")
        if result.get("equal") is None:
            return False  # not math on one side, and the strings differ
        return bool(result["equal"])

    async def evaluate(
        self,
        task: dict[str, Any],
        response: str,
        *,
        transcript: Transcript | None = None,
        trajectory: Trajectory | None = None,
    ) -> RewardScore:
        """Score the final answer of `response` against `task[answer_key]`."""
        references = _reference_answers(task, self.answer_key, self.name)
        answer = final_answer(response)
        if answer is None:
            return RewardScore(0.0, {})
        for reference in references:
            if await self.equal(reference, answer):
                return RewardScore(1.0, {})
        return RewardScore(0.0, {})

    def close(self) -> None:
        """Stop the math-verify workers (they restart on the next use)."""
        self.pool.close()


# ---------------------------------------------------------------------------------------------
# Format


AnswerFormat = Literal["any", "tag", "boxed"]


class FormatReward:
    """How well the episode kept to the expected format; the mean of the enabled checks.

    Components (each 0.0-1.0):

    - `answer` (unless `answer=None`): the final turn, outside reasoning, holds an answer in
      the required form: `tag` = a non-empty `<answer>...</answer>`, `boxed` = a complete
      `\\boxed{...}`, `any` = either.
    - `tool_calls` (if `tool_calls`): the share of the episode's tool calls that parsed
      cleanly (1.0 when there were none). Read from `trajectory.meta.tool_calls` when given,
      else by parsing the assistant messages of `transcript`, else the final turn.
    - `think` (if `think`): the final turn closed a reasoning block (`</think>`) and wrote
      something after it.
    """

    def __init__(
        self,
        *,
        answer: AnswerFormat | None = "any",
        tool_calls: bool = True,
        think: bool = False,
        name: str = "format_reward",
        weight: float = 1.0,
        timeout: float | None = None,
    ) -> None:
        if answer is None and not tool_calls and not think:
            raise ValueError("format_reward needs at least one check enabled")
        self.answer = answer
        self.tool_calls = tool_calls
        self.think = think
        self.name = name
        self.weight = weight
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"<reward {self.name}>"

    def _answer_ok(self, content: str) -> bool:
        tags = [t for t in _ANSWER_TAG_RE.findall(content) if t.strip()]
        boxed = last_boxed(content) is not None
        if self.answer == "tag":
            return bool(tags)
        if self.answer == "boxed":
            return boxed
        return bool(tags) or boxed

    @staticmethod
    def _tool_call_share(
        response: str, transcript: Transcript | None, trajectory: Trajectory | None
    ) -> float:
        if trajectory is not None:
            flags = [c.error != "parse_error" for c in trajectory.meta.tool_calls]
        else:
            turns = (
                [str(m.get("content") or "") for m in transcript if m.get("role") == "assistant"]
                if transcript is not None
                else [response]
            )
            flags = [call.ok for turn in turns for call in parse_tool_calls(turn).calls]
        return sum(flags) / len(flags) if flags else 1.0

    async def evaluate(
        self,
        task: dict[str, Any],
        response: str,
        *,
        transcript: Transcript | None = None,
        trajectory: Trajectory | None = None,
    ) -> RewardScore:
        """Run the enabled checks; the total is their mean."""
        parsed = parse_tool_calls(response)
        components: dict[str, float] = {}
        if self.answer is not None:
            components["answer"] = 1.0 if self._answer_ok(parsed.text) else 0.0
        if self.tool_calls:
            components["tool_calls"] = self._tool_call_share(response, transcript, trajectory)
        if self.think:
            closed = THINK_CLOSE in response and bool(parsed.text or parsed.calls)
            components["think"] = 1.0 if closed else 0.0
        return RewardScore(sum(components.values()) / len(components), components)


exact_match = ExactMatch()
"""`ExactMatch()` with default options: compares against `task["answer"]`."""

math_equal = MathEqual()
"""`MathEqual()` with default options; its worker processes start on first use."""

format_reward = FormatReward()
"""`FormatReward()` with default options: an answer in any form, and well-formed tool calls."""
