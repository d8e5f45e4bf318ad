"""vLLM's weight sync translated into the service's push protocol.

Runs in the service process (standalone, or the Ray Serve ingress, whose weights port
fans every call out to the replicas). vLLM's trainer engine
(vllm-project/vllm 0.32 ``vllm/distributed/weight_transfer/nccl_engine.py``,
``NCCLTrainerWeightTransferEngine``; SkyRL 0.4.0 drives it,
``skyrl/backends/skyrl_train/weight_sync/weight_senders.py``) calls
``/init_weight_transfer_engine`` once (while it opens its own rank 0), then per sync
``/start_weight_update``, ``/update_weights`` while it broadcasts (packed chunks, or one
broadcast per tensor), ``/finish_weight_update``; SkyRL follows each with the same
session opened by ``/start_draft_weight_update`` over the drafter's tensors (the MTP block
and the embedding and head it shares: ``weight_sync/sources.py``,
``is_megatron_draft_param``).

Here a session is one push: ``/start_weight_update`` begins it (``client`` ``vllm``, target
``main``; ``/start_draft_weight_update``: target ``draft``), each ``/update_weights`` is
one update (its tensors checked against the served checkpoint before anything is
received), and ``/finish_weight_update`` commits it, loading the whole session at once or
nothing. A main session carries every checkpoint tensor; a drafter session the tensors
it has. The group's framing (packed or not, the buffer size) is the init_info's, kept in
the group's id, so the dialect holds no state of its own.
"""

from __future__ import annotations

import re

from rollout_service.api.dialects import weight_stream
from rollout_service.api.ports import WeightPushes
from rollout_service.protocol import messages
from rollout_service.weights.checks import PushError

from . import weights_protocol as wire

_GROUP_ID = re.compile(r"^vllm-(?P<port>\d+)-(?:p(?P<packed>\d+)|u)$")


def group_id(info: wire.NCCLInitInfo) -> str:
    """The group's id, carrying the framing of its broadcasts."""
    framing = f"p{info.packed_buffer_size_bytes}" if info.packed else "u"
    return f"vllm-{info.master_port}-{framing}"


class VLLMWeights:
    """vLLM's weight routes over the app's :class:`WeightPushes`."""

    def __init__(self, pushes: WeightPushes) -> None:
        self._pushes = pushes

    async def init(self, info: wire.NCCLInitInfo) -> messages.WeightGroupResponse:
        """The workers join vLLM's ``StatelessProcessGroup`` (PyNccl on CUDA; on the CPU
        the gloo stand-in), each ring slot sized for the trainer's largest collective."""
        state = await self._pushes.group_state()
        assert info.master_address is not None and info.master_port is not None
        packed = info.packed_buffer_size_bytes if info.packed else None
        return await self._pushes.create_group(messages.WeightGroupRequest(
            group_id=group_id(info), master_address=info.master_address,
            master_port=info.master_port, world_size=info.world_size,
            rank_offset=info.rank_offset, rendezvous="vllm",
            bucket_bytes=weight_stream.largest_collective(state, packed),
            num_buckets=info.packed_num_buffers if info.packed else None))

    async def shutdown(self) -> None:
        """Let vLLM's trainer's group go; a group this dialect did not make (slime's, or
        this service's own trainer's) is not its to end, and none is no error (vLLM's
        own route answers the same)."""
        current = (await self._pushes.group_state()).current
        if current is not None and _GROUP_ID.match(current.group_id):
            await self._pushes.release_group(messages.WeightGroupRelease(
                group_id=current.group_id))

    async def start(self, *, draft: bool) -> messages.PushBeginResponse:
        """Open the main model's session (``draft``: the drafter's).

        Raises:
            PushError: 409 without the trainer's group or with a push in progress, 400 for
                a drafter session on an engine without a drafter a push can load.
        """
        gid = await self._group_id()
        status = await self._pushes.get_status()
        version = status.newest_version + 1
        main = status.main_version
        if draft and main is not None and main > (status.draft_version or -1):
            version = main  # the drafter catches up with the main model it drafts for
        return await self._pushes.begin(messages.PushBeginRequest(
            version=version, target="draft" if draft else "main", transport="nccl",
            group_id=gid, params=None, client="vllm", pause_mode="keep"))

    async def update(self, infos: list[wire.NCCLUpdateInfo]) -> None:
        """The session's tensors of one call, received as the trainer broadcasts them."""
        active = await self._session()
        match = _GROUP_ID.match(active.group_id or "")
        assert match is not None  # _session checked the push is this dialect's
        init_packed = int(match["packed"]) if match["packed"] else None
        for info in infos:
            packed = init_packed
            if info.packed is not None:  # vLLM 0.30 sends the framing here
                packed = (info.packed_buffer_size_bytes
                          or wire.DEFAULT_PACKED_BUFFER_SIZE_BYTES) if info.packed else None
            if packed != init_packed:
                raise PushError(400, f"update_info.packed: {info.packed} "
                                     f"({info.packed_buffer_size_bytes} bytes) is not the "
                                     f"framing of init_weight_transfer_engine "
                                     f"({active.group_id})")
            tensors = weight_stream.specs(info.names, info.dtype_names, info.shapes,
                                          dtype_field="dtype_names")
            await self._pushes.update(weight_stream.layout(tensors, active,
                                                           packed_bytes=packed))
            active = await self._session()

    async def finish(self, weight_version: str | None) -> messages.PushFinishResponse:
        """Load the session whole at the version it names (none: the one ``start`` took),
        or nothing.

        Raises:
            PushError: 409 without a session of this dialect, or for a version not newer
                than the served one; 400 for an incomplete session; the load's failure.
        """
        active = await self._session()
        version = None
        if weight_version is not None:
            version = weight_stream.parse_version(weight_version,
                                                  await self._pushes.get_status(),
                                                  field="weight_version")
        return await self._pushes.finish(messages.PushFinishRequest(
            push_id=active.push_id, version=version))

    async def _group_id(self) -> str:
        """The current group's id, which must be one this dialect made: its id carries the
        framing the updates are laid out by (the dialect keeps no state of its own)."""
        current = (await self._pushes.group_state()).current
        if current is None or not _GROUP_ID.match(current.group_id):
            raise PushError(409, "init_weight_transfer_engine: no weight transfer engine is "
                                 "initialized (the service is in "
                                 f"{current.group_id if current else 'no group'!r})")
        return current.group_id

    async def _session(self) -> messages.ActivePushState:
        """The service's push in progress, which must be this dialect's: an update or a
        finish never goes on with another client's push."""
        active = (await self._pushes.get_status()).active_push
        if active is None or active.client != "vllm":
            detail = "none" if active is None else f"{active.client!r}'s {active.push_id}"
            raise PushError(409, "start_weight_update: no weight update session is open "
                                 f"(the push in progress: {detail})")
        return active
