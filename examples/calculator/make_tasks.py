"""Write the calculator task set: arithmetic a 135M model cannot do in its head but can do
with the `python` tool. Deterministic: the same file every time."""

from __future__ import annotations

import json
import random
from pathlib import Path

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_tasks(n: int, seed: int = 0) -> list[dict[str, object]]:
    """`n` tasks, easy ones (two-digit sums) first, harder ones (products) later."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        op = "+" if i < n // 3 else rng.choice(list(OPERATORS))
        digits = 2 if i < n // 2 else 3
        a = rng.randint(10 ** (digits - 1), 10**digits - 1)
        b = rng.randint(10 ** (digits - 1), 10**digits - 1)
        tasks.append(
            {
                "id": f"calc-{i:04d}",
                "prompt": f"What is {a} {op} {b}?",
                "answer": str(OPERATORS[op](a, b)),
                "metadata": {"expression": f"{a} {op} {b}"},
            }
        )
    return tasks


if __name__ == "__main__":
    out = Path(__file__).with_name("tasks.jsonl")
    out.write_text("".join(json.dumps(t) + "\n" for t in make_tasks(256)))
    print(f"wrote {out}")
