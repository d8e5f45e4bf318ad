"""The ``nccl`` transport for an SGLang server: the service process in front of it is the
server's one rank of the trainer's group.

Runs in the rollout service process, as a mixin of ``SGLangEngine`` (``engine.py``), and
makes it a :class:`~rollout_service.engines.broadcast_engine.BroadcastEngine`: the trainer's group
(``/weights/group``, or SGLang's and vLLM's dialect routes that create one) is joined
here at the group's rank offset, and each bucket is received here, on threads of
``engines/group_member.py``, into the same bounded ring and stored copy as a vLLM
worker's, with the same length and checksum checks. At ``/weights/finish`` the main
model and the drafter load from that copy as a flattened bucket, the way an ``shm`` push
loads (``payload.py``): SGLang's TP workers read it from host memory.

Why here and not SGLang's own ``/init_weights_update_group`` and
``/update_weights_from_distributed``: SGLang loads those tensors as they arrive, so a
broadcast that breaks half-way would leave a model half-written, and nothing checks a
bucket's length or checksum; receiving here keeps every guarantee of a push (validated
before anything moves, nothing loaded unless every bucket arrived intact, a stored copy
for replicas that restart) at the cost of one pass through host memory.

The rank's buffers: on a machine where this process sees CUDA the group is ``nccl`` on
SGLang's first GPU, the ``base_gpu_id`` its ``/server_info`` reports (the ring's slots,
``weights_num_buckets`` x the largest bucket, are GPU memory outside SGLang's
``mem_fraction_static``); elsewhere, or where the trainer asks for it, ``gloo`` on the
CPU. Why SGLang's GPU and not this
process's current one: NCCL puts no two ranks of one group on one GPU, and a trainer
colocated on the node (ranks on GPUs 0-3, SGLang on ``base_gpu_id: 4``) owns GPU 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_service.engines.broadcast_engine import BucketReceive, WorkerReceive
from rollout_service.protocol.broadcast import Backend, GroupSpec
from rollout_service.protocol.store import BucketInfo

if TYPE_CHECKING:
    import torch

    from rollout_service.engines.group_member import GroupMember


def rank_device(gpu: int) -> torch.device:
    """Where the service's rank receives: CUDA device ``gpu`` (SGLang's ``base_gpu_id``)
    when this process sees it, else its current CUDA device (a server on another host,
    given by ``engine_url``: its GPU numbers are not this machine's), else the CPU."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    if 0 <= gpu < torch.cuda.device_count():
        return torch.device("cuda", gpu)
    return torch.device("cuda", torch.cuda.current_device())


class ServiceRank:
    """:class:`~rollout_service.engines.broadcast_engine.BroadcastEngine` with this process as the
    one receiver (a mixin; torch is imported on first use)."""

    _member: GroupMember | None = None
    _rank_gpu: int = 0  # SGLang's base_gpu_id; the engine sets it from /server_info

    @property
    def num_workers(self) -> int:
        return 1

    @property
    def group_backends(self) -> tuple[Backend, ...]:
        """``nccl`` first where this process sees CUDA; ``gloo`` always, received on the
        CPU: SGLang's ``/init_weights_update_group`` takes the trainer's ``backend``, and a
        trainer sharing the server's only GPU cannot be a second NCCL rank on it."""
        import torch

        return ("nccl", "gloo") if torch.cuda.is_available() else ("gloo",)

    @property
    def receive_device(self) -> torch.device:
        """Where an ``nccl`` group's buckets arrive (see :func:`rank_device`)."""
        return rank_device(self._rank_gpu)

    def _rank(self) -> GroupMember:
        if self._member is None:
            from rollout_service.engines.group_member import GroupMember

            self._member = GroupMember(self.receive_device)
        return self._member

    async def join_group(self, spec: GroupSpec) -> None:
        """Start joining ``spec``'s group at its rank offset (returns at once)."""
        self._rank().join_group(spec, spec.rank_offset, is_writer=True)

    async def group_state(self, group_id: str) -> list[str]:
        return [self._rank().group_state(group_id)]

    async def leave_group(self) -> None:
        if self._member is not None:  # no rank made (nor torch imported) just to leave
            self._member.leave_group()

    async def start_bucket(self, receive: BucketReceive, bucket: BucketInfo) -> None:
        """Start receiving ``bucket`` on this process's threads (returns at once;
        generation goes on)."""
        self._rank().start_bucket(receive, bucket)

    async def bucket_states(self, push_id: str, index: int) -> list[str]:
        return [self._rank().bucket_state(push_id, index)]

    async def receive_reports(self, push_id: str, num_buckets: int) -> list[WorkerReceive]:
        return [self._rank().receive_report(push_id, num_buckets)]
