"""JUnit XML for CI (`--junit FILE` on parity, sampling and fuzz): a verb's checks as test cases, which CI systems
list per test and keep as an artifact. Parity: a testcase per model, dtype and path; sampling: per case and row;
fuzz: per configuration searched. A failing check carries a failure element: its first line as the message, the
whole as its text."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Sequence

from harness import UserError

if TYPE_CHECKING:
    from harness.fuzz.search import FuzzResult
    from harness.parity.gate import ParityResult
    from harness.sampling.report import GridResult


@dataclass(frozen=True)
class TestCase:
    classname: str
    name: str
    seconds: float = 0.0
    failure: str | None = None  # the failure's message; None: the check passed


@dataclass
class Suite:
    name: str
    cases: List[TestCase] = field(default_factory=list)


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--junit", type=Path, metavar="FILE",
                        help="also write every check as a JUnit XML testcase to FILE (for CI)")


def check_path(path: Path | None) -> None:
    """Refuse a --junit FILE that cannot be written, before any work starts."""
    if path is not None and path.is_dir():
        raise UserError(f"--junit {path} is a folder; give the XML file to write, e.g. {path / 'junit.xml'}")


def write(path: Path, suites: Sequence[Suite]) -> Path:
    root = ET.Element("testsuites", _counts([c for s in suites for c in s.cases]))
    for suite in suites:
        el = ET.SubElement(root, "testsuite", {"name": suite.name, **_counts(suite.cases)})
        for case in suite.cases:
            tc = ET.SubElement(el, "testcase", classname=case.classname, name=case.name, time=f"{case.seconds:.3f}")
            if case.failure is not None:
                failure = ET.SubElement(tc, "failure", message=case.failure.splitlines()[0], type="finding")
                failure.text = case.failure
    ET.indent(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    return path


def _counts(cases: Sequence[TestCase]) -> Dict[str, str]:
    return {"tests": str(len(cases)), "failures": str(sum(c.failure is not None for c in cases)), "errors": "0",
            "skipped": "0", "time": f"{sum(c.seconds for c in cases):.3f}"}


# ------------------------------------------------------------------------------------------------ the verbs
def parity_headline(result: "ParityResult", path: str) -> str | None:
    """`first failure: model M, dtype D, path P, prompt I, position N (prefill | decode step K): <what failed>` of one
    path (harness.parity.failure); None when the path passed."""
    from harness.parity.failure import first_failure, headline

    head = headline(result, path)
    return None if head is None else f"{head}: {first_failure(result, path).statistic}"


def parity_suite(result: "ParityResult") -> Suite:
    """A testcase per path of one model, device and dtype: its headline, then every failing prompt."""
    classname = f"parity.{result.model}.{result.device.split(':')[0]}-{result.dtype}{result.mode_suffix}"
    suite = Suite(classname)
    for pr in result.paths:
        headline = parity_headline(result, pr.path)
        if headline is not None:
            failing = [f"prompt {p.prompt}: {p.reason}" for p in result.prompts if p.path == pr.path and not p.passed]
            headline = "\n".join([headline, *failing, *([f"the engine's result: {result.obtained}"]
                                                        if result.obtained else [])])
        suite.cases.append(TestCase(classname, pr.path, pr.seconds, headline))
    return suite


def sampling_suite(result: "GridResult", device: str) -> Suite:
    """A testcase per row of every case; a case's seconds shared among its rows."""
    suite = Suite(f"sampling.{device.split(':')[0]}")
    for r in result.rows:
        rows = sum(x.case == r.case for x in result.rows)
        failure = None if r.passed else (f"sampling case {r.case} row {r.row} ({r.params}): {r.note or 'FAIL'}"
                                         + (f"; p-value {r.p_value:.3g} < alpha {r.alpha:.3g}"
                                            if r.p_value is not None and r.p_value < r.alpha else ""))
        suite.cases.append(TestCase(f"{suite.name}.{r.case}", f"row {r.row}: {r.params}",
                                    result.seconds.get(r.case, 0.0) / rows, failure))
    return suite


def fuzz_suite(result: "FuzzResult") -> Suite:
    """A testcase per configuration searched; the one where the failure was found carries the minimal case."""
    from harness.fuzz.report import failure_text

    o = result.options
    suite = Suite(f"fuzz.{o.model}.{o.device.split(':')[0]}")
    for i, phase in enumerate(result.phases, 1):
        failure, f = None, phase.failure
        if f is not None:
            failure = (failure_text(result.case, result.case_path, result.first) if result.case is not None else
                       f"invariant {f.invariant}, in the {f.stage} run: {f.details}")
        suite.cases.append(TestCase(suite.name, f"configuration {i}: {phase.config}", phase.seconds, failure))
    return suite
