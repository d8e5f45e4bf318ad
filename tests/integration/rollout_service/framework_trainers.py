"""Trainers that sync weights into the service exactly as the RL frameworks' trainers do:
the same HTTP calls, in the same order, with the same bodies, and the same collectives.

- :class:`SGLangTrainer`: slime (THUDM/slime
  ``slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py`` and
  ``slime/backends/sglang_utils/sglang_engine.py``: ``init_weights_update_group``,
  ``pause_generation``, ``flush_cache``, ``update_weights_from_distributed`` per bucket
  with ``weight_version``, ``continue_generation``) and AReaL 1.0.4
  (``areal/engine/fsdp_engine.py``, ``_update_weights_from_distributed``: the HTTP call
  of each bucket in flight while ``dist.broadcast`` runs per tensor). The group is made as
  SGLang's ``init_custom_process_group`` makes it (torch's ``rendezvous`` and
  ``_new_process_group_helper``), gloo here.
- :class:`VLLMTrainer`: vLLM 0.32's ``NCCLTrainerWeightTransferEngine``
  (``vllm/distributed/weight_transfer/nccl_engine.py``: ``trainer_init`` and
  ``send_weights``) through vLLM's own ``HTTPVLLMWeightSyncClient`` and its own
  ``pack_tensors``; SkyRL 0.4.0's drafter session (``weight_sync/weight_senders.py``,
  ``SkyrlDraftSessionMixin``: the same send opened by ``/start_draft_weight_update``).
  vLLM's producer needs CUDA streams and PyNccl, so its loop is replayed here over the
  CPU stand-in of PyNccl (``rollout_service/protocol/vllm_rendezvous.py``).
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import requests
import torch
import torch.distributed as dist

_NAMES = itertools.count()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(url: str, path: str, body: dict[str, Any] | None,
          headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=300, headers=headers)


def with_password(url: str, token: str) -> str:
    """``url`` with ``token`` as its password: how a framework's client, which sets no
    header on the weight routes, sends the service's weights token (HTTP Basic)."""
    return url.replace("http://", f"http://weights:{token}@")


class SGLangTrainer:
    """Rank 0 of a torch group made as SGLang's ``init_custom_process_group`` makes it;
    the service joins it through ``/init_weights_update_group`` at ``rank_offset`` 1."""

    def __init__(self, url: str, *, weights_token: str, api_key: str | None = None,
                 world_size: int = 2, group_name: str | None = None,
                 timeout_s: float = 60.0) -> None:
        from torch.distributed.distributed_c10d import (
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        # torch names a process's groups once: each trainer of a test process its own
        # (slime's are "slime-pp_<rank>", AReaL's "update_weight_group")
        group_name = group_name or f"update_weight_group_{next(_NAMES)}"
        self.url, self.group_name = with_password(url, weights_token), group_name
        self.control_url = url  # the control routes take the api_key, as generation does
        self.control_headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        port = free_port()
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": world_size, "group_name": group_name, "backend": "gloo"}
        with ThreadPoolExecutor(1) as pool:  # the trainer joins while the engine does
            joined = pool.submit(_post, self.url, "/init_weights_update_group", body)
            timeout = datetime.timedelta(seconds=timeout_s)
            store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size,
                                          timeout=timeout))
            store.set_timeout(timeout)
            self.group, _ = _new_process_group_helper(
                world_size, 0, [], "gloo", PrefixStore(group_name, store),
                group_name=group_name, timeout=timeout)
            _world.pg_group_ranks[self.group] = {i: i for i in range(world_size)}
            self.init_answer = joined.result()

    def update(self, bucket: list[tuple[str, torch.Tensor]], *, version: int | None,
               broadcast: Callable[[torch.Tensor], None] | None = None,
               **fields: Any) -> requests.Response:
        """One ``update_weights_from_distributed``, its tensors broadcast meanwhile."""
        body: dict[str, Any] = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
            "flush_cache": False, **fields}
        if version is not None:
            body["weight_version"] = str(version)
        with ThreadPoolExecutor(1) as pool:
            answer: Future[requests.Response] = pool.submit(
                _post, self.url, "/update_weights_from_distributed", body)
            send = broadcast or self.broadcast
            for _, tensor in bucket:
                if answer.done():  # refused before any receive was posted: stop sending
                    break
                send(tensor)
            return answer.result()

    def broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor.contiguous(), 0, group=self.group)

    def sync(self, tensors: dict[str, torch.Tensor], *, version: int | None,
             bucket_bytes: int = 1 << 20) -> requests.Response:
        """A whole sync as slime runs it; the answer of ``/continue_generation``."""
        self.pause()
        requests.get(f"{self.control_url}/flush_cache", timeout=60,
                     headers=self.control_headers)
        bucket: list[tuple[str, torch.Tensor]] = []
        for name, tensor in tensors.items():
            if bucket and sum(t.nbytes for _, t in bucket) + tensor.nbytes > bucket_bytes:
                answer = self.update(bucket, version=version)
                assert answer.status_code == 200, answer.text
                bucket = []
            bucket.append((name, tensor))
        answer = self.update(bucket, version=version)
        assert answer.status_code == 200, answer.text
        return self.resume()

    def pause(self) -> None:
        answer = _post(self.control_url, "/pause_generation", {}, self.control_headers)
        assert answer.status_code == 200, answer.text

    def resume(self) -> requests.Response:
        return _post(self.control_url, "/continue_generation", {}, self.control_headers)

    def destroy(self) -> requests.Response:
        return _post(self.url, "/destroy_weights_update_group", {"group_name": self.group_name})


class VLLMTrainer:
    """vLLM's ``NCCLTrainerWeightTransferEngine`` over the CPU stand-in of PyNccl."""

    def __init__(self, url: str, *, weights_token: str, world_size: int = 2,
                 packed: bool = True, packed_buffer_size_bytes: int = 1 << 20,
                 timeout_s: float = 60.0) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            worker_init_payload,
        )

        from rollout_service.protocol.vllm_rendezvous import StandInTrainer

        url = with_password(url, weights_token)
        self.url, self.packed, self.buffer_bytes = url, packed, packed_buffer_size_bytes
        self.client = HTTPVLLMWeightSyncClient(url)
        port = free_port()
        info = NCCLWeightTransferInitInfo(
            master_address="127.0.0.1", master_port=port, rank_offset=1,
            world_size=world_size, packed=packed,
            packed_buffer_size_bytes=packed_buffer_size_bytes)
        with ThreadPoolExecutor(1) as pool:  # as trainer_init: the workers join meanwhile
            future = pool.submit(self.client.init_weight_transfer_engine,
                                 worker_init_payload(info))
            self.group = StandInTrainer("127.0.0.1", port, world_size, timeout_s)
            future.result()

    def send_weights(self, tensors: dict[str, torch.Tensor], *, draft: bool = False,
                     weight_version: str | None = None) -> None:
        """``send_weights``: start, update while broadcasting, finish."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

        update_info = NCCLWeightTransferUpdateInfo(
            names=list(tensors), dtype_names=[str(t.dtype).split(".")[-1]
                                              for t in tensors.values()],
            shapes=[list(t.shape) for t in tensors.values()])
        if draft:  # SkyRL's draft_session: the start routed to the drafter
            _post(self.url, "/start_draft_weight_update", None).raise_for_status()
        else:
            self.client.start_weight_update()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(self.client.update_weights, asdict(update_info))
            self.broadcast_all(tensors)
            future.result()
        self.client.finish_weight_update(weight_version)

    def broadcast_all(self, tensors: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

        if not self.packed:
            for tensor in tensors.values():
                self.group.broadcast(tensor.contiguous(), src=0)
            return
        pairs = iter(tensors.items())
        while (chunk := pack_tensors(pairs, lambda item: item[1], self.buffer_bytes)):
            self.group.broadcast(chunk.packed_tensor, src=0)


def drafter_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SkyRL's drafter source: the MTP block and the embedding and head it shares
    (``weight_sync/sources.py``, ``is_megatron_draft_param``), by the checkpoint's names."""
    return {n: t for n, t in tensors.items() if "mtp_layers" in n
            or n in ("model.embed_tokens.weight", "lm_head.weight")}


def sglang_push_and_die(url: str, weights_token: str, api_key: str, checkpoint: str,
                        version: int) -> None:
    """A slime trainer that broadcasts its first tensor of a sync and dies (exit 3)."""
    from safetensors.torch import load_file

    tensors = load_file(checkpoint)
    trainer = SGLangTrainer(url, weights_token=weights_token, api_key=api_key)
    trainer.pause()
    bucket = list(tensors.items())[:4]
    sent: list[int] = []

    def once(tensor: torch.Tensor) -> None:
        if sent:
            os._exit(3)
        sent.append(1)
        trainer.broadcast(tensor)

    trainer.update(bucket, version=version, broadcast=once)
