"""Write models/demo/heldout.jsonl: code snippets from the held-out files of the demo split.

The snippets ship with the models, so bench / eval measure on code the models never saw even
on a machine whose Python has other standard-library sources.

    python lab/make_heldout_snippets.py --demo models/demo
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--demo", default="models/demo")
    ap.add_argument("--snippets", type=int, default=96)
    ap.add_argument("--chars", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    demo = Path(args.demo)
    split = json.loads((demo / "split.json").read_text())
    root = Path(split["stdlib_dir"])
    rng = random.Random(args.seed)
    texts = []
    for rel in split["heldout_files"]:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        # snippets start at a line that opens a def/class, so prompts look like real code
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        for i in rng.sample(starts, min(len(starts), 4)):
            snippet = "".join(lines[i:])[: args.chars]
            if len(snippet) >= args.chars // 2:
                texts.append({"file": rel, "line": i + 1, "text": snippet})
    rng.shuffle(texts)
    texts = texts[: args.snippets]
    out = demo / "heldout.jsonl"
    out.write_text("".join(json.dumps(t) + "\n" for t in texts))
    print(f"wrote {len(texts)} snippets to {out}")


if __name__ == "__main__":
    main()
