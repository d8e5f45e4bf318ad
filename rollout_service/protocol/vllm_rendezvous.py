"""The ``vllm`` rendezvous of a ``nccl`` weight group: how a trainer that uses vLLM's own
weight-transfer engine (``NCCLTrainerWeightTransferEngine``: SkyRL, vLLM's RLHF examples)
meets the engine workers, and the CPU stand-in the tests run in its place.

vLLM's trainer (vllm-project/vllm 0.32 ``vllm/distributed/weight_transfer/nccl_common.py``,
``stateless_init_process_group``) is rank 0 of a ``StatelessProcessGroup``: it hosts the
``TCPStore`` (``vllm/distributed/utils.py``), which waits for ``world_size`` clients, and
builds a ``PyNcclCommunicator`` on it, whose rank 0 publishes the NCCL unique id in the
store (``broadcast_obj``: the key ``broadcast_from/0/0``, a pickle) and then runs a
one-element ``all_reduce`` (its warm-up) before any broadcast.

The receiver here, on CUDA, joins the same ``StatelessProcessGroup`` and builds its
communicator with vLLM's public ``PyNcclCommunicator.from_unique_id_bytes`` (the same
``ncclCommInitRank`` and warm-up): the unique id's 128 bytes are read out of the pickle
by :func:`unique_id_bytes`, which only walks its opcodes (``pickletools``) and never
unpickles what came over the network. Not run here: it needs GPUs.

On the CPU, where PyNccl does not run, :func:`join_stand_in` builds a gloo group over
the same store (under the prefix ``gloo-stand-in/``) and runs the same warm-up
``all_reduce``; :class:`StandInTrainer` is the trainer's side of it, for the tests. It is
a stand-in, named so: it shows the service's receive, ring, stored copy and loads end to
end, not PyNccl itself.

torch and vLLM are imported lazily.
"""

from __future__ import annotations

import datetime
import pickletools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rollout_service.protocol.broadcast import GroupSpec

UNIQUE_ID_KEY = "broadcast_from/0/0"
"""Where vLLM's rank 0 puts the NCCL unique id: the first ``broadcast_obj`` of its
``StatelessProcessGroup`` (``PyNcclCommunicator.__init__``)."""
UNIQUE_ID_BYTES = 128
"""``sizeof(ncclUniqueId)`` (vLLM's ``pynccl_wrapper.NCCL_UNIQUE_ID_BYTES``)."""
_UNIQUE_ID_GLOBALS = ("_ctypes", "_unpickle",
                      "vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
STAND_IN_PREFIX = "gloo-stand-in/"
"""The gloo stand-in's keys in the trainer's store (vLLM's own keys have no prefix)."""
COUNTERS_PREFIX = "rollout/"
"""This service's receive counters in the trainer's store."""


def unique_id_bytes(payload: bytes) -> bytes:
    """The 128 bytes of the ``ncclUniqueId`` that vLLM's rank 0 pickled into the store,
    read by walking the pickle's opcodes (nothing is unpickled).

    Raises:
        ValueError: the payload is not the pickle of one ``ncclUniqueId`` (any other
            global, or not exactly one 128-byte string).
    """
    strings: list[str] = []
    blobs: list[bytes] = []
    for opcode, arg, _ in pickletools.genops(payload):
        if isinstance(arg, str) and opcode.name != "GLOBAL":
            strings.append(arg)
        elif opcode.name == "GLOBAL":
            strings.extend(str(arg).split(" "))
        elif isinstance(arg, bytes | bytearray):
            blobs.append(bytes(arg))
    if tuple(strings) != _UNIQUE_ID_GLOBALS or len(blobs) != 1 \
            or len(blobs[0]) != UNIQUE_ID_BYTES:
        raise ValueError(f"the store's {UNIQUE_ID_KEY!r} is not vLLM's pickled ncclUniqueId "
                         f"(globals {strings}, {len(blobs)} byte strings)")
    return blobs[0]


def stateless_store(spec: GroupSpec, *, is_rank: bool) -> Any:
    """A client of the trainer's ``StatelessProcessGroup`` store: a rank counts itself in
    the world (the trainer's store waits for ``world_size`` clients), the service's
    counter reader does not."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    return dist.TCPStore(spec.master_address, spec.master_port,
                         spec.world_size if is_rank else None, False, timeout,
                         use_libuv=False)


def counters_store(base: Any) -> Any:
    """Where this service counts its receives in the trainer's store: under a prefix of
    its own, so its keys never meet vLLM's (``broadcast_from/...``, the gloo stand-in's)."""
    import torch.distributed as dist

    return dist.PrefixStore(COUNTERS_PREFIX, base)


class _PyNcclWork:
    """What ``Group._wait`` waits on: the broadcast's stream."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._stream.synchronize()  # NCCL has no timeout here: see docs/weight-pushes.md
        return True


class PyNcclGroup:
    """A ``PyNcclCommunicator`` behind the process-group calls ``Group`` makes
    (``broadcast`` returning a work, ``abort``)."""

    def __init__(self, communicator: Any) -> None:
        self._comm = communicator

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> _PyNcclWork:
        import torch

        stream = torch.cuda.current_stream(tensors[0].device)
        self._comm.broadcast(tensors[0], src=options.rootRank, stream=stream)
        return _PyNcclWork(stream)

    def abort(self) -> None:
        self._comm.destroy()


def join_pynccl(spec: GroupSpec, rank: int, device: torch.device) -> tuple[Any, Any]:
    """Join vLLM's trainer on CUDA: (the communicator as a process group, the store).

    Raises:
        RuntimeError: the trainer's store or its unique id did not come within the
            group's timeout.
        ValueError: the store holds something else than vLLM's unique id.
    """
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    store = stateless_store(spec, is_rank=True)
    uid = unique_id_bytes(bytes(store.get(UNIQUE_ID_KEY)))
    communicator = PyNcclCommunicator.from_unique_id_bytes(uid, rank, spec.world_size, device)
    return PyNcclGroup(communicator), store


def join_stand_in(spec: GroupSpec, rank: int) -> tuple[Any, Any]:
    """The CPU stand-in for :func:`join_pynccl`: a gloo group over the same store, with
    PyNccl's warm-up ``all_reduce``. Returns (the process group, the store)."""
    import torch
    import torch.distributed as dist

    store = stateless_store(spec, is_rank=True)
    pg = dist.ProcessGroupGloo(dist.PrefixStore(STAND_IN_PREFIX, store), rank,
                               spec.world_size, datetime.timedelta(seconds=spec.timeout_s))
    pg.allreduce([torch.zeros(1)]).wait(datetime.timedelta(seconds=spec.timeout_s))
    return pg, store


class StandInTrainer:
    """The trainer's side of the CPU stand-in (tests only): rank 0 of vLLM's own
    ``StatelessProcessGroup`` (it hosts the store, as vLLM's trainer does), then the gloo
    group and warm-up of :func:`join_stand_in`. ``broadcast`` has PyNccl's signature, so
    code written for vLLM's communicator calls it unchanged.

    Blocks in the constructor until every worker has connected to the store (vLLM's
    ``StatelessProcessGroup.create`` does): start the service's side first, on another
    thread, as vLLM's ``NCCLTrainerWeightTransferEngine.trainer_init`` does.
    """

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 timeout_s: float = 60.0) -> None:
        import torch
        import torch.distributed as dist
        from vllm.distributed.utils import StatelessProcessGroup

        self.group = StatelessProcessGroup.create(host=master_address, port=master_port,
                                                  rank=0, world_size=world_size,
                                                  store_timeout=int(timeout_s))
        timeout = datetime.timedelta(seconds=timeout_s)
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore(STAND_IN_PREFIX, self.group.store),
                                         0, world_size, timeout)
        self._timeout = timeout
        self._pg.allreduce([torch.zeros(1)]).wait(timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        self._pg.broadcast([tensor], options).wait(self._timeout)

    def destroy(self) -> None:
        self._pg = None  # type: ignore[assignment]
