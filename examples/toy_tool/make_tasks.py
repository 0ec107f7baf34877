"""Write the toy tool task set: eight ways of asking for the treasure. Deterministic.

The treasure lies in the same direction for every task; nothing in a prompt says which.
"""

from __future__ import annotations

import json
from pathlib import Path

from agent import treasure_code

TREASURE = "east"
PROMPTS = (
    "Find the treasure.",
    "Where is the treasure?",
    "Get the treasure code.",
    "Fetch the treasure.",
    "Locate the treasure.",
    "Which way is the treasure?",
    "Bring me the treasure.",
    "Seek the treasure.",
)


def make_tasks() -> list[dict[str, object]]:
    """One task per phrasing."""
    return [
        {
            "id": f"treasure-{i}",
            "prompt": prompt,
            "answer": TREASURE,
            "metadata": {"treasure": TREASURE, "code": treasure_code(TREASURE)},
        }
        for i, prompt in enumerate(PROMPTS)
    ]


if __name__ == "__main__":
    out = Path(__file__).with_name("tasks.jsonl")
    out.write_text("".join(json.dumps(t) + "\n" for t in make_tasks()))
    print(f"wrote {out}")
