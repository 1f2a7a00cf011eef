"""Where a parity run failed first: one headline (`first failure: model M, dtype D, path P, prompt I, position N
(prefill | decode step K)`), then the text before that position, both sides' top tokens there, the statistic that
failed beside its tolerance or limit, and the command that re-runs only that prompt and path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

from harness import golden as G
from harness.parity.gate import GATED, ParityResult, PathResult, PromptResult, Where
from harness.subjects import OWN

CONTEXT_TOKENS = 24  # how much text before the failing position is shown


@dataclass
class Failure:
    path: str
    prompt: int  # index in the golden
    name: str  # the prompt's name, when one prompt failed ("" for a path's distribution)
    at: Where | None  # the position shown (None: the engine produced no logits there)
    position: int  # absolute position
    step: int | None  # decode step (0: the prefill's last position); None: an earlier prompt position
    statistic: str  # what failed, beside its tolerance or limit
    kind: str  # "logprob", "divergence", "missing" or "distribution"


def _prompt_failure(result: ParityResult, p: PromptResult) -> Failure:
    at = p.failure
    if not at.engine_top:  # a position the engine never produced
        return Failure(p.path, p.index, p.prompt, None, at.position, at.step, p.reason, "missing")
    if p.reason.startswith("token differs"):
        div = p.divergence
        gap = div["golden_logprob_gap"]
        gap_text = "the engine's token is outside the golden's top-K" if gap is None else \
            f"the golden's logprob gap between them {gap:.3g} > near-tie tolerance {result.tie_tol:.3g}"
        stat = (f"greedy divergence at decode step {div['step']}: golden token {div['golden_token']} vs engine "
                f"{div['engine_token']}; {gap_text}")
        return Failure(p.path, p.index, p.prompt, at, at.position, at.step, stat, "divergence")
    worst = p.worst.value if p.worst is not None else at.value
    stat = (f"largest logprob err {worst:.3g} (at position {p.worst.position if p.worst else at.position}) vs tol "
            f"{result.tol:.3g}; here, the first position over tol, err {at.value:.3g}")
    return Failure(p.path, p.index, p.prompt, at, at.position, at.step, stat, "logprob")


def _path_failure(path: PathResult) -> Failure:
    over = [k for k in GATED if k in path.stats and path.limits and path.stats[k] > path.limits[k]]
    at = path.worst_kl if over and over[0].startswith("kl") else path.worst_err
    stat = f"distribution gate over {path.positions} positions: {path.reason}"
    if at is not None:
        stat += f"; shown: the position of the largest {'KL' if at is path.worst_kl else 'err'}, {at.value:.3g}"
    return Failure(path.path, at.prompt if at else 0, "", at, at.position if at else 0, at.step if at else None, stat,
                   "distribution")


def first_failure(result: ParityResult, path_name: str | None = None) -> Failure | None:
    """The first failure in the order the paths ran (of path `path_name` only, if given): a failing prompt, else the
    path's distribution gate."""
    for path in result.paths:
        if path_name is not None and path.path != path_name:
            continue
        prompt = next((p for p in result.prompts if p.path == path.path and not p.passed), None)
        if prompt is not None:
            return _prompt_failure(result, prompt)
        if not path.passed:
            return _path_failure(path)
    return None


def _where_words(f: Failure) -> str:
    return "prefill" if f.step is None else f"decode step {f.step}"


def headline(result: ParityResult, path_name: str | None = None) -> str | None:
    """`first failure: model M, dtype D, path P, prompt I, position N (prefill | decode step K)` (of path `path_name`
    only, if given); None on a pass."""
    f = first_failure(result, path_name)
    if f is None:
        return None
    return (f"first failure: model {result.model}, dtype {result.dtype}, path {f.path}, prompt {f.prompt}, "
            f"position {f.position} ({_where_words(f)})")


def rerun_command(result: ParityResult, f: Failure) -> str:
    tp = f" --tp {result.tp}" if result.tp > 1 else ""
    tp += " --batch-invariant" if result.batch_invariant else ""
    tp += f" --engine {result.engine}" if result.engine != OWN else ""
    model = result.model_args or f"--model {result.model}"
    return (f"python -m harness parity {model} --device {result.device} --dtype {result.dtype} --path {f.path} "
            f"--prompt {f.prompt}{tp}")


def _top(tokenizer: Any, pairs: List[List[float]]) -> str:
    return "  ".join(f"{tokenizer.decode([int(i)])!r} {lp:.4g}" for i, lp in pairs)


def failure_block(result: ParityResult, gs: G.GoldenSet, tokenizer: Any) -> str | None:
    """The headline and what a person acts on; gs: the full golden, tokenizer: the model folder's."""
    f = first_failure(result)
    if f is None:
        return None
    pg = gs.prompts[f.prompt]
    seq = [int(t) for t in pg.prompt_ids] + [int(t) for t in pg.tokens]
    start = max(0, f.position + 1 - CONTEXT_TOKENS)
    lines = [headline(result),
             f"  prompt {f.prompt} ({pg.name!r}); text up to position {f.position} (tokens {start}..{f.position}), "
             f"whose next token is predicted there: {tokenizer.decode(seq[start:f.position + 1])!r}"]
    if f.at is not None:
        lines += [f"  golden top-5: {_top(tokenizer, f.at.golden_top)}",
                  f"  engine top-5: {_top(tokenizer, f.at.engine_top)}"]
    statistic = f.statistic
    if f.kind == "divergence":
        div = next(p.divergence for p in result.prompts if p.path == f.path and p.index == f.prompt)
        statistic += f" ({tokenizer.decode([div['golden_token']])!r} vs {tokenizer.decode([div['engine_token']])!r})"
    lines.append(f"  failed: {statistic}")
    if result.nondeterministic:
        lines += [f"  {result.nondeterministic}",
                  f"  this path again (its bits may differ once more): {rerun_command(result, f)}"]
    else:
        lines.append("  re-run this path, judging only this prompt (run in the same company): "
                     + rerun_command(result, f))
    if result.engine == OWN:  # --explain hooks this engine's layers; another engine's are not the harness's to hook
        lines.append("  why: the same command with --explain compares each layer's residual stream with HF's")
    if result.obtained:
        lines.append(f"  the engine's result, in the golden's format: {result.obtained}")
    return "\n".join(lines)
