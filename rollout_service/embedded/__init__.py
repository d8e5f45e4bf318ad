"""The embedded default model: a deterministic random-weight MiMo checkpoint with MTP.

`ensure_model("tiny")` returns a Hugging Face model directory that vLLM loads with
`speculative_config={"method": "mtp", ...}`; see `tiny_mimo` for how it is built.

The exports load lazily so that `rollout_service.embedded.corpus` (the toy reward's
prompts) stays importable without torch, and `python -m
rollout_service.embedded.tiny_mimo` does not import its own module twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_service.embedded.tiny_mimo import ModelSize, ensure_model

__all__ = ["ModelSize", "ensure_model"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rollout_service.embedded import tiny_mimo

        return getattr(tiny_mimo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
