"""Workloads where most output tokens already exist in the prompt or in earlier requests.

Built offline, deterministically, from the packaged HumanEval and XSum/ASDiv files; each is a
list of :class:`~speculation.assets.datasets.Question` in Spec-Bench's format, so every
``--dataset`` consumer (bench, sweeps, adapt-bench, concurrency runs) takes them unchanged.

* ``code_edit`` (:func:`code_edit`): a real function (HumanEval's prompt + canonical solution)
  and a request to change it: rename, add a parameter, add error handling, convert to a class,
  write tests. A second turn asks for a further edit of the first answer, as a user iterating
  with a code assistant does. A good answer rewrites most of the code it was given.
* ``agentic`` (:func:`agentic`): ReAct transcripts (the single-prompt scratchpad format of
  LangChain's ReAct agent) with JSON tool calls. Each episode is a task plus scripted steps
  (``search`` -> ``read`` -> answer, or ``calculator`` steps); request k re-sends the whole
  transcript up to observation k and asks for the next step, so consecutive requests share an
  ever longer prefix and the next tool call mostly copies ids and values from the observations.
* ``longdoc_2k`` / ``longdoc_4k`` / ``longdoc_8k`` (:func:`longdoc`): numbered XSum articles
  concatenated to about 2K/4K/7.6K tokens (SmolLM2's tokenizer: 4.34 characters per token on
  this text), with one summarisation or extraction question about one article. The 8K size
  stays under SmolLM2's 8,192 positions with room for the answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from speculation.assets.records import Question, read_packaged

# ---------------------------------------------------------------------------------- code_edit


@dataclass(frozen=True)
class _Edit:
    """One code-editing request; ``text(entry, camel)`` renders it for a function."""

    kind: str
    text: Callable[[str, str], str]


_EDITS: tuple[_Edit, ...] = (
    _Edit("rename", lambda f, c: f"Rename the function `{f}` to `{f}_checked` and update every reference to it."),
    _Edit("add_parameter", lambda f, c: (
        f"Add a keyword-only parameter `verbose: bool = False` to `{f}`; when it is true, print each "
        f"intermediate value the function computes.")),
    _Edit("error_handling", lambda f, c: (
        f"Add input validation to `{f}`: raise a `TypeError` with a clear message when an argument has "
        f"the wrong type, and a `ValueError` when a value is out of range.")),
    _Edit("to_class", lambda f, c: (
        f"Convert the code into a class `{c}` whose method `{f}` does the same work; keep the docstring "
        f"and the type hints.")),
    _Edit("write_tests", lambda f, c: (
        f"Write pytest tests for `{f}`: one test per docstring example, plus edge cases.")),
)

_CODE_EDIT_TAIL = "Reply with the complete updated code in one ```python block."


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part) or "Solution"


def code_edit() -> Iterator[Question]:
    """Two-turn code edits of HumanEval's 164 canonical solutions (edit kinds rotate per task)."""
    for index, (path, lineno, rec) in enumerate(read_packaged("humaneval")):
        code = (str(rec["prompt"]) + str(rec["canonical_solution"])).rstrip() + "\n"
        entry = str(rec["entry_point"])
        camel = _camel(entry)
        first = _EDITS[index % len(_EDITS)]
        second = _EDITS[(index + 2) % len(_EDITS)]
        turn1 = f"Here is my code:\n```python\n{code}```\n{first.text(entry, camel)} {_CODE_EDIT_TAIL}"
        turn2 = f"Thanks. Now, starting from your version: {second.text(entry, camel)} {_CODE_EDIT_TAIL}"
        task = str(rec["task_id"]).replace("HumanEval/", "")
        yield Question(f"code_edit/{task}/{first.kind}+{second.kind}", "code_edit", (turn1, turn2))


# ---------------------------------------------------------------------------------- agentic

_TOOLS = (
    'search: search the news archive. Arguments: {"query": string}. Returns a JSON list of '
    '{"id": string, "title": string, "snippet": string}.\n'
    'read: read one article. Arguments: {"id": string}. Returns {"id": string, "text": string}.\n'
    'calculator: evaluate an arithmetic expression. Arguments: {"expression": string}. '
    'Returns {"result": number}.'
)

_REACT_HEADER = (
    "Answer the following question as best you can. You have access to the following tools:\n\n"
    f"{_TOOLS}\n\n"
    "Use the following format:\n\n"
    "Question: the input question you must answer\n"
    "Thought: you should always think about what to do\n"
    'Action: a JSON object {"tool": <tool name>, "args": <arguments>}\n'
    "Observation: the result of the action\n"
    "... (this Thought/Action/Observation can repeat N times)\n"
    "Thought: I now know the final answer\n"
    "Final Answer: the final answer to the original input question\n\n"
    "Begin!\n\n"
)

_REACT_NEXT = "\n\nContinue the transcript: write the next Thought and then either an Action or the Final Answer."

_AGENT_RESULTS = 3  # search results per observation: the answer's article and two others
_AGENT_TEXT_CHARS = 1200  # an article observation is cut here (as tool wrappers cut long results)
_NEWS_EPISODES = 48
_MATH_EPISODES = 24


def _action(tool: str, **args: Any) -> str:
    return "Action: " + json.dumps({"tool": tool, "args": args})


def _observation(value: Any) -> str:
    return "Observation: " + json.dumps(value, ensure_ascii=False)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip() + " ..."


_WORD = re.compile(r"[A-Za-z][A-Za-z'-]{3,}")


def _keywords(text: str, n: int = 5) -> str:
    """The ``n`` longest distinct words of ``text`` in their order (a user's search query)."""
    words = list(dict.fromkeys(_WORD.findall(text)))
    keep = set(sorted(words, key=len, reverse=True)[:n])
    return " ".join(w for w in words if w in keep)


def _episode(qid: str, question: str, steps: list[tuple[str, str, str]]) -> Iterator[Question]:
    """One request per step: the transcript up to (and including) that step's observation.

    ``steps``: (thought, action line, observation line) of the scripted trajectory.
    """
    transcript = f"{_REACT_HEADER}Question: {question}"
    yield Question(f"{qid}/step0", "agentic", (transcript + _REACT_NEXT,))
    for k, (thought, action, observation) in enumerate(steps, start=1):
        transcript += f"\nThought: {thought}\n{action}\n{observation}"
        yield Question(f"{qid}/step{k}", "agentic", (transcript + _REACT_NEXT,))


def _news_episodes() -> Iterator[Question]:
    articles = [rec for _, _, rec in read_packaged("xsum")][: _NEWS_EPISODES + _AGENT_RESULTS]
    for e in range(_NEWS_EPISODES):
        rec = articles[e]
        doc_id, summary = f"xsum-{rec.get('id', e)}", str(rec["summary"]).strip()
        query = _keywords(summary)
        results = []
        for j in range(_AGENT_RESULTS):  # the answer's article first, then its neighbours
            other = articles[(e + j) % len(articles)]
            results.append({
                "id": f"xsum-{other.get('id', (e + j) % len(articles))}",
                "title": str(other["summary"]).strip(),
                "snippet": _cut(str(other["document"]).strip(), 160),
            })
        question = f"What does the news article about {query} report, and who is involved?"
        steps = [
            ("I should search the archive for the article.", _action("search", query=query), _observation(results)),
            (f"The first result, {doc_id}, matches the question. I should read it.", _action("read", id=doc_id),
             _observation({"id": doc_id, "text": _cut(str(rec["document"]).strip(), _AGENT_TEXT_CHARS)})),
        ]
        yield from _episode(f"agentic/news{e}", question, steps)


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _math_episodes() -> Iterator[Question]:
    made = 0
    for index, (_, _, rec) in enumerate(read_packaged("asdiv")):
        if made >= _MATH_EPISODES:
            return
        passage, question = str(rec["passage"]).strip(), str(rec["question"]).strip()
        numbers = _NUMBER.findall(passage)
        if len(numbers) < 2:
            continue
        a, b = numbers[0], numbers[1]
        steps = []
        for op, name in (("+", "sum"), ("*", "product")):
            expr = f"{a} {op} {b}"
            value = float(a) + float(b) if op == "+" else float(a) * float(b)
            value_json: int | float = int(value) if value.is_integer() else round(value, 6)
            steps.append((f"I should compute the {name} of {a} and {b}.", _action("calculator", expression=expr),
                          _observation({"result": value_json})))
        made += 1
        yield from _episode(f"agentic/math{index}", f"{passage} {question}", steps)


def agentic() -> Iterator[Question]:
    """ReAct episodes: 48 news-research (search, read, answer) and 24 arithmetic (calculator) ones,
    three requests each, every request re-sending the transcript so far."""
    yield from _news_episodes()
    yield from _math_episodes()


# ---------------------------------------------------------------------------------- longdoc

CHARS_PER_TOKEN = 4.34
"""SmolLM2-135M's tokenizer on the packaged XSum text (measured over 200 articles)."""

LONGDOC_TOKENS: dict[str, int] = {"longdoc_2k": 2048, "longdoc_4k": 4096, "longdoc_8k": 7600}
"""Approximate document tokens per longdoc workload (8K leaves room under 8,192 positions)."""

_LONGDOC_QUESTIONS = 12

_LONGDOC_ASKS: tuple[Callable[[int, str], str], ...] = (
    lambda k, w: f"Summarize Article {k} in two sentences.",
    lambda k, w: f"Quote, word for word, the first two sentences of Article {k}.",
    lambda k, w: f"List every person, organisation and place named in Article {k}.",
    lambda k, w: f"Which article mentions \"{w}\"? Quote the sentence that contains it.",
)


def longdoc(name: str) -> Iterator[Question]:
    """Numbered articles concatenated to ``LONGDOC_TOKENS[name]`` tokens, one question each.

    Question i starts at article ``3 * i`` of the packaged XSum file (so documents overlap only
    partly between questions) and asks about one article in the middle of its document.
    """
    budget_chars = int(LONGDOC_TOKENS[name] * CHARS_PER_TOKEN)
    records = [rec for _, _, rec in read_packaged("xsum")]
    for i in range(_LONGDOC_QUESTIONS):
        parts: list[str] = []
        used = 0
        j = 3 * i
        while j < len(records):
            body = str(records[j]["document"]).strip()
            part = f"Article {len(parts) + 1}:\n{body}"
            if used + len(part) > budget_chars and parts:
                break
            parts.append(_cut(part, budget_chars - used) if not parts else part)
            used += len(part) + 2
            j += 1
        k = (len(parts) + 1) // 2  # an article in the middle: the hardest place to retrieve from
        words = _WORD.findall(parts[k - 1])
        word = max(words, key=len) if words else "the"
        ask = _LONGDOC_ASKS[i % len(_LONGDOC_ASKS)](k, word)
        text = "Read the following articles.\n\n" + "\n\n".join(parts) + f"\n\n{ask}"
        yield Question(f"{name}/{i}", name, (text,))


WORKLOADS: dict[str, Callable[[], Iterator[Question]]] = {
    "code_edit": code_edit,
    "agentic": agentic,
    **{name: (lambda name=name: longdoc(name)) for name in LONGDOC_TOKENS},
}
"""Workload name -> builder; each is a ``--dataset`` name (see :func:`~speculation.assets.datasets.load_questions`)."""
