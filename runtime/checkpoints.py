"""Checkpoint-side helpers: the shipped demo pair, tokenizers, held-out prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer

DEMO_DIR = Path(__file__).resolve().parent.parent / "models" / "demo"
HELDOUT_FILE = "heldout.jsonl"


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}: pass --prompt-ids or add a tokenizer.json")
    return Tokenizer.from_file(str(path))


def heldout_texts(demo_dir: str | Path) -> list[str]:
    """Held-out code snippets shipped with the demo models (files never seen in training)."""
    path = Path(demo_dir) / HELDOUT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"missing {path} (held-out snippets of the demo split)")
    return [json.loads(line)["text"] for line in path.read_text().splitlines() if line]


def heldout_prompts(tokenizer, texts: list[str], n: int, prompt_tokens: int,
                    seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference continuation ids) pairs, chosen reproducibly."""
    rng = random.Random(seed)
    pool = [tokenizer.encode(t).ids for t in texts]
    pool = [ids for ids in pool if len(ids) > prompt_tokens + 8]
    if not pool:
        raise ValueError(f"no held-out snippet is longer than prompt_tokens={prompt_tokens}")
    picks = [pool[i % len(pool)] for i in rng.sample(range(len(pool)), min(n, len(pool)))]
    while len(picks) < n:
        picks.append(pool[rng.randrange(len(pool))])
    return [(ids[:prompt_tokens], ids[prompt_tokens:]) for ids in picks]
