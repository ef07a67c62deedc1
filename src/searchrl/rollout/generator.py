"""The generator protocol every backend (HF, vLLM) implements, and its registry."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from searchrl.core.registry import Registry


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_new_tokens: int = 64
    # record the entropy of the sampling distribution at the first n tokens of every generation (ARPO's branching
    # signal, `algorithms.arpo`); 0: none
    entropy_tokens: int = 0


@dataclass
class Generation:
    token_ids: list[int]  # exactly as sampled, up to and including the stop token
    logprobs: list[float]  # log π_T(token) with π_T = softmax(logits / T) (T = 1 when greedy), one per token
    finish: Literal["stop", "eos", "length"]
    # the policy version whose logits sampled each token (asynchronous rollouts; None: the current policy)
    versions: list[int] | None = None
    # H(π_T) in nats at each of the first ``SamplingParams.entropy_tokens`` tokens (None: not asked). The HF
    # backends sum over the whole vocabulary; vLLM returns at most its top-k log-probs, so there it is the sum
    # over those (as ARPO's released code computes it)
    entropy: list[float] | None = None


class Generator(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cache_keys: Sequence[Hashable] | None = None,
    ) -> list[Generation]:
        """Continue each prompt (token ids) until a stop tag, EOS or ``max_new_tokens``.

        ``cache_keys`` name the episode each prompt belongs to. A backend may keep an episode's KV cache
        under its key and, when the next prompt under that key extends the tokens it has cached, compute
        only the new tokens (the multi-turn loop passes them; vLLM does the same by prefix caching).
        """
        ...

    def release(self, cache_keys: Sequence[Hashable] | None = None) -> None:
        """Drop what is cached under these keys (all keys when None); weights are about to change."""
        ...


def split_stops(tokenizer: Any, stop_strings: Sequence[str]) -> tuple[set[int], list[str]]:
    """Stop tags that are one token of ``tokenizer`` (matched on ids) and the others (matched on text)."""
    ids: set[int] = set()
    texts: list[str] = []
    for s in stop_strings:
        enc = tokenizer.encode(s, add_special_tokens=False)
        if len(enc) == 1 and tokenizer.decode(enc) == s:
            ids.add(enc[0])
        else:
            texts.append(s)
    return ids, texts


def generator_options(rollout: Any) -> dict[str, Any]:
    """The keyword arguments a generator of ``rollout.backend`` is built with from a `RolloutConfig`: its
    ``backend_args``, and for the HF backend ``compile``, ``prefix_sharing`` (vLLM does both itself) and
    ``max_total_tokens`` (the captured step's cache columns)."""
    opts = dict(rollout.backend_args)
    if rollout.backend == "hf":
        opts.setdefault("compile", rollout.compile)
        opts.setdefault("prefix_sharing", rollout.prefix_sharing)
        opts.setdefault("max_total_tokens", rollout.max_total_tokens)
    return opts


GENERATORS: Registry[Any] = Registry("generator")
GENERATORS.add_lazy("hf", "searchrl.rollout.hf:HFGenerator")
GENERATORS.add_lazy("vllm", "searchrl.rollout.vllm:VLLMGenerator")
