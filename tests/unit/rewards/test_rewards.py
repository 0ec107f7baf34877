"""Rewards: the decorator's contract, `score`'s failure model, and the built-in rewards."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from pydantic import BaseModel

from omniloop.errors import RewardError
from omniloop.rewards import (
    ExactMatch,
    FormatReward,
    MathEqual,
    RewardFn,
    combine,
    exact_match,
    final_answer,
    format_reward,
    last_boxed,
    normalize_answer,
    reward,
    score,
)
from omniloop.rewards.base import EPISODE_INPUTS, as_reward_fn, reward_inputs
from omniloop.tools import format_tool_call
from omniloop.trajectory import ToolCallRecord, Trajectory, TrajectoryBuilder, TrajectoryMeta

TASK = {"id": "t1", "prompt": "What is 1/2?", "answer": "0.5", "metadata": {}}


def make_trajectory(errors: list[str | None]) -> Trajectory:
    calls = [
        ToolCallRecord(turn=0, name="f", arguments={}, raw="", output="", error=e) for e in errors
    ]
    return TrajectoryBuilder([1, 2, 3]).build(TrajectoryMeta(episode_id="e", tool_calls=calls))


# ---------------------------------------------------------------------------------------------
# @reward and score


async def test_sync_and_async_rewards_are_summed_with_their_weights():
    @reward
    def correct(task: dict, response: str) -> float:
        return float(response.strip() == task["answer"])

    @reward(weight=0.5)
    async def short(response: str) -> float:
        await asyncio.sleep(0)
        return 1.0 if len(response) < 10 else 0.0

    total, info = await score([correct, short], TASK, " 0.5 ")
    assert total == 1.5
    assert info == {"correct": 1.0, "short": 1.0}


async def test_parameters_are_injected_by_name_in_any_order():
    seen: dict[str, Any] = {}

    @reward
    def by_name(traj: Trajectory | None, task: dict, transcript: list | None) -> int:
        seen.update(traj=traj, task=task, transcript=transcript)
        return 1

    @reward
    def everything(**kwargs: Any) -> bool:
        seen["kwargs"] = sorted(kwargs)
        return True

    trajectory = make_trajectory([])
    transcript = [{"role": "user", "content": "hi"}]
    total, _ = await score(
        [by_name, everything], TASK, "r", transcript=transcript, trajectory=trajectory
    )
    assert total == 2.0
    assert seen["traj"] is trajectory
    assert seen["task"] == TASK
    assert seen["transcript"] == transcript
    assert seen["kwargs"] == ["response", "task", "trajectory", "transcript"]


async def test_task_models_reach_rewards_as_dicts():
    class Task(BaseModel):
        id: str
        answer: str

    @reward
    def check(task: dict) -> float:
        assert isinstance(task, dict)
        return float(task["answer"] == "x")

    assert await score(check, Task(id="a", answer="x"), "") == (1.0, {"check": 1.0})


def test_a_parameter_that_cannot_be_filled_is_rejected_at_decoration():
    def needs_answer(task: dict, answer: str) -> float:
        return 0.0

    with pytest.raises(TypeError, match="parameter 'answer' cannot be filled"):
        reward(needs_answer)


async def test_decorated_function_stays_directly_callable():
    @reward
    def plain(response: str) -> float:
        return len(response)

    assert plain(response="abc") == 3
    assert isinstance(plain, RewardFn)


async def test_dict_components_sum_by_default_and_are_kept_in_the_info():
    @reward
    def parts(response: str) -> dict[str, float]:
        return {"a": 0.25, "b": 0.5}

    total, info = await score(parts, TASK, "")
    assert total == 0.75
    assert info == {"parts": 0.75, "parts/a": 0.25, "parts/b": 0.5}


async def test_dict_components_use_the_given_weights():
    @reward(weights={"tests": 1.0, "lint": 0.1})
    def code(response: str) -> dict[str, float]:
        return {"tests": 1.0, "lint": 1.0}

    total, info = await score(code, TASK, "")
    assert total == pytest.approx(1.1)
    assert info["code/lint"] == 1.0


async def test_a_component_without_a_weight_is_an_error():
    @reward(weights={"tests": 1.0})
    def code(response: str) -> dict[str, float]:
        return {"tests": 1.0, "lnt": 1.0}

    with pytest.raises(RewardError, match=r"components \['lnt'\] that have no weight"):
        await score(code, TASK, "")


async def test_a_raising_reward_is_a_reward_error_naming_it():
    @reward
    def broken(task: dict) -> float:
        return float(task["missing"])

    with pytest.raises(RewardError, match="reward 'broken' raised KeyError: 'missing'") as info:
        await score(broken, TASK, "")
    assert isinstance(info.value.__cause__, KeyError)


async def test_an_async_reward_past_its_timeout_is_a_reward_error():
    @reward(timeout=0.1)
    async def hangs(response: str) -> float:
        await asyncio.sleep(30)
        return 1.0

    started = time.monotonic()
    with pytest.raises(RewardError, match=r"'hangs' did not finish within 0\.1s"):
        await score(hangs, TASK, "")
    assert time.monotonic() - started < 5


async def test_a_sync_reward_past_the_default_timeout_is_a_reward_error():
    # The reward blocks for 10 s unless released: `score` must give up at its 0.1 s timeout,
    # so returning within 5 s (room for a loaded machine) tells abandoning from waiting.
    release = threading.Event()

    @reward
    def blocks(response: str) -> float:
        release.wait(10)
        return 1.0

    started = time.monotonic()
    try:
        with pytest.raises(RewardError, match=r"'blocks' did not finish within 0\.1s"):
            await score(blocks, TASK, "", timeout=0.1)
        elapsed = time.monotonic() - started
    finally:
        release.set()  # the abandoned thread ends now instead of after 10 s
    assert elapsed < 5, f"score returned after {elapsed:.1f}s: it waited for the reward"


async def test_a_failure_cancels_the_other_rewards():
    finished: list[str] = []

    @reward
    async def slow(response: str) -> float:
        await asyncio.sleep(30)
        finished.append("slow")
        return 1.0

    @reward
    def fails(response: str) -> float:
        raise ValueError("boom")

    started = time.monotonic()
    with pytest.raises(RewardError, match="'fails' raised ValueError: boom"):
        await score([slow, fails], TASK, "")
    assert time.monotonic() - started < 5
    assert finished == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1.0", None, [1.0], {"a": "x"}])
async def test_values_that_are_not_finite_numbers_are_reward_errors(value: Any):
    @reward
    def odd(response: str) -> Any:
        return value

    with pytest.raises(RewardError, match="reward 'odd'"):
        await score(odd, TASK, "")


async def test_duplicate_reward_names_are_rejected():
    with pytest.raises(ValueError, match="repeated: \\['exact_match'\\]"):
        await score([exact_match, ExactMatch()], TASK, "0.5")


async def test_no_rewards_score_zero_with_no_info():
    assert await score([], TASK, "") == (0.0, {})


async def test_plain_functions_are_accepted_as_rewards():
    def bare(response: str) -> float:
        return 2.0

    assert await score([bare], TASK, "") == (2.0, {"bare": 2.0})


async def test_combine_weights_members_and_nests_their_components():
    @reward
    def correct(response: str) -> float:
        return 1.0

    @reward
    def style(response: str) -> dict[str, float]:
        return {"length": 1.0, "tone": 0.0}

    both = combine(correct, style, weights=[1.0, 0.1], name="total")
    result, info = await score(both, TASK, "")
    assert result == pytest.approx(1.1)
    assert info == {
        "total": pytest.approx(1.1),
        "total/correct": 1.0,
        "total/style": 1.0,
        "total/style/length": 1.0,
        "total/style/tone": 0.0,
    }


def test_a_reward_declares_what_of_an_episode_it_reads():
    @reward
    def by_answer(task: dict, response: str) -> float:
        return 1.0

    @reward
    def by_tokens(traj: Trajectory) -> float:
        return 1.0

    @reward
    def anything(**inputs: Any) -> float:
        return 1.0

    def plain(response: str) -> float:
        return 1.0

    assert reward_inputs(by_answer) == {"task", "response"}
    assert reward_inputs(by_tokens) == {"trajectory"}
    assert reward_inputs(anything) == EPISODE_INPUTS
    assert reward_inputs(as_reward_fn(plain)) == {"response"}
    assert reward_inputs(combine(by_answer, by_tokens)) == {"task", "response", "trajectory"}
    assert reward_inputs(exact_match) == {"task", "response"}
    # A reward that declares nothing is given everything.
    assert reward_inputs(format_reward) == EPISODE_INPUTS


async def test_combine_uses_member_weights_by_default_and_propagates_failures():
    @reward(weight=3.0)
    def three(response: str) -> float:
        return 1.0

    @reward
    def bad(response: str) -> float:
        raise RuntimeError("no")

    assert (await score(combine(three), TASK, ""))[0] == 3.0
    with pytest.raises(RewardError, match="'bad' raised RuntimeError: no"):
        await score(combine(three, bad), TASK, "")
    with pytest.raises(ValueError, match="2 rewards but 1 weights"):
        combine(three, bad, weights=[1.0])


# ---------------------------------------------------------------------------------------------
# Answer extraction


def test_last_boxed_matches_braces():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed 5 apples") == "5"
    assert last_boxed(r"\boxed{3} and a truncated \boxed{\frac{1}{") == "3"
    assert last_boxed("no box") is None


def test_final_answer_prefers_boxed_then_answer_tag_then_last_line():
    assert final_answer("work\n\\boxed{42}\nso that is it") == "42"
    assert final_answer("<answer> Paris </answer>") == "Paris"
    assert final_answer(r"<answer>it is \boxed{3}</answer> \boxed{4}") == "3"
    assert final_answer("line one\nThe answer: 7\n\n") == "The answer: 7"
    assert final_answer("   ") is None


def test_final_answer_ignores_reasoning_and_tool_calls():
    response = r"<think>\boxed{1}</think>" + format_tool_call("f", {"x": r"\boxed{2}"}) + "\n9"
    assert final_answer(response) == "9"
    assert final_answer("<think>unfinished \\boxed{5}") is None


def test_normalize_answer():
    assert normalize_answer("  $The  Answer.$ ") == "the answer"
    assert normalize_answer("ＡＢ", case_sensitive=True) == "AB"


# ---------------------------------------------------------------------------------------------
# exact_match


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (r"so \boxed{0.5}", 1.0),
        ("<answer>0.5.</answer>", 1.0),
        ("thinking...\n0.5", 1.0),
        (r"\boxed{1/2}", 0.0),
        ("<think>0.5</think>no idea", 0.0),
        ("", 0.0),
    ],
)
async def test_exact_match(response: str, expected: float):
    assert await score(exact_match, TASK, response) == (expected, {"exact_match": expected})


async def test_exact_match_options_and_list_answers():
    strict = ExactMatch(answer_key="label", case_sensitive=True, name="label")
    task = {"id": "t", "label": ["Paris", "paris, france"]}
    assert (await score(strict, task, "<answer>Paris</answer>"))[0] == 1.0
    assert (await score(strict, task, "<answer>PARIS</answer>"))[0] == 0.0
    assert (await score(ExactMatch(answer_key="label"), task, "Paris, France"))[0] == 1.0


async def test_exact_match_without_a_reference_answer_is_a_reward_error():
    with pytest.raises(RewardError, match="task 'x' has no 'answer'"):
        await score(exact_match, {"id": "x", "answer": None}, "1")


# ---------------------------------------------------------------------------------------------
# math_equal


@pytest.fixture(scope="module")
def math() -> Any:
    reward_fn = MathEqual(workers=1)
    yield reward_fn
    reward_fn.close()


@pytest.mark.parametrize(
    ("answer", "response"),
    [
        ("0.5", r"\boxed{\frac{1}{2}}"),
        ("1/2", "<answer>0.5</answer>"),
        (r"\frac{1}{2}", r"the result is \boxed{\dfrac12}"),
        ("0.5", "1/2"),
        (r"\frac{\sqrt{2}}{2}", r"\boxed{\sqrt{2}/2}"),
        ("1000", r"\boxed{1,000}"),
        ("x^2+1", r"\boxed{1 + x^2}"),
        ("Paris", "<answer>paris</answer>"),
        ("42", "Adding them up.\nSo the answer is 42."),
    ],
)
async def test_math_equal_accepts_equivalent_forms(math: MathEqual, answer: str, response: str):
    assert await score(math, {"id": "t", "answer": answer}, response) == (1.0, {"math_equal": 1.0})


@pytest.mark.parametrize(
    ("answer", "response"),
    [
        ("0.5", r"\boxed{0.25}"),
        ("1/3", r"\boxed{0.3}"),
        ("1", r"\boxed{1 + x^2}"),
        ("Paris", "London"),
        ("2", "no answer"),
    ],
)
async def test_math_equal_rejects_different_values(math: MathEqual, answer: str, response: str):
    assert (await score(math, {"id": "t", "answer": answer}, response))[0] == 0.0


async def test_math_equal_accepts_numeric_reference_answers(math: MathEqual):
    assert (await score(math, {"id": "t", "answer": 0.5}, r"\boxed{\frac12}"))[0] == 1.0


async def test_math_equal_without_a_reference_answer_is_a_reward_error(math: MathEqual):
    with pytest.raises(RewardError, match="has no 'answer'"):
        await score(math, {"id": "t"}, "1")


async def test_a_hung_math_verify_worker_is_killed_and_replaced(math: MathEqual):
    payload = {"gold": "1/2", "pred": "0.5", "parsing_timeout": 5, "verify_timeout": 5}
    with pytest.raises(RewardError, match="did not answer within"):
        await math.pool.compare(payload, limit=0.0)
    assert await math.pool.compare(payload, limit=60.0) == {"equal": True}


# ---------------------------------------------------------------------------------------------
# format_reward


async def test_format_reward_checks_the_answer_form():
    tag_only = FormatReward(answer="tag", tool_calls=False, name="fmt")
    assert (await score(tag_only, TASK, "<answer>1</answer>"))[0] == 1.0
    assert (await score(tag_only, TASK, r"\boxed{1}"))[0] == 0.0
    assert (await score(tag_only, TASK, "<answer> </answer>"))[0] == 0.0
    boxed_only = FormatReward(answer="boxed", tool_calls=False, name="fmt")
    assert (await score(boxed_only, TASK, r"\boxed{1}"))[0] == 1.0
    assert (await score(boxed_only, TASK, r"<think>\boxed{1}</think>"))[0] == 0.0


async def test_format_reward_scores_the_share_of_well_formed_tool_calls():
    good, bad = format_tool_call("f", {}), "<tool_call>{oops</tool_call>"
    transcript = [
        {"role": "user", "content": good},
        {"role": "assistant", "content": good + bad},
        {"role": "tool", "content": "x"},
        {"role": "assistant", "content": good + r"\boxed{1}"},
    ]
    total, info = await score(format_reward, TASK, r"\boxed{1}", transcript=transcript)
    assert info["format_reward/tool_calls"] == pytest.approx(2 / 3)
    assert info["format_reward/answer"] == 1.0
    assert total == pytest.approx((1 + 2 / 3) / 2)

    trajectory = make_trajectory([None, "parse_error", "tool_error", "parse_error"])
    _, info = await score(format_reward, TASK, "", trajectory=trajectory)
    assert info["format_reward/tool_calls"] == 0.5
    assert info["format_reward/answer"] == 0.0

    _, info = await score(format_reward, TASK, "no calls at all")
    assert info["format_reward/tool_calls"] == 1.0


async def test_format_reward_think_check():
    think = FormatReward(answer=None, tool_calls=False, think=True, name="think")
    assert (await score(think, TASK, "<think>hmm</think>42"))[0] == 1.0
    assert (await score(think, TASK, "hmm</think>42"))[0] == 1.0
    assert (await score(think, TASK, "<think>hmm, still going"))[0] == 0.0
    assert (await score(think, TASK, "42"))[0] == 0.0


def test_format_reward_needs_a_check():
    with pytest.raises(ValueError, match="at least one check"):
        FormatReward(answer=None, tool_calls=False)
