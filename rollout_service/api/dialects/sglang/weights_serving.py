"""SGLang's weight sync translated into the service's push protocol.

Runs in the service process (standalone, or the Ray Serve ingress, whose weights port
fans every call out to the replicas). The trainers (slime: THUDM/slime
``slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py``; AReaL
1.0.4 ``areal/engine/fsdp_engine.py``, ``_update_weights_from_distributed``) call, per
weight sync:

1. ``/pause_generation``, then one ``/update_weights_from_distributed`` per bucket of
   tensors (names, dtypes, shapes by the Hugging Face checkpoint's names), broadcasting
   the bucket's tensors in the group of ``/init_weights_update_group`` while the call
   runs (one ``torch.distributed.broadcast`` per tensor, or one of the flattened bucket);
2. ``/continue_generation``.

SGLang loads each call at once into the paused engine. Here the first call of a sync
begins a push (``client`` ``sglang``, every checkpoint tensor expected, main model and
drafter from the one stream: the MTP layers' tensors come under the checkpoint's own
names, as in the service's own protocol), each call is one update (its tensors checked
against the served checkpoint before any byte is received, its broadcasts received into
the ring and the stored copy) and ``/continue_generation`` commits it: the whole
checkpoint loads at once, or nothing does (docs/dialects.md says why).
"""

from __future__ import annotations

import re

from rollout_service.api.dialects import weight_stream
from rollout_service.api.ports import GenerationControl, WeightPushes
from rollout_service.choices import Sequences
from rollout_service.protocol import messages
from rollout_service.weights.checks import PushError

from . import weights_protocol as sgl


def group_id(group_name: str) -> str:
    """The group's id: its name itself, the prefix of the torch group's keys in the
    trainer's store (``protocol/group_store.py``).

    Raises:
        PushError(400): a name the service's group ids cannot be.
    """
    if not re.match(messages.GROUP_ID_PATTERN, group_name):
        raise PushError(400, f"group_name: {group_name!r} must match "
                             f"{messages.GROUP_ID_PATTERN}")
    return group_name


class SGLangWeights:
    """SGLang's weight routes over the app's :class:`WeightPushes` (no state here: the
    push in progress is the service's)."""

    def __init__(self, pushes: WeightPushes, control: GenerationControl,
                 sequences: Sequences) -> None:
        self._pushes = pushes
        self._control = control
        self._sequences = sequences

    async def init_group(self, req: sgl.InitWeightsUpdateGroupReqInput
                         ) -> messages.WeightGroupResponse:
        """The workers join the trainer's torch group (SGLang's
        ``init_custom_process_group``), each ring slot sized for the largest tensor."""
        state = await self._pushes.group_state()
        return await self._pushes.create_group(messages.WeightGroupRequest(
            group_id=group_id(req.group_name), master_address=req.master_address,
            master_port=req.master_port, world_size=req.world_size,
            rank_offset=req.rank_offset, backend=req.backend, rendezvous="torch",
            bucket_bytes=weight_stream.largest_collective(state, None)
            if state.current is None else None))

    async def destroy_group(self, req: sgl.DestroyWeightsUpdateGroupReqInput) -> None:
        """Leave the trainer's group: a sync in progress in it is aborted (nothing of it
        loads), so a trainer that gives up mid-sync leaves the served weights whole."""
        await self._pushes.release_group(messages.WeightGroupRelease(
            group_id=group_id(req.group_name)))

    async def update(self, req: sgl.UpdateWeightsFromDistributedReqInput) -> None:
        """One call: its tensors checked and received (a push begun at the first call).

        Raises:
            PushError: 400 for a tensor not in the served model or of another dtype or
                shape, or a version that is no integer; 409 for a push of another client
                or group in progress, or a version not newer than the served one.
        """
        tensors = weight_stream.specs(req.names, req.dtypes, req.shapes, dtype_field="dtypes")
        gid = group_id(req.group_name)
        status = await self._pushes.get_status()
        active = status.active_push
        if active is None:
            version = weight_stream.parse_version(req.weight_version, status,
                                                  field="weight_version")
            info = await self._sequences.engine_info()
            target: messages.PushTarget = "both" if info.has_pushable_drafter else "main"
            begun = await self._pushes.begin(messages.PushBeginRequest(
                version=version, target=target,
                transport="nccl", group_id=gid, params=None, client="sglang",
                pause_mode="keep"))
            active = messages.ActivePushState(
                push_id=begun.push_id, client="sglang", target=target, version=version,
                group_id=gid, num_buckets=0, stream_bytes=0, num_tensors=0)
        elif active.client != "sglang" or active.group_id != gid:
            raise PushError(409, f"group_name: push {active.push_id} of {active.client!r} "
                                 f"in group {active.group_id!r} is in progress")
        elif req.weight_version is not None and req.weight_version != str(active.version):
            raise PushError(400, f"weight_version: {req.weight_version!r}, and this sync's "
                                 f"earlier calls named {str(active.version)!r}")
        if req.abort_all_requests:  # once the sync is begun: one refused at begin aborts nothing
            await self._control.abort(None)
        packed = None
        if req.load_format == "flattened_bucket":
            packed = sum(t.nbytes for t in tensors)  # one collective of them all
        await self._pushes.update(weight_stream.layout(tensors, active, packed_bytes=packed))

    async def commit(self) -> messages.PushFinishResponse | None:
        """``/continue_generation``: load the sync's push, if one is open (None if not)."""
        active = (await self._pushes.get_status()).active_push
        if active is None or active.client != "sglang":
            return None
        return await self._pushes.finish(messages.PushFinishRequest(push_id=active.push_id))
