"""paradraft: speculative decoding with a draft model and causal correction."""

from __future__ import annotations

import argparse

from . import (
    bench,
    build,
    demo,
    distill,
    evaluate,
    fetch,
    generate,
    import_gguf,
    loadtest,
    query,
    serve,
    soak,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="paradraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (fetch, generate, bench, build, import_gguf, evaluate, serve, demo, loadtest,
                    query, distill, soak):
        command.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, OSError, RuntimeError) as e:  # OSError: a full disk, a missing file
        parser.exit(2, f"paradraft: error: {e}\n")


if __name__ == "__main__":
    main()
