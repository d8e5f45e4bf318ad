"""Deterministic text corpus for the embedded tiny model's tokenizer.

Runs offline only (from `build_tokenizer`) to write `corpus.txt`, and at
runtime in whatever process asks for `arithmetic_prompts` (the toy verifiable
reward). Pure Python on purpose: nothing here needs torch, so the reward code can
import it from a process that has no engine.

The corpus exists so the byte-level BPE tokenizer learns merges for the text the
tests and the demo actually send (digits, operators, "Q:"/"A:" markers, short
English words); the model weights are random and never trained on it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

_OPERATORS = ("+", "-", "*")

_SUBJECTS = (
    "the cat", "the dog", "a small bird", "my friend", "the teacher", "a tired farmer",
    "the old man", "a young girl", "the robot", "our neighbor", "the baker", "a student",
    "the doctor", "a clever fox", "the pilot", "my sister", "the captain", "a quiet child",
    "the gardener", "her brother", "the driver", "a famous singer", "the king", "the nurse",
)
_VERBS = (
    "sees", "likes", "finds", "carries", "paints", "counts", "reads", "builds",
    "follows", "cleans", "opens", "watches", "throws", "remembers", "forgets", "draws",
    "brings", "sells", "buys", "writes", "washes", "hides", "chooses", "describes",
)
_OBJECTS = (
    "a red ball", "the green door", "three apples", "a long letter", "the blue boat",
    "a warm cup of tea", "the big tree", "two books", "a shiny coin", "the quiet river",
    "a paper map", "the last train", "a yellow kite", "the wooden chair", "seven stones",
    "a broken clock", "the heavy box", "a purple flower", "the morning newspaper",
    "a strange picture", "the silver spoon", "five oranges", "a warm blanket", "the white horse",
)
_PLACES = (
    "in the garden", "near the house", "at the market", "by the lake", "on the hill",
    "in the kitchen", "at school", "under the bridge", "in the morning", "after dinner",
    "before breakfast", "during the storm", "behind the library", "across the street",
    "inside the museum", "along the beach", "every evening", "on a rainy day",
)
_ADJECTIVES = (
    "happy", "slow", "bright", "calm", "hungry", "careful", "loud", "kind", "sleepy",
    "curious", "proud", "nervous", "gentle", "brave", "honest", "patient",
)


def _apply(left: int, operator: str, right: int) -> int:
    """Evaluates one binary operation; the only operators are `_OPERATORS`."""
    if operator == "+":
        return left + right
    if operator == "-":
        return left - right
    assert operator == "*", operator
    return left * right


def arithmetic_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Returns `n` arithmetic questions with their exact answers.

    The prompt ends right after "A:" so a completion can be checked by comparing
    its first number with the answer: the toy verifiable reward.

    Args:
        n: number of (prompt, answer) pairs.
        seed: the same seed always yields the same list.

    Returns:
        Pairs like ("Q: 12 + 7 = ? A:", "19").

    Raises:
        ValueError: if `n` is negative.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"arithmetic-{seed}")
    pairs = []
    for _ in range(n):
        operator = rng.choice(_OPERATORS)
        limit = 12 if operator == "*" else 99
        left, right = rng.randint(0, limit), rng.randint(0, limit)
        pairs.append((f"Q: {left} {operator} {right} = ? A:", str(_apply(left, operator, right))))
    return pairs


def _counting_lines(rng: random.Random) -> Iterator[str]:
    """Yields runs of consecutive numbers, forwards and backwards."""
    while True:
        start, length = rng.randint(0, 999), rng.randint(4, 10)
        numbers = [str(start + i) for i in range(length)]
        if rng.random() < 0.3:
            numbers.reverse()
        yield "Count: " + ", ".join(numbers)


def _sentence_lines(rng: random.Random) -> Iterator[str]:
    """Yields short template sentences: subject, verb, object, optional place."""
    while True:
        subject = rng.choice(_SUBJECTS)
        sentence = f"{subject} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.6:
            sentence += " " + rng.choice(_PLACES)
        if rng.random() < 0.3:
            sentence += f", and {subject.split()[-1]} is {rng.choice(_ADJECTIVES)}"
        yield sentence[0].upper() + sentence[1:] + "."


def corpus_lines(num_lines: int = 6000, seed: int = 0) -> list[str]:
    """Returns the corpus: arithmetic Q/A, counting and sentences, interleaved.

    Args:
        num_lines: total number of lines (one third of each kind, roughly).
        seed: the same seed always yields the same lines.
    """
    rng = random.Random(f"corpus-{seed}")
    arithmetic = iter(arithmetic_prompts(num_lines, seed=seed))
    counting, sentences = _counting_lines(rng), _sentence_lines(rng)
    lines = []
    for i in range(num_lines):
        kind = i % 3
        if kind == 0:
            prompt, answer = next(arithmetic)
            lines.append(f"{prompt} {answer}")
        elif kind == 1:
            lines.append(next(counting))
        else:
            lines.append(next(sentences))
    return lines


def corpus_text(num_lines: int = 6000, seed: int = 0) -> str:
    """Returns the corpus as one string, one line per example, newline-terminated."""
    return "\n".join(corpus_lines(num_lines, seed)) + "\n"
