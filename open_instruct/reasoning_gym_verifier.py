"""The `reasoning_gym` verifier (a row's `dataset` column): a reasoning-gym task's own score_answer of the
completion's <answer>, scored in the sandbox (reasoning_gym_scoring.score_many), the rows regenerated from their
ground truths (reasoning_gym_tasks). Registered when a row names it (integrations.BUILT_IN_VERIFIERS); apart from
both modules because the scoring module imports the tasks' ground-truth helpers."""

from __future__ import annotations

from typing import Any, Sequence

from open_instruct import reasoning_gym_scoring
from open_instruct.reasoning_gym_tasks import VERIFIER, BadGroundTruth, check_ground_truth
from open_instruct.rewards import MAX_COMPLETION_CHARS, STATS, GroundTruthError, register_verifier, strip_thinking


def _score_batch(
    completions: Sequence[str], ground_truths: Sequence[Any], timeout: float, settings: Any = None
) -> list[tuple[float, bool]]:
    """(score, timed_out) per completion, scored in the sandbox (reasoning_gym_scoring.score_many) with the run's
    sandbox settings (a code_verifier.CodeSettings: workers, hidden paths, batch timeout; default CodeSettings())."""
    from open_instruct.code_verifier import CodeSettings

    settings = settings or CodeSettings()
    texts = [strip_thinking(c) if len(c) <= MAX_COMPLETION_CHARS else "" for c in completions]
    try:
        scored = reasoning_gym_scoring.score_many(
            texts,
            ground_truths,
            timeout=timeout,
            workers=settings.workers,
            hide_paths=settings.hide_paths,
            batch_timeout=settings.batch_timeout,
        )
    except BadGroundTruth as e:
        raise GroundTruthError(str(e)) from None
    for _, status in scored:
        STATS[f"reasoning_gym_{status}"] += 1
    return [(score, status == "timeout") for score, status in scored]


def _check(ground_truth: Any) -> None:
    try:
        check_ground_truth(ground_truth)
    except BadGroundTruth as e:
        raise GroundTruthError(str(e)) from None


@register_verifier(VERIFIER, sandboxed=True, batch=_score_batch, check=_check)
def verify_reasoning_gym(completion: str, ground_truth: Any) -> float:
    """A reasoning-gym task's own score_answer of the completion's <answer>. Its scorers may evaluate the answer
    text: it runs in the sandbox (default timeout 2 s of CPU)."""
    return _score_batch([completion], [ground_truth], 2.0)[0][0]
