"""The packaged workloads (code_edit, agentic, longdoc_*): built offline, deterministic, and shaped
like the traffic they stand for."""

from __future__ import annotations

import json
import re

import pytest

from speculation import assets
from speculation.assets.cache import AssetError
from speculation.assets.records import read_packaged
from speculation.assets.workloads import CHARS_PER_TOKEN, LONGDOC_TOKENS, WORKLOADS

_REACT_NEXT = "\n\nContinue the transcript"


def test_every_workload_is_a_dataset_name_and_builds_deterministically():
    for name in WORKLOADS:
        assert name in assets.PACKAGED_DATASETS
        first = assets.load_questions(name)
        assert first == assets.load_questions(name)
        assert len({q.question_id for q in first}) == len(first), name
        assert {q.category for q in first} == {name}
    with pytest.raises(AssetError, match="code_edit, agentic, longdoc_2k"):
        assets.load_questions("code_edits")


def test_code_edit_sends_the_whole_function_and_asks_for_a_rewrite():
    questions = assets.load_questions("code_edit")
    records = [rec for _, _, rec in read_packaged("humaneval")]
    assert len(questions) == len(records) == 164
    kinds = set()
    for q, rec in zip(questions, records):
        assert len(q.turns) == 2
        code = (rec["prompt"] + rec["canonical_solution"]).rstrip()
        assert code in q.turns[0]  # the real function, whole
        assert f"`{rec['entry_point']}`" in q.turns[0] and "complete updated code" in q.turns[1]
        kinds.update(q.question_id.split("/")[-1].split("+"))
    assert kinds == {"rename", "add_parameter", "error_handling", "to_class", "write_tests"}
    assert assets.load_questions("code_edit", limit_per_category=3) == questions[:3]


def test_agentic_requests_resend_the_growing_transcript_with_json_tool_calls():
    questions = assets.load_questions("agentic")
    episodes: dict[str, list] = {}
    for q in questions:
        episodes.setdefault(q.question_id.rsplit("/", 1)[0], []).append(q)
    assert len(episodes) == 72 and all(len(steps) == 3 for steps in episodes.values())
    for steps in episodes.values():
        texts = [s.turns[0] for s in steps]
        for before, after in zip(texts, texts[1:]):
            prefix = before[: before.index(_REACT_NEXT)]
            assert after.startswith(prefix) and len(after) > len(before)  # the transcript so far, re-sent
        actions = [json.loads(line[len("Action: "):]) for line in texts[-1].splitlines()
                   if line.startswith("Action: {")]
        assert len(actions) == 2 and {a["tool"] for a in actions} <= {"search", "read", "calculator"}
        if actions[0]["tool"] == "search":  # the read call copies an id from the search observation
            observation = json.loads(re.search(r"^Observation: (\[.*\])$", texts[-1], re.M).group(1))
            assert actions[1]["args"]["id"] == observation[0]["id"]
        else:
            results = re.findall(r'^Observation: \{"result": ([-\d.e+]+)\}$', texts[-1], re.M)
            expressions = [a["args"]["expression"] for a in actions]
            assert [float(r) for r in results] == [eval(e, {"__builtins__": {}}) for e in expressions]


def test_longdoc_sizes_grow_and_fit_smollm2s_positions():
    sizes = {}
    for name, tokens in LONGDOC_TOKENS.items():
        questions = assets.load_questions(name)
        assert len(questions) == 12
        chars = [len(q.turns[0]) for q in questions]
        assert max(chars) <= tokens * CHARS_PER_TOKEN + 400  # the document budget plus the question
        sizes[name] = sum(chars) / len(chars)
        for q in questions:
            document, ask = q.turns[0].rsplit("\n\n", 1)
            named = re.search(r"Article (\d+)", ask)
            if named:  # the question names an article the document has
                assert f"Article {named.group(1)}:\n" in document
            else:  # or quotes a word the document contains
                assert re.search(r'"(.+)"', ask).group(1) in document
    assert sizes["longdoc_2k"] < sizes["longdoc_4k"] < sizes["longdoc_8k"]
    assert LONGDOC_TOKENS["longdoc_8k"] + 512 <= 8192  # room for the answer in SmolLM2's positions
