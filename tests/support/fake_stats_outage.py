"""FAKE fault: the engine stops reporting per-request spec-decode stats, on a switch.

Test-only; never imported by the service. ``python -m tests.support.fake_stats_outage
<rollout-service arguments>`` runs ``rollout-service`` exactly as ``python -m
rollout_service.cli`` does, in the same process, after wrapping the vLLM engine's
``generate`` and ``stream``: while the file named by ``$ROLLOUT_FAKE_STATS_OUTAGE_FILE``
exists, every finished sequence comes back with ``spec_decode=None``, as from a vLLM
started with ``per_request_spec_decode_metrics="none"`` or a version without per-request
stats (the service refuses the first at startup, so a real outage mid-run has no switch
to flip). Everything else is real: the engine still drafts and verifies, the service
counts the sequences as missing stats, Prometheus scrapes them. ``bench/chaos.py`` (case
``stats_outage``) flips it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

SWITCH_ENV = "ROLLOUT_FAKE_STATS_OUTAGE_FILE"
"""Names the file whose existence switches the outage on."""


def install(switch: Path) -> None:
    """Wrap ``VLLMEngine.generate`` and ``VLLMEngine.stream`` (see the module docstring)."""
    from rollout_service.engines.base import GenerationDelta, GenerationResult
    from rollout_service.engines.vllm.engine import VLLMEngine

    generate, stream = VLLMEngine.generate, VLLMEngine.stream

    def strip(result: GenerationResult) -> GenerationResult:
        return dataclasses.replace(result, spec_decode=None) if switch.exists() else result

    async def generate_without_stats(self: VLLMEngine, *args: object,
                                     **kwargs: object) -> GenerationResult:
        return strip(await generate(self, *args, **kwargs))

    async def stream_without_stats(self: VLLMEngine, *args: object, **kwargs: object
                                   ) -> AsyncIterator[GenerationDelta]:
        async for delta in stream(self, *args, **kwargs):
            if delta.result is not None:
                delta = dataclasses.replace(delta, result=strip(delta.result))
            yield delta

    VLLMEngine.generate = generate_without_stats  # type: ignore[method-assign]
    VLLMEngine.stream = stream_without_stats  # type: ignore[method-assign]


def main() -> None:
    install(Path(os.environ[SWITCH_ENV]))
    from rollout_service.cli import app

    sys.argv[0] = "rollout-service"
    app()


if __name__ == "__main__":
    main()
