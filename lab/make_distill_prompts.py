#!/usr/bin/env python
"""Write a JSONL of chat prompts for ``paradraft distill --prompts``, composed locally.

Open-ended requests (instruction templates over the topics and programming tasks that
``paradraft distill`` uses when the verifier writes its own prompts) and input-grounded tasks
(summarize, rewrite, fix, explain, rename) over docstrings and short functions of the running
interpreter's standard library. Shuffled with a fixed seed; one {"messages": [...]} per line.

    python lab/make_distill_prompts.py --out models/smollm2-draft/train_prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

from paradraft.runtime.tools.distill import (
    CODE_GROUNDED_TASKS,
    CODE_TASKS,
    GROUNDED_TASKS,
    TOPICS,
)

OPEN_TEMPLATES = (
    "What is {topic}?", "Explain {topic} to a ten-year-old.", "Tell me three facts about {topic}.",
    "Why is {topic} important?", "Write a short poem about {topic}.",
    "Give me some tips about {topic}.", "What are the pros and cons of {topic}?",
    "Write a short story that involves {topic}.", "How would you describe {topic} to a friend?",
    "What is the history of {topic}?", "Write a tweet about {topic}.",
    "What questions should I ask to learn about {topic}?",
)
CODE_TEMPLATES = ("Write a Python function that {task}.",
                  "How do I write a program that {task}?",
                  "Show me JavaScript code that {task}.")
MODULES = ("textwrap.py", "string.py", "random.py", "statistics.py", "fractions.py",
           "calendar.py", "heapq.py", "bisect.py", "shlex.py", "difflib.py", "json/__init__.py",
           "csv.py", "glob.py", "fnmatch.py", "colorsys.py", "base64.py", "zipfile/__init__.py",
           "ipaddress.py", "pprint.py", "queue.py", "sched.py", "secrets.py", "uuid.py")


def stdlib_pieces() -> tuple[list[str], list[str]]:
    """(docstring paragraphs, short function sources) from a few stdlib modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, funcs = [], []
    for name in MODULES:
        path = root / name
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.FunctionDef):
                continue
            doc = ast.get_docstring(node)
            if doc:
                para = " ".join(doc.split("\n\n")[0].split())
                if 60 <= len(para) <= 800:
                    docs.append(para)
            text = ast.get_source_segment(source, node)
            if text and 4 <= text.count("\n") <= 25:
                funcs.append("```python\n" + text + "\n```")
    return docs, funcs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    texts = [t.format(topic=topic) for t in OPEN_TEMPLATES for topic in TOPICS]
    texts += [t.format(task=task) for t in CODE_TEMPLATES for task in CODE_TASKS]
    docs, funcs = stdlib_pieces()
    texts += [rng.choice(GROUNDED_TASKS).format(text=d) for d in docs]
    funcs = rng.sample(funcs, min(len(funcs), 120))
    texts += [rng.choice(CODE_GROUNDED_TASKS).format(text=f) for f in funcs]
    rng.shuffle(texts)
    a.out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n"
                             for t in texts), encoding="utf-8")
    print(f"{len(texts)} prompts ({len(docs)} docstrings, {len(funcs)} functions) -> {a.out}")


if __name__ == "__main__":
    main()
