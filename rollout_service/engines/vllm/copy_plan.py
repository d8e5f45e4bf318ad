"""Where each pushed tensor lands in a model's parameters, recorded from the model's own load.

An in-place push (``transfer.LoadSession`` with ``in_place``) could call the model's
``load_weights`` every time: vLLM's weight loaders place each checkpoint tensor (fused QKV
and gate-up shards, the drafter's own layers, the shared embedding) with a ``copy_`` into a
view of a parameter. That is ~100 us of Python per tensor, 43 ms for the 1.14B model's
~300 tensors on an H200, where the copies themselves take ~2 ms.

So the first in-place push runs ``load_weights`` with ``torch.Tensor.copy_`` watched
(:meth:`CopyPlan.record`): each ``copy_`` whose source is one of the pushed tensors *as
given* (same memory, shape, strides and dtype) records its destination view under the
tensor's name. Later pushes copy each name's new tensor into the recorded views
(:meth:`CopyPlan.apply`, ``torch._foreach_copy_`` per dtype pair) and hand every name the
recording did not cover (skipped by the loader, or transformed before its copy: a
transpose, a narrowed shard, a concatenation) to ``load_weights`` as before. A name
recorded twice (e.g. an embedding copied into two parameters) keeps both views.

The views stay valid while the parameters keep their storage, which an in-place engine
guarantees (nothing re-allocates them; CUDA graphs rely on the same). Before each use the
plan checks every parameter it writes still has the storage it recorded, and records
anew otherwise.

What it cannot see: a loader that reads a pushed tensor by a route other than a Python
``copy_`` of the tensor as given *and* also copies it as given would be half replayed.
vLLM 0.32's loaders for the models served here (Qwen2/MiMo and its MTP layer) do not;
``tests/unit/rollout_service/test_copy_plan.py`` proves a replay equal to ``load_weights``
on vLLM's real MiMo model, and the GPU push tests restore the checkpoint's checksums
bit for bit through it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from typing import Any

import torch

Named = Sequence[tuple[str, torch.Tensor]]
SourceKey = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]


def _key(tensor: torch.Tensor) -> SourceKey:
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


@contextmanager
def _watching_copies(sources: dict[SourceKey, str],
                     seen: dict[str, list[torch.Tensor]]) -> Any:
    """``torch.Tensor.copy_`` records ``dst`` under the source's name while inside."""
    original: Callable[..., torch.Tensor] = torch.Tensor.copy_

    def copy_(dst: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
        if isinstance(src, torch.Tensor):
            name = sources.get(_key(src))
            if name is not None:
                seen[name].append(dst.detach())
        return original(dst, src, non_blocking)

    torch.Tensor.copy_ = copy_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.copy_ = original  # type: ignore[method-assign]


class CopyPlan:
    """Per pushed name, the parameter views its tensor is copied into (module docstring)."""

    def __init__(self, views: dict[str, list[torch.Tensor]], owners: dict[str, int]) -> None:
        self._views = views
        self._owners = owners

    @classmethod
    def record(cls, model: torch.nn.Module, tensors: Named) -> CopyPlan:
        """Load ``tensors`` with the model's own ``load_weights``, recording the plan.

        The load itself is exactly ``model.load_weights``: recording only watches. A
        destination outside the model's parameters and buffers is not planned (its name
        goes to ``load_weights`` every time).
        """
        sources = {_key(tensor): name for name, tensor in tensors}
        seen: dict[str, list[torch.Tensor]] = defaultdict(list)
        with _watching_copies(sources, seen):
            model.load_weights(iter(tensors))
        storages = _storages_by_owner(model)
        owner_of = {ptr: owner for owner, ptr in storages.items()}
        views = {name: group for name, group in seen.items()
                 if all(v.untyped_storage().data_ptr() in owner_of for v in group)}
        owners = {owner_of[v.untyped_storage().data_ptr()]: v.untyped_storage().data_ptr()
                  for group in views.values() for v in group}
        return cls(views, owners)

    @property
    def names(self) -> frozenset[str]:
        """The names this plan replays."""
        return frozenset(self._views)

    def is_valid(self, model: torch.nn.Module) -> bool:
        """Whether every parameter the plan writes still has the memory it recorded.

        Checked against the model's parameters as they are now (a view would keep an
        old, replaced storage alive and look valid itself).
        """
        storages = _storages_by_owner(model)
        return all(storages.get(owner) == ptr for owner, ptr in self._owners.items())

    def apply(self, model: torch.nn.Module, tensors: Named) -> None:
        """Copy ``tensors`` in: recorded names by the plan, the rest by ``load_weights``."""
        groups: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        rest = []
        for name, tensor in tensors:
            views = self._views.get(name)
            if views is None:
                rest.append((name, tensor))
                continue
            for view in views:
                key = (view.dtype, view.device, tensor.dtype, tensor.device)
                dsts, srcs = groups.setdefault(key, ([], []))
                dsts.append(view)
                srcs.append(tensor)
        with torch.no_grad():
            for (_, dst_device, _, src_device), (dsts, srcs) in groups.items():
                if dst_device == src_device:
                    torch._foreach_copy_(dsts, srcs)  # a few fused launches
                else:  # shm: host to device, one copy each
                    for dst, src in zip(dsts, srcs, strict=True):
                        dst.copy_(src)
        if rest:
            model.load_weights(iter(rest))


def _storages_by_owner(model: torch.nn.Module) -> dict[str, int]:
    """Parameter and buffer name -> the address of its storage now."""
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    return {name: tensor.untyped_storage().data_ptr() for name, tensor in named}


def load_in_place(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                  plans: dict[int, CopyPlan]) -> None:
    """Load ``tensors`` into ``model`` in place, by its plan where one is recorded and valid.

    ``plans`` is kept by the caller across pushes, keyed by ``id(model)`` (the main model
    and the drafter each have their own).
    """
    named = list(tensors)
    plan = plans.get(id(model))
    if plan is not None and plan.is_valid(model):
        plan.apply(model, named)
    else:
        plans[id(model)] = CopyPlan.record(model, named)
