"""The generic verifiable reward ``answer`` (llmtrain.rollout.rewards): the final answer a text
gives, numeric and exact matching, and the start-up refusal of records without an answer column."""

from __future__ import annotations

import json
import re

import pytest

from llmtrain.rollout.rewards import answer_reward, build, final_answer


@pytest.mark.parametrize("text,expected", [
    ("7", "7"),
    ("The answer is 7.", "The answer is 7"),  # the last non-empty line, one trailing period dropped
    ("first 3\nthen 5\n\n", "then 5"),
    ("so x = \\boxed{\\frac{1}{2}} and later 9", "\\frac{1}{2}"),  # the last \boxed wins over later text
    ("\\boxed{1} or \\boxed{2}", "2"),
    ("work: 16 - 3 = 13\n#### 13\nextra", "13\nextra"),  # after the last ####
    ("\\boxed{unclosed 4", "\\boxed{unclosed 4"),  # an unclosed box is no box: the last line
    ("", ""),
])
def test_the_final_answer_of_a_text(text, expected):
    assert final_answer(text) == expected


def test_numeric_answers_match_as_numbers_and_others_as_strings():
    completions = ["7", "7.0", "#### 7", "The answer is 7.", "It is 8.", "no digit", "\\boxed{7}", "1,000 apples",
                   [{"role": "assistant", "content": "I think 7"}]]
    assert answer_reward(completions, answer=["7"] * 8 + ["#### 7"]) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert answer_reward(["1,000 apples", "999.9999999"], answer=["1000", "1000"]) == [1.0, 1.0]
    # Not numbers on both sides: exact strings (stripped, trailing period dropped, case kept).
    assert answer_reward(["Paris.", "paris", "  Paris  ", "3"], answer=["Paris", "Paris", "Paris", "Paris"]) == \
        [1.0, 0.0, 1.0, 0.0]
    assert answer_reward(["yes", "no"], answer=[None, "no"]) == [None, 1.0]  # a null answer scores nothing
    assert answer_reward(["7"], answer=None) == [None]


def test_answer_is_a_built_in_that_reads_the_answer_column():
    [f] = build(["answer"], [2.0], 8)
    assert (f.name, f.weight, f.columns) == ("answer", 2.0, ("answer",))


def test_records_without_an_answer_column_are_refused_in_one_line(tmp_path):
    """The answer reward on records with no 'answer' would score None for every completion: refused
    at start-up, naming the column and data.columns.answer; mapped, it scores any strings."""
    from conftest import make_cfg
    from llmtrain.common.errors import ConfigError
    from llmtrain.rollout import build_rewards

    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"Capital {i}?", "city": "Paris"}) + "\n" for i in range(6)))
    overrides = ["objective=grpo", "data=prompts", f"data.path={path}", "data.columns.prompt=question",
                 "reward.functions=[answer]", "rollout.max_completion_length=8", "objective.num_generations=2"]
    samples = [{"prompt": "q", "prompt_ids": [1], "record": i, "city": "Paris"} for i in range(2)]
    with pytest.raises(ConfigError, match=re.escape("reward.functions[0]=answer reads each record's 'answer' column, "
                                                    "which the records of data.path do not have (theirs: city besides "
                                                    "the prompt); map the column holding them with "
                                                    "data.columns.answer=YOUR_COLUMN")):
        build_rewards(make_cfg(overrides), samples)
    # Strings without a number are fine answers for this reward (gsm8k's check does not apply).
    named = [{"prompt": "q", "prompt_ids": [1], "record": i, "answer": "Paris"} for i in range(2)]
    [f] = build_rewards(make_cfg(overrides + ["data.columns.answer=city"]), named)
    assert f.fn(completions=["Paris", "Rome"], answer=["Paris", "Paris"]) == [1.0, 0.0]
