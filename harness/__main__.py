"""python -m harness {models,golden,parity,sampling,bench,fuzz,resolution,serve} ... (each verb's --help says more).

Exit status, the same for every verb (harness.EXIT_*):
  0  pass: every check held
  1  a finding: a parity or sampling FAIL, a fuzzer failure, HF drifting from a golden (golden --check), a check
     that fails with no fault planted (resolution), an A/B row slower than --fail-if-slower allows (bench --against)
  2  a user error: what was asked cannot be done here (a flag or value, a missing golden, a GPU this machine lacks);
     one line on stderr, `error: <what is wrong>; <what to do>` (-v adds the traceback)
  3  an internal error: the harness or the engine broke; the traceback is kept on stderr
"""

from __future__ import annotations

import os

# Before torch loads its BLAS and OpenMP: neither may choose fewer threads by the machine's load, nor MKL another kernel
# in another process (HF's runs included; an Engine fixes the same itself, engine/utils/threads.py).
# docs/parity-determinism.md says why.
os.environ.update({"MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"})
from engine.utils.threads import MKL_CNR  # noqa: E402 (loads torch: after the environment its OpenMP reads)

os.environ.setdefault("MKL_CBWR", MKL_CNR)  # read when MKL first computes

import argparse
import importlib
import logging
import sys
import traceback
from typing import Callable, List, NoReturn

from harness import EXIT_INTERNAL_ERROR, EXIT_PASS, EXIT_USER_ERROR, UserError, progress


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (an unknown verb, model or flag) in the same one line as the verbs' errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"error: {message}; see {self.prog} --help\n")


def _models(args: argparse.Namespace) -> int:
    from harness import zoo

    if args.action == "check":
        from harness.models import describe, from_folder, zoo_model

        for name in args.names or [zoo.DEFAULT_MODEL]:
            print(describe(zoo_model(name) if name in zoo.MODELS else from_folder(name)))
        return 0
    unknown = [n for n in args.names if n not in zoo.MODELS]
    if unknown:
        raise UserError(f"unknown model {unknown[0]!r}; choose one of: {', '.join(zoo.MODELS)}")
    if args.action == "list":
        for name in zoo.MODELS:
            print(f"{name:20s} {'prepared' if zoo.is_prepared(name) else 'not prepared':13s} {zoo.zoo_dir() / name}")
        return EXIT_PASS
    names = args.names or [zoo.DEFAULT_MODEL]
    for name in names:
        folder = zoo.prepare(name, force=args.force) if args.action == "prepare" else zoo.path(name)
        print(folder)
    return EXIT_PASS


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m harness", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level; errors keep their traceback")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("models", help="prepare, locate or list the zoo's models; check any model folder")
    p.add_argument("action", choices=["prepare", "path", "list", "check"],
                   help="check: what the engine reads from a model (a zoo name or any folder), and its identity")
    p.add_argument("names", nargs="*", help="model names, or folders for check (default: smollm2-135m)")
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
    "harness.subjects.server",
)


def _verbs() -> List[Callable[[argparse._SubParsersAction], None]]:
    return [importlib.import_module(name).register for name in VERBS]


def one_line(message: str) -> str:
    """A message of several lines (a list after a colon, a remedy after it) as one line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return "".join(line if i == 0 else (" " if lines[i - 1].endswith(":") else "; ") + line
                   for i, line in enumerate(lines))


def main(argv: List[str] | None = None) -> int:
    """Run one verb; its exit status (the module's docstring). What the user asked for and this machine cannot do (a
    UserError, a golden refused: GoldenError is one) ends in one line on stderr; any other exception is an internal
    error and keeps its traceback."""
    verbose = False
    progress.quiet_libraries()
    try:
        args = build_parser().parse_args(argv)
        verbose = args.verbose
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return args.func(args)
    except UserError as e:
        if verbose:
            traceback.print_exc()
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception:
        traceback.print_exc()
        print(f"internal error: the harness or the engine broke (the traceback above; exit status "
              f"{EXIT_INTERNAL_ERROR})", file=sys.stderr)
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
