"""Where the RL loop's prompts come from, and how a response is rewarded.

Runs in the trainer process. The loop asks a :data:`PromptSource` for each
step's batch; the trainer CLI reads one from a JSONL file of
``{"prompt": ..., "answer": ..., "category": ...}`` lines (category optional), the
demo passes the embedded model's arithmetic questions. The reward is the toy
verifiable one the demo needs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

PromptSource = Callable[[int, int], Sequence[tuple[str, str] | tuple[str, str, str | None]]]
"""``(num_prompts, seed) -> [(prompt, answer), ...]``, or ``(prompt, answer, category)``
triples (the service labels acceptance by category); the same seed, the same batch."""


def category_of(item: tuple[str, str] | tuple[str, str, str | None]) -> str | None:
    """The category of a prompt source's item; None for a ``(prompt, answer)`` pair."""
    return item[2] if len(item) > 2 else None


def reward(text: str, answer: str) -> float:
    """1.0 if ``answer`` appears in ``text``, else the share of digit characters.

    The embedded model's weights are random, so the exact answer almost never
    appears; the digit share gives every sample a different reward, so REINFORCE
    moves the policy (towards digit-heavy text) within a few steps.
    """
    if answer in text:
        return 1.0
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def jsonl_prompts(path: Path) -> PromptSource:
    """Prompts from a JSONL file, ``{"prompt": str, "answer": str, "category": str}`` per
    line (``category`` optional), drawn with replacement by a generator seeded with the
    batch's seed.

    Raises:
        ValueError: naming the file and line of a malformed entry, or an empty file.
    """
    pairs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            category = entry.get("category")
            pairs.append((str(entry["prompt"]), str(entry["answer"]),
                          None if category is None else str(category)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"prompts: {path}:{number} is not a JSON object with 'prompt' "
                             f"and 'answer' ({exc})") from exc
    if not pairs:
        raise ValueError(f"prompts: {path} holds no prompt")

    def draw(num_prompts: int, seed: int) -> list[tuple[str, str, str | None]]:
        rng = random.Random(seed)
        return [rng.choice(pairs) for _ in range(num_prompts)]

    return draw
