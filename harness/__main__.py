"""python -m harness {models,golden,parity,sampling,bench,fuzz,resolution} ... (each verb's --help says more)."""

from __future__ import annotations

import os

# Before torch loads its BLAS and OpenMP: neither may choose fewer threads by the machine's load (HF's runs included;
# an Engine fixes the same itself, engine/utils/threads.py). docs/parity-determinism.md says why.
os.environ.update({"MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"})

import argparse
import importlib
import logging
import sys
import traceback
from typing import Callable, List, NoReturn

from harness import UserError


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (an unknown verb, model or flag) in the same one line as the verbs' errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def _models(args: argparse.Namespace) -> int:
    from harness import zoo

    unknown = [n for n in args.names if n not in zoo.MODELS]
    if unknown:
        raise UserError(f"unknown model {unknown[0]!r}; choose one of: {', '.join(zoo.MODELS)}")
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
    parser = _Parser(prog="python -m harness", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level; errors keep their traceback")
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
    "harness.fuzz",
    "harness.resolution",
)


def _verbs() -> List[Callable[[argparse._SubParsersAction], None]]:
    return [importlib.import_module(name).register for name in VERBS]


def one_line(message: str) -> str:
    """A message of several lines (a list after a colon, a remedy after it) as one line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return "".join(line if i == 0 else (" " if lines[i - 1].endswith(":") else "; ") + line
                   for i, line in enumerate(lines))


def main(argv: List[str] | None = None) -> int:
    """Run one verb. What the user asked for and this machine cannot do (a UserError, a golden refused: GoldenError
    is one) ends in one line on stderr and exit status 2; any other exception is an internal error and keeps its
    traceback."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except UserError as e:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
