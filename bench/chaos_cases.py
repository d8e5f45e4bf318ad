"""The cases of ``bench/chaos.py``: each fault a chaos run injects, the alert it must
raise, and what a case's run found.

Runs in the caller's process, which plays the trainer: ``bench.chaos_runner`` applies a
case's ``Fault`` to the trainer's pushes (or flips the stats switch) and fills its
``CaseResult``; ``bench.chaos`` prints them and ``tests/integration/test_chaos.py`` asserts
on them. Apart from the runner so that the catalogue of what breaks, and which alert must
answer it, reads in one place, without the service, Prometheus and trainer that run it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rollout_service.protocol import messages

MTP_PREFIX = "model.mtp_layers."
INPUT_PROJ = "input_proj.weight"


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """How a step of a case differs from a healthy one."""

    target: messages.PushTarget = "both"
    """What the step's push loads."""
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    """Applied to each exported tensor (by its checkpoint name) before the push."""
    stats_outage: bool = False
    """The engine drops per-request stats while the case runs."""


def _zero_drafter(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(tensor) if name.startswith(MTP_PREFIX) else tensor


def _swap_input_proj_halves(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not (name.startswith(MTP_PREFIX) and name.endswith(INPUT_PROJ)):
        return tensor
    first, second = tensor.chunk(2, dim=1)
    return torch.cat([second, first], dim=1).contiguous()


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    name: str
    alert: str | None
    """The alert the fault must raise; None for the control run."""
    fault: Fault
    what: str


CASES = (
    Case(name="control", alert=None, fault=Fault(), what="healthy steps, pushes of both"),
    Case(name="drafter_push_skipped", alert="RolloutDrafterVersionBehindMain",
         fault=Fault(target="main"), what="trainer keeps training, pushes main only"),
    Case(name="drafter_zeroed", alert="RolloutAcceptRateDroppedAfterWeightPush",
         fault=Fault(transform=_zero_drafter), what="a push with the MTP layers all zeros"),
    Case(name="eh_proj_swapped", alert="RolloutAcceptanceBelowTrainingAccuracy",
         fault=Fault(transform=_swap_input_proj_halves),
         what="input_proj (eh_proj) halves swapped in the exported drafter"),
    Case(name="stats_outage", alert="RolloutSpecDecodeStatsMissing",
         fault=Fault(stats_outage=True), what="the engine stops reporting per-request stats"),
)


@dataclass(kw_only=True, slots=True)
class CaseResult:
    case: Case
    fired_after_s: float | None = None
    """Seconds from the fault to the alert firing; None: it did not fire in time."""
    fired_after_requests: int | None = None
    """Requests finished from the fault to the alert firing."""
    other_alerts: list[str] = field(default_factory=list)
    """Alerts that fired during the case besides its own (for the control: false alarms)."""
    num_requests: int = 0
    seconds: float = 0.0
    figures: dict[str, float] = field(default_factory=dict)
    """What Prometheus showed during the case (healthy acceptance, speed-up...)."""

    @property
    def passed(self) -> bool:
        if self.case.alert is None:
            return not self.other_alerts
        return self.fired_after_s is not None

