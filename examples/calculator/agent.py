"""The calculator example: arithmetic with the `python` tool and an exact-answer reward.

SmolLM2-135M never calls a tool on its own, so the first turn is prefilled with the opening of
a `python` call: the model only has to finish the expression and then read the tool's answer
back. The reward is 1 when the last number of the final turn equals the answer.
"""

from __future__ import annotations

import re

from omniloop import ToolAgent, reward
from omniloop.tools import python

SYSTEM_PROMPT = (
    "You are a careful calculator. Use the python tool to compute, then answer with the number."
)
PREFILL = '<tool_call>\n{"name": "python", "arguments": {"code": "print('

_NUMBER = re.compile(r"-?\d[\d,]*")


def build_agent() -> ToolAgent:
    """The agent the config names."""
    return ToolAgent([python], system_prompt=SYSTEM_PROMPT, prefill=PREFILL, max_tool_timeouts=1)


@reward
def exact_answer(task: dict, response: str) -> float:
    """1.0 when the last number in the final answer equals the task's answer, else 0.0."""
    numbers = _NUMBER.findall(response)
    if not numbers:
        return 0.0
    return float(numbers[-1].replace(",", "") == str(task["answer"]))
