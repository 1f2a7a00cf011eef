"""Parity paths for an engine behind an API (`--engine vllm | openai:URL`): the harness cannot build its batches, so
of the paths it walks the ones a request's shape alone makes: every prompt in one call (the engine batches them as
it will), each prompt alone, and free-running greedy generation. Teacher-forced, a prompt is sent followed by its
golden continuation but the last token, with one token to generate: the top-K at every golden position in one
request."""

from __future__ import annotations

from typing import Dict, List

from harness import golden as G
from harness.compare import PositionStat, compare_topk
from harness.parity.gate import golden_row
from harness.parity.paths import PATHS, ParityPath
from harness.subjects.base import Scored, Subject

REMOTE = ("batch", "single", "free")
REMOTE_PATHS = tuple(p for p in PATHS if p.name in REMOTE)


def run_remote_path(path: ParityPath, subject: Subject, gs: G.GoldenSet) -> tuple:
    """As run_path gives them: per prompt the PositionStat of every position, the engine's tokens, no router
    margins (a black box shows none)."""
    k = min(subject.top_k, gs.prompts[0].prefill_ids.shape[1])
    if path.forced:
        seqs = [list(map(int, pg.prompt_ids)) + list(map(int, pg.tokens[:-1])) for pg in gs.prompts]
        new = [1] * len(seqs)
    else:
        seqs = [list(map(int, pg.prompt_ids)) for pg in gs.prompts]
        new = [len(pg.tokens) for pg in gs.prompts]
    if path.one_at_a_time:
        scored: List[Scored] = [subject.score([s], [m], k)[0] for s, m in zip(seqs, new)]
    else:
        scored = subject.score(seqs, new, k)
    stats: Dict[int, Dict[int, PositionStat]] = {}
    for uid, (pg, sc) in enumerate(zip(gs.prompts, scored)):
        last = len(pg.prompt_ids) + len(pg.tokens) - 1  # the golden's positions: 0 .. last - 1
        stats[uid] = {pos: compare_topk(sc.ids[pos], sc.lp[pos], *golden_row(pg, pos))
                      for pos in range(min(last, len(sc.ids)))}
    return stats, [sc.tokens for sc in scored], {uid: {} for uid in range(len(gs.prompts))}
