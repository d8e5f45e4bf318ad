"""The FAKE SGLang server's toy model (``fake_sglang.py``): what it generates and the
speculative counts it reports, no inference.

Token ``t`` reads as ``chr(ord("a") + t % 26)``; text tokenizes one token per character;
each generated token is the previous one plus 1 (mod the vocabulary); ``eos_token_id``
ends a sequence unless ``ignore_eos``. Speculative counts follow SGLang's formulas for a
drafter that gets ``accept_per_step`` tokens accepted per verify step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.support.fake_sglang_profiles import Profile

Finish = dict[str, Any]
"""SGLang's ``meta_info.finish_reason``: ``{"type": "stop" | "length", ...}``."""


@dataclass
class ToyModel:
    """The toy model of one fake server; tests change its fields between requests.

    Args:
        vocab_size: tokens ``0 .. vocab_size - 1``.
        eos_token_id: the token that ends a sequence.
        accept_per_step: drafts accepted per verify step (capped at the server's
            ``speculative_num_steps``).
    """

    vocab_size: int = 64
    eos_token_id: int = 63
    accept_per_step: int = 1

    def encode(self, text: str) -> list[int]:
        """The toy tokenizer: one token per character."""
        return [ord(c) % 26 for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids if t != self.eos_token_id)

    def complete(self, prompt_ids: list[int], params: dict[str, Any]
                 ) -> tuple[list[int], str, Finish]:
        """The output ids, text and finish reason for SGLang's ``sampling_params``
        (``max_new_tokens``, ``ignore_eos``, ``stop``: a stop string is trimmed from the
        text)."""
        output_ids: list[int] = []
        token = prompt_ids[-1]
        stops = params.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        for _ in range(params.get("max_new_tokens", 128)):
            token = (token + 1) % self.vocab_size
            output_ids.append(token)
            if token == self.eos_token_id and not params.get("ignore_eos", False):
                return output_ids, self.decode(output_ids), {"type": "stop", "matched": token}
            text = self.decode(output_ids)
            for stop in stops:
                if stop in text:
                    return output_ids, text[:text.index(stop)], {"type": "stop", "matched": stop}
        return output_ids, self.decode(output_ids), {"type": "length", "length": len(output_ids)}

    def steps(self, num_tokens: int) -> list[int]:
        """Token counts after each decode step: the prefill's token, then accepted + 1."""
        ends = [min(1, num_tokens)]
        while ends[-1] < num_tokens:
            ends.append(min(num_tokens, ends[-1] + self.accept_per_step + 1))
        return ends

    def spec_meta_info(self, num_completion: int, *, num_steps: int, num_draft_tokens: int,
                       profile: Profile) -> dict[str, Any]:
        """SGLang's per-request keys: the prefill's token, then each verify step's accepted
        drafts plus one; a last run cut at ``max_new_tokens`` counts whole (live 0.5.23).

        Args:
            num_completion: the request's generated tokens.
            num_steps, num_draft_tokens: the server's ``speculative_num_steps`` and
                ``speculative_num_draft_tokens``.
            profile: the SGLang version spoken (its key names).
        """
        verify_ct = accepted = 0
        histogram: list[int] = []
        remaining = num_completion - 1
        while remaining > 0:
            step_accepted = min(self.accept_per_step, num_steps)
            histogram += [0] * (step_accepted + 1 - len(histogram))
            histogram[step_accepted] += 1
            verify_ct += 1
            accepted += step_accepted
            remaining -= step_accepted + 1
        if verify_ct == 0:
            return {}  # SGLang reports nothing for a request without a verify step
        proposed = verify_ct * (num_draft_tokens - 1)
        meta: dict[str, Any] = {"spec_accept_rate": accepted / proposed,
                                "spec_accept_length": num_completion / verify_ct}
        for accepted_key, proposed_key in profile.spec_keys:
            meta |= {accepted_key: accepted, proposed_key: proposed}
        meta["spec_verify_ct"] = verify_ct
        meta[profile.histogram_key] = histogram
        return meta
