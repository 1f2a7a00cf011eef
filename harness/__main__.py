"""python -m harness {models,golden,parity,sampling,bench,resolution} ... (each verb's --help says more)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable, List


def _models(args: argparse.Namespace) -> int:
    from harness import zoo

    if args.action == "list":
        for name in zoo.MODELS:
            print(f"{name:20s} {'prepared' if zoo.is_prepared(name) else 'not prepared':13s} {zoo.zoo_dir() / name}")
        return 0
    names = args.names or [zoo.DEFAULT_MODEL]
    for name in names:
        folder = zoo.prepare(name, force=args.force) if args.action == "prepare" else zoo.path(name)
        print(folder)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("models", help="prepare, locate or list the zoo's models")
    p.add_argument("action", choices=["prepare", "path", "list"])
    p.add_argument("names", nargs="*", help="model names (default: smollm2-135m)")
    p.add_argument("--force", action="store_true", help="prepare again even if cached")
    p.set_defaults(func=_models)

    for register in _verbs():
        register(sub)
    return parser


# the modules whose register(sub) adds a verb, in the order --help lists them: a new verb package is one line here
VERBS = (
    "harness.golden",
    "harness.parity",
    "harness.sampling",
    "harness.bench",
    "harness.resolution",
)


def _verbs() -> List[Callable[[argparse._SubParsersAction], None]]:
    return [importlib.import_module(name).register for name in VERBS]


def main(argv: List[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
