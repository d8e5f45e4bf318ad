"""Parity: vLLM's MiMo drafter and Megatron's MTP head agree on the same weights (CPU).

This is the test that proves the converter (``trainer_client.megatron.convert``) by
running both real engines, not by reading code. One vLLM CPU engine (``LLM``, MTP
speculative decoding with one draft token, greedy, float32: the service's engine setup)
generates from a handful of prompts on the embedded tiny checkpoint while a
test-only worker extension (``draft_recorder.py``) logs every draft token the drafter
proposes. A spawned process loads the same checkpoint into megatron-core's ``GPTModel``
through ``convert.load_hf_state`` and runs the final sequences through
``mtp_forward``. Then:

- every proposal sampled from drafter slot ``p`` (target hidden state at ``p``, token at
  ``p + 1``, predicting ``p + 2``) equals the argmax of Megatron's MTP logits at ``p``,
  wherever Megatron's top-1/top-2 margin exceeds ``MIN_MARGIN`` (the engines' logprobs differ
  by ~1e-5; positions under the margin are counted, not compared);
- vLLM's log-probabilities of the main model (prompt logprobs and the top-k logprobs of
  each generated token) equal Megatron's log-softmax within bf16 tolerance, and greedy
  tokens equal Megatron's argmax;
- negative control: the same checkpoint loaded with MiMo's ``input_proj`` halves NOT
  swapped (the converter's ``_swap_input_halves`` undone) disagrees with the drafter at
  most positions, so the agreement above is not vacuous.

Position 0. Decision: the comparison accounts for it exactly; the trainer is unchanged.
vLLM's ``MiMoMultiTokenPredictorLayer`` (like its DeepSeek/GLM/Ernie MTP layers, and
SGLang's MiMo MTP) zeroes the drafter's token embedding at position 0 ("not needed by
MTP"); megatron-core 0.16.1's MTP layer does not, and Xiaomi's HF ``modeling_mimo.py``
defines the MTP layer without any zeroing (and never runs it in ``forward``), so no
reference settles it. The effect is not local to position 0: the drafter's attention
key/value there differ, so every later drafter output moves. Measured on the tiny
checkpoint (``test_position_0_zeroing_reaches_later_drafter_outputs``): without the
zeroing Megatron's MTP logits at positions >= 1 move by 0.77-0.96, and 3 of 126 proposals
(each among the first two a sequence drafts) are no longer Megatron's argmax. So the
comparison zeroes Megatron's ``enorm`` output at position 0, a forward hook in this test
only; that is exactly vLLM's zeroing, since RMSNorm of a zero vector is zero. Making the
trainer match vLLM would change what Megatron's MTP layer computes (at every sequence
start of a packed batch, under sequence parallelism too); that is a training choice with
its own test, not part of proving the converter (README, "Parity with vLLM").

Measured here (2 cores): 126/126 proposals agree (3 more under the margin), 1338 main
logprobs within 1.4e-5, 0/126 agree with the halves unswapped; ~65 s for the module.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_service.config import EMBEDDED_ENGINE_KWARGS
from rollout_service.embedded import ensure_model

pytest.importorskip("vllm", reason="needs the vLLM engine (the service or the drafter)")

DRAFT_RECORDER = "tests.integration.trainer_client.draft_recorder.DraftRecorderExtension"
"""vLLM worker extension recording every draft token (test-only)."""

PROMPTS = (
    "Once upon a time there was a",
    "def main():\n    return",
    "2 + 3 =",
    "The quick brown fox jumps over the lazy dog and",
    "In the beginning",
)
"""Text prompts; one more prompt of a single token puts a proposal at drafter slot 0."""
MAX_TOKENS = 32
MIN_MARGIN = 0.05
"""Megatron MTP logit margin (top-1 minus top-2) above which tokens must agree exactly."""
MIN_COMPARED = 100
"""The drafter comparison must cover at least this many proposals."""
BF16_TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-5}
"""``torch.testing``'s defaults for bfloat16."""
NUM_LOGPROBS = 5
TIMEOUT_S = 300.0


# --------------------------------------------------------------------------- Megatron side

def _unswapped(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint with ``input_proj``'s input halves pre-swapped, so that the converter's
    swap cancels and Megatron's ``eh_proj`` gets MiMo's order (the converter bug to catch)."""
    def swapped(weight: torch.Tensor) -> torch.Tensor:
        first, second = weight.chunk(2, dim=1)
        return torch.cat([second, first], dim=1)

    return {name: swapped(t) if name.endswith("input_proj.weight") else t
            for name, t in hf_state.items()}


def _megatron_worker(inbox: multiprocessing.Queue, outbox: multiprocessing.Queue) -> None:
    """Spawned: build the GPTModel, wait for the sequences, send back logits per variant."""
    try:
        warnings.filterwarnings("ignore")
        from safetensors.torch import load_file

        from trainer_client.megatron.convert import load_hf_state
        from trainer_client.megatron.model import build_gpt_mtp_model, init_parallel_cpu
        from trainer_client.megatron.mtp_forward import mtp_forward

        path = Path(ensure_model("tiny"))
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        hf_state = load_file(str(path / "model.safetensors"))
        with init_parallel_cpu(1):
            model = build_gpt_mtp_model(config)
            model.eval()
            sequences = inbox.get(timeout=TIMEOUT_S)
            zero_position_0 = [False]

            def zero_embedding_at_position_0(_module: Any, _args: Any, out: torch.Tensor
                                             ) -> torch.Tensor | None:
                if not zero_position_0[0]:
                    return None
                out = out.clone()
                out[0] = 0.0  # [s, b, h]: vLLM zeroes the embedding before its norm
                return out

            model.mtp.layers[0].enorm.register_forward_hook(zero_embedding_at_position_0)

            def run(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
                tokens = torch.tensor([ids])
                seq = tokens.size(1)
                causal = torch.ones(seq, seq, dtype=torch.bool).triu(1).view(1, 1, seq, seq)
                with torch.no_grad():
                    out = mtp_forward(model, tokens, torch.arange(seq).unsqueeze(0), causal,
                                      labels=None, loss_mask=None, detach_trunk=True)
                    mtp_logits, _ = model.output_layer(out.mtp_hidden[0],
                                                       weight=out.output_weight)
                return out.main_output[0].log_softmax(-1), mtp_logits[:, 0]

            result: dict[str, list[torch.Tensor]] = {}
            for name, state, zero in (("converted", hf_state, True),
                                      ("converted_no_zeroing", hf_state, False),
                                      ("unswapped", _unswapped(hf_state), True)):
                load_hf_state(model, state, config)
                zero_position_0[0] = zero
                runs = [run(ids) for ids in sequences]
                result[name] = [mtp for _, mtp in runs]
                if name == "converted":
                    result["main_logprobs"] = [main for main, _ in runs]
        # numpy, not tensors: torch pickles tensors as shared-memory handles that die with
        # this process.
        outbox.put({name: [t.numpy() for t in tensors] for name, tensors in result.items()})
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        import traceback
        outbox.put(traceback.format_exc())


class MegatronProcess:
    """The spawned Megatron worker: started first, so its imports overlap vLLM's start-up."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=_megatron_worker, args=(self._inbox, self._outbox),
                                 daemon=True)
        self._proc.start()

    def submit(self, sequences: list[list[int]]) -> None:
        self._inbox.put(sequences)

    def result(self) -> dict[str, list[torch.Tensor]]:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                result = self._outbox.get(timeout=0.5)
                break
            except queue.Empty:
                if not self._proc.is_alive():
                    pytest.fail(f"Megatron process died with exit code {self._proc.exitcode}")
                if time.monotonic() > deadline:
                    pytest.fail(f"Megatron process did not answer in {TIMEOUT_S:g} s")
        assert not isinstance(result, str), f"Megatron process failed:\n{result}"
        return {name: [torch.from_numpy(a) for a in arrays] for name, arrays in result.items()}

    def close(self) -> None:
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


# --------------------------------------------------------------------------- vLLM side

@dataclass(frozen=True, kw_only=True, slots=True)
class Proposal:
    """One draft token the vLLM drafter proposed."""

    seq: int
    """Index of the sequence in ``Parity.sequences``."""
    slot: int
    """Drafter slot ``p``: hidden state at ``p``, token at ``p + 1``."""
    draft: int
    """The proposed token for position ``p + 2``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Parity:
    """Everything both engines produced for the same sequences."""

    sequences: list[list[int]]
    """Prompt + greedy completion per request."""
    prompt_lens: list[int]
    proposals: list[Proposal]
    """Proposals whose predicted position lies inside the final sequence."""
    vllm_logprobs: list[tuple[int, int, int, float]]
    """``(seq, position, token, logprob)``: vLLM's main-model log p(token at position)."""
    megatron: dict[str, list[torch.Tensor]]
    """``main_logprobs`` ``[L, V]`` and MTP logits ``[L, V]`` per variant, per sequence."""
    duration_s: float


def _start_vllm(path: str) -> Any:
    from vllm import LLM

    llm = LLM(model=path, **EMBEDDED_ENGINE_KWARGS, seed=0,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1},
              worker_extension_cls=DRAFT_RECORDER)
    llm.collective_rpc("start_recording_drafts")
    return llm


def _generate(llm: Any) -> tuple[list[Any], list[tuple[str, int, int, int]]]:
    """Greedy completions with logprobs, and the drafter's recorded proposals."""
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    prompts.append(prompts[0][:1])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=NUM_LOGPROBS, prompt_logprobs=NUM_LOGPROBS)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                           use_tqdm=False)
    (records,) = llm.collective_rpc("recorded_drafts")
    return outputs, records


@pytest.fixture(scope="module")
def parity() -> Parity:
    pytest.importorskip("megatron.core")
    started = time.monotonic()
    path = str(ensure_model("tiny"))
    megatron = MegatronProcess()  # its imports and model build overlap vLLM's start-up
    try:
        llm = _start_vllm(path)
        try:
            outputs, records = _generate(llm)
            sequences = [list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
                         for out in outputs]
            megatron.submit(sequences)
        finally:
            llm.llm_engine.engine_core.shutdown()

        prompt_lens = [len(out.prompt_token_ids) for out in outputs]
        by_request = {out.request_id: i for i, out in enumerate(outputs)}
        vllm_logprobs = []
        for i, out in enumerate(outputs):
            for pos, entry in enumerate(out.prompt_logprobs):
                vllm_logprobs.extend((i, pos, tok, lp.logprob)
                                     for tok, lp in (entry or {}).items())
            for j, entry in enumerate(out.outputs[0].logprobs):
                vllm_logprobs.extend((i, prompt_lens[i] + j, tok, lp.logprob)
                                     for tok, lp in entry.items())
        proposals = []
        for request_id, slot, next_token, draft in records:
            seq = by_request[request_id.split("-", 1)[0]]  # LLM appends "-<random>"
            if slot + 2 >= len(sequences[seq]):
                continue  # drafted past the end of the request
            assert sequences[seq][slot + 1] == next_token, (
                "recorder: the token the drafter was fed is not the sequence's token at "
                f"slot + 1 (request {request_id}, slot {slot})")
            proposals.append(Proposal(seq=seq, slot=slot, draft=draft))
        result = megatron.result()
    finally:
        megatron.close()
    return Parity(sequences=sequences, prompt_lens=prompt_lens, proposals=proposals,
                  vllm_logprobs=vllm_logprobs, megatron=result,
                  duration_s=time.monotonic() - started)


def _agreement(parity: Parity, variant: str) -> tuple[int, int, int, list[tuple[int, int]]]:
    """(agreeing, compared, skipped for a small margin, disagreeing (seq, slot)) for
    the proposals against the argmax of Megatron's MTP logits of ``variant``."""
    agree, compared, skipped, wrong = 0, 0, 0, []
    reference = parity.megatron["converted"]
    for prop in parity.proposals:
        top2 = reference[prop.seq][prop.slot].topk(2).values
        if top2[0] - top2[1] < MIN_MARGIN:
            skipped += 1
            continue
        compared += 1
        if int(parity.megatron[variant][prop.seq][prop.slot].argmax()) == prop.draft:
            agree += 1
        else:
            wrong.append((prop.seq, prop.slot))
    return agree, compared, skipped, wrong


# --------------------------------------------------------------------------- tests

def test_drafter_proposals_equal_megatron_mtp_argmax(parity: Parity) -> None:
    agree, compared, skipped, wrong = _agreement(parity, "converted")
    print(f"\ndrafter vs Megatron MTP argmax: {agree}/{compared} agree, {skipped} under "
          f"margin {MIN_MARGIN}; {len(parity.sequences)} sequences; {parity.duration_s:.0f} s")
    assert compared >= MIN_COMPARED and skipped <= compared // 10, (compared, skipped)
    assert not wrong, f"drafter disagrees with Megatron at (seq, slot) {wrong}"
    # The single-token prompt's first proposal comes from slot 0 (zeroed embedding).
    assert any(p.slot == 0 for p in parity.proposals)


def test_main_logprobs_match_megatron_within_bf16_tolerance(parity: Parity) -> None:
    main = parity.megatron["main_logprobs"]
    ours = torch.tensor([lp for *_, lp in parity.vllm_logprobs])
    theirs = torch.stack([main[seq][pos - 1, tok] for seq, pos, tok, _ in parity.vllm_logprobs])
    print(f"\nmain logprobs: {len(ours)} values, max |diff| "
          f"{(ours - theirs).abs().max():.2e}")
    torch.testing.assert_close(ours, theirs, **BF16_TOLERANCE)
    for seq, ids in enumerate(parity.sequences):  # greedy tokens are Megatron's argmax
        start = parity.prompt_lens[seq]
        assert ids[start:] == main[seq][start - 1:-1].argmax(-1).tolist(), seq


def test_position_0_zeroing_reaches_later_drafter_outputs(parity: Parity) -> None:
    """Measures the train/serve difference at position 0 (module docstring).

    Without the zeroing, Megatron's MTP logits move at every later position (through the
    drafter's attention to position 0), by less further from it, and some of vLLM's
    proposals are no longer Megatron's argmax: the comparison must zero it.
    """
    pairs = list(zip(parity.megatron["converted"], parity.megatron["converted_no_zeroing"],
                     strict=True))
    after_0 = [(zeroed[1:] - plain[1:]).abs().max().item() for zeroed, plain in pairs]
    in_completion = [(zeroed[max(n - 1, 1):] - plain[max(n - 1, 1):]).abs().max().item()
                     for (zeroed, plain), n in zip(pairs, parity.prompt_lens, strict=True)]
    agree, compared, _, wrong = _agreement(parity, "converted_no_zeroing")
    print(f"\nwithout zeroing position 0: MTP logits at positions >= 1 move by up to "
          f"{max(after_0):.3f} (at least {min(after_0):.3f} per sequence), at the slots "
          f"drafting the completion (slot >= 1) by up to {max(in_completion):.3f}; "
          f"{agree}/{compared} "
          f"proposals still agree; flipped at (seq, slot, prompt length) "
          f"{[(seq, slot, parity.prompt_lens[seq]) for seq, slot in wrong]}")
    assert min(after_0) > 10 * MIN_MARGIN
    assert wrong, "zeroing position 0 flips no proposal: the comparison would not need it"


def test_unswapped_input_proj_disagrees_with_the_drafter(parity: Parity) -> None:
    """Negative control: without the converter's eh_proj half swap the test fails."""
    agree, compared, _, _ = _agreement(parity, "unswapped")
    print(f"\nunswapped input_proj halves: {agree}/{compared} proposals agree")
    assert agree < compared // 2
