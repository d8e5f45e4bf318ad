"""megatron-core's ``PackedSeqParams`` for a packed (THD) batch.

Runs in each trainer rank, in the forward step, between ``batch.pack_thd`` and
``mtp_forward`` (or ``GPTModel.forward``). No communication.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer_client.batch import PackedBatch

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

__all__ = ["packed_seq_params"]


def packed_seq_params(batch: PackedBatch, *, device: torch.device | str = "cpu"
                      ) -> PackedSeqParams:
    """The ``PackedSeqParams`` of ``batch``'s row: every ``cu_seqlens`` is the padded one.

    ``cu_seqlens_q``, ``cu_seqlens_kv`` and their ``_padded`` twins are all
    ``batch.cu_seqlens_padded``; the real boundaries ``batch.cu_seqlens`` are not passed.
    Why the padded ones, also where Megatron's name suggests the real ones:

    - The MTP block rolls the input ids and position ids of each sequence one step left
      per depth (``roll_tensor(..., packed_seq_params=...)``), slicing the row at
      ``cu_seqlens_q``: that field is used as the *offset* where each sequence starts in
      the row, which is the padded boundary. With the real lengths there, every sequence
      after the first padded one is rolled over the wrong tokens, and its MTP layers read
      another sequence's embeddings (``test_thd_forward`` shows its MTP losses moving).
    - Attention (Transformer Engine's THD kernels) then treats each sequence's padding as
      the tail of that sequence. Causal masking keeps the tail out of every real token's
      attention, so real tokens see exactly their own sequence, and RoPE restarts at each
      padded boundary. Megatron's own pretraining data path passes the padded boundaries
      for both too (with a TODO noting a bug that forces it), as do verl and NeMo-RL.

    The padded tail carries no loss: ``batch.loss_mask`` is 0 there and at each
    sequence's last real position. Under context parallelism pass the whole row's batch
    (boundaries before ``zigzag_split_packed``): Megatron divides them by ``cp`` itself.

    Args:
        batch: From ``batch.pack_thd``.
        device: Where the boundaries go (the device of the model's input).

    Returns:
        ``PackedSeqParams(qkv_format="thd", ...)``, ``max_seqlen_q`` and ``max_seqlen_kv``
        the longest padded sequence.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = batch.cu_seqlens_padded.to(device=device, dtype=torch.int32)
    max_seqlen = int((batch.cu_seqlens_padded[1:] - batch.cu_seqlens_padded[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                           cu_seqlens_q_padded=bounds, cu_seqlens_kv_padded=bounds,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
