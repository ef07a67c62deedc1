"""A captured decode step for the continuous batch (``rollout.compile: true``, HF backend).

On a GPU a small model's decode step is launch-bound: at Qwen2.5-0.5B's shape, batch 64, the H200 spent 1.06 s
of host time against 0.19 s of GPU time per rollout (`benchmarks/results/gpu-h200-*`). This module makes the
whole step (the model's forward for every slot, sampling, the log-probability, feeding the sampled token back)
one replay of a CUDA graph, as vLLM and SGLang do. For that every tensor the step touches has a fixed address
and shape:

- `StaticKV` holds each layer's keys and values in buffers of fixed capacity, (slots, kv heads, columns, head
  dim). A slot's tokens sit left-aligned: slot j holds its request's ids at columns ``[0, lens[j])``, at
  positions 0 … ``lens[j] - 1``. ``lens``, the token to feed next (``tok``) and which slots run (``live``) are
  device tensors, so a request joining or leaving is a write into them, never a new capture.
- The step writes each slot's new key and value at its own column ``lens[j]`` (an indexed write), attends over
  columns ``0 … lens[j]`` (a mask built from ``lens`` inside the step), samples (temperature, nucleus,
  `searchrl.rollout.decoding.sample`), writes the token and its log-probability into a result buffer, feeds the
  token back and advances ``lens`` of the running slots. A free slot attends to its column 0 alone, so its
  values stay finite, and does not advance.
- Graphs are captured per bucket: the slots in use rounded up to a power of two (as vLLM captures batch sizes)
  and the columns in use rounded up to a power of two (attention reads only that window). They are captured
  the first time a bucket is met and kept on the generator for the run (`DecodeGraphs.captures` and
  ``capture_s`` report how many and how long), and read the weights where they lie: an optimizer step or a
  weight sync copies into the same tensors, which the next replay reads without a new capture. If the
  parameters move (another module, ZeRO-3's gather, ``model.to``), the graphs are dropped and captured anew.
- Prefill (new requests, observations appended) stays eager: `HFGenerator._prefill`, then each row's
  unmasked columns are gathered into its slot.

On a CPU the same step runs through ``torch.compile`` (inductor) instead of a CUDA graph, so the code path is
tested where CI runs; ``runner="eager"`` runs it uncompiled. Not supported (refused with the reason): models
whose layers use sliding windows, and attention implementations other than ``sdpa`` and ``eager`` (flash
attention takes no per-row mask here). Greedy decoding gives the ids of the eager continuous batch
(`searchrl.rollout.continuous`) and log-probs within 1e-4 in float32 (tests/rollout/test_graph_decode.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from searchrl.rollout.continuous import Requests
from searchrl.rollout.decoding import base_model, cache_kwargs, last_logits_only, sample
from searchrl.rollout.generator import Generation, SamplingParams

MIN_COLUMNS = 64  # the smallest column bucket (and capacity)
# dynamo's limit on specialisations of one function (renamed from cache_size_limit in torch 2.6)
_RECOMPILE_LIMIT = (
    "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
)


def bucket(n: int, top: int, low: int = 1) -> int:
    """``n`` rounded up to a power of two, at least ``low``, at most ``top``."""
    b = low
    while b < n:
        b *= 2
    return min(b, top)


def check_model(model: Any) -> None:
    """Refuse models whose decode step this module cannot run, with the reason."""
    cfg = getattr(base_model(model), "config", None)
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise ValueError(
            f"rollout.compile: the model's attention implementation is {impl!r}; the captured decode step "
            "needs 'sdpa' or 'eager' (it passes a per-row mask). Load the model with attn_implementation='sdpa' "
            "or set rollout.compile: false"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            "rollout.compile: the model has sliding-window layers "
            f"({sorted(set(layer_types))}); the captured decode step supports full attention only. "
            "Set rollout.compile: false"
        )


class StaticKV:
    """Keys and values of every layer in fixed buffers, with the per-slot state the step reads (module
    docstring). ``result``: (2, slots) float64, the sampled token and its log-probability of each slot."""

    def __init__(self, like: list[torch.Tensor], slots: int, capacity: int, pad_id: int) -> None:
        """``like``: one layer's keys (rows, kv heads, length, head dim) per layer, for shapes and dtype."""
        device = like[0].device
        self.slots, self.capacity, self.pad_id = slots, capacity, pad_id
        self.k = [x.new_zeros((slots, x.shape[1], capacity, x.shape[3])) for x in like]
        self.v = [torch.zeros_like(x) for x in self.k]
        self.lens = torch.zeros(slots, dtype=torch.long, device=device)
        self.tok = torch.full((slots,), pad_id, dtype=torch.long, device=device)
        self.live = torch.zeros(slots, dtype=torch.bool, device=device)
        self.result = torch.zeros((2, slots), dtype=torch.float64, device=device)
        self.rows = torch.arange(slots, device=device)
        self.cols = torch.arange(capacity, device=device)

    def fits(self, like: list[torch.Tensor]) -> bool:
        return len(like) == len(self.k) and all(
            (x.shape[1], x.shape[3], x.dtype, x.device) == (k.shape[1], k.shape[3], k.dtype, k.device)
            for x, k in zip(like, self.k)
        )

    def place(
        self, slots: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor
    ) -> None:
        """Rows of a prefill's cache (rows, heads, width, dim per layer; ``mask`` (rows, width), 1 where a
        column holds one of the row's tokens) into ``slots``, left-aligned, their unmasked columns in order."""
        n = int(mask.sum(1).max())
        # the unmasked columns first, in their order (a stable sort of 0 = kept before 1 = masked)
        order = torch.sort((mask == 0).to(torch.uint8), dim=1, stable=True).indices[:, :n]
        for (keys, values), K, V in zip(layers, self.k, self.v):
            idx = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
            K[slots, :, :n] = keys.gather(2, idx)
            V[slots, :, :n] = values.gather(2, idx)

    def move(self, src: torch.Tensor, dst: torch.Tensor, cols: int) -> None:
        """Slots ``src`` copied to slots ``dst`` (their first ``cols`` columns and state)."""
        for K, V in zip(self.k, self.v):
            K[dst, :, :cols] = K[src, :, :cols]
            V[dst, :, :cols] = V[src, :, :cols]
        for t in (self.lens, self.tok, self.live):
            t[dst] = t[src]

    def free(self, slots: torch.Tensor) -> None:
        self.live[slots] = False
        self.lens[slots] = 0
        self.tok[slots] = self.pad_id


class _BucketLayer(DynamicLayer):
    """One layer of the step's cache: writes each slot's new key and value at its own column ``lens`` and
    returns the first ``cols`` columns of the first ``slots`` slots (views of the static buffers)."""

    def __init__(self, kv: StaticKV, layer: int, slots: int, cols: int) -> None:
        super().__init__()
        self.kv, self.layer, self.n, self.cols = kv, layer, slots, cols
        self.device, self.is_initialized = kv.lens.device, True
        self.window = (kv.k[layer][:slots, :, :cols], kv.v[layer][:slots, :, :cols])
        self.keys, self.values = self.window

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, lens = self.kv.rows[: self.n], self.kv.lens[: self.n]
        self.kv.k[self.layer][rows, :, lens] = key_states[:, :, 0]
        self.kv.v[self.layer][rows, :, lens] = value_states[:, :, 0]
        return self.window

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.cols


def _bucket_cache(kv: StaticKV, slots: int, cols: int) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [_BucketLayer(kv, i, slots, cols) for i in range(len(kv.k))]
    return cache


def _step_fn(model: Any, kv: StaticKV, slots: int, cols: int, params: SamplingParams) -> Callable[[], None]:
    """The decode step of bucket (``slots``, ``cols``): every tensor it reads or writes is one of ``kv``'s."""
    cache = _bucket_cache(kv, slots, cols)
    impl = getattr(base_model(model).config, "_attn_implementation", None) or "eager"
    dtype = kv.k[0].dtype
    extra = {**cache_kwargs(model, cache), **last_logits_only(model)}

    def step() -> None:
        lens, live = kv.lens[:slots], kv.live[:slots]
        keep = kv.cols[None, :cols] <= lens[:, None]  # (slots, cols): the slot's tokens and the new one
        mask = keep[:, None, None, :]
        if impl == "eager":  # additive
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        out = model(
            input_ids=kv.tok[:slots, None],
            attention_mask={"full_attention": mask},
            position_ids=lens[:, None],
            use_cache=True,
            **extra,
        )
        tok, logp = sample(out.logits[:, -1, :], params)
        kv.result[0, :slots].copy_(tok)
        kv.result[1, :slots].copy_(logp)
        kv.tok[:slots].copy_(torch.where(live, tok, kv.tok[:slots]))
        kv.lens[:slots].add_(live.long())

    return step


class DecodeGraphs:
    """The static buffers and one runnable step per bucket, kept on the generator for the run.

    ``runner``: ``"graph"`` (CUDA graphs; the default on a GPU), ``"compile"`` (``torch.compile`` with
    inductor; the default on a CPU) or ``"eager"`` (the same step, uncompiled). ``columns``: the buffers'
    columns from the start (``rollout.max_total_tokens``: an episode never holds more), so that they need not
    grow, which drops every captured step. With CUDA graphs every bucket is captured at the first step of the
    run (`warmup`), and the count and time are printed once."""

    def __init__(self, runner: str | None = None, columns: int | None = None) -> None:
        if runner not in (None, "graph", "compile", "eager"):
            raise ValueError(f"runner {runner!r}: expected 'graph', 'compile' or 'eager'")
        self.runner, self.columns = runner, columns
        self.warmed: set[tuple[Any, ...]] = set()
        self.kv: StaticKV | None = None
        self.steps: dict[tuple[Any, ...], Callable[[], None]] = {}
        self.signature: tuple[int, ...] = ()
        self.captures = 0  # buckets captured (or compiled) since the start
        self.capture_s = 0.0  # seconds spent capturing them
        self._pool: Any = None

    def attach(self, model: Any) -> None:
        """Before a stream: drop the steps if the model or the place of its parameters changed."""
        check_model(model)
        sig = (id(model), *(p.data_ptr() for p in model.parameters()))
        if sig != self.signature:
            self.steps.clear()
            self.signature = sig

    def buffers(self, like: list[torch.Tensor], slots: int, need: int, pad_id: int) -> StaticKV:
        """The static buffers, (re)allocated when absent, of another shape, or with fewer than ``need``
        columns (the steps are dropped then; the caller moves nothing: a stream starts empty)."""
        kv = self.kv
        if kv is None or not kv.fits(like) or kv.slots < slots or kv.capacity < need:
            want = max(need, self.columns or 0, kv.capacity if kv is not None else 0)
            cap = bucket(want, top=1 << 30, low=MIN_COLUMNS)
            self.steps, self.warmed = {}, set()
            kv = self.kv = StaticKV(like, slots, cap, pad_id)
        return kv

    def grow(self, need: int) -> StaticKV:
        """More columns while requests run: new buffers with the old contents (steps dropped)."""
        old = self.kv
        assert old is not None
        cap = bucket(need, top=1 << 30, low=old.capacity)
        new = StaticKV([k[:1] for k in old.k], old.slots, cap, old.pad_id)
        for a, b in zip(new.k + new.v, old.k + old.v):
            a[:, :, : old.capacity] = b
        for a, b in ((new.lens, old.lens), (new.tok, old.tok), (new.live, old.live)):
            a.copy_(b)
        self.kv, self.steps, self.warmed = new, {}, set()
        return new

    def warmup(self, model: Any, params: SamplingParams) -> None:
        """With CUDA graphs: capture every bucket (slot and column counts) for these sampling parameters now,
        once per run (and again after the buffers grow or the parameters move), and say so."""
        kv = self.kv
        key = (params.temperature, params.top_p)
        runner = self.runner or ("graph" if kv is not None and kv.lens.is_cuda else "compile")
        if kv is None or runner != "graph" or key in self.warmed:
            return
        self.warmed.add(key)
        n, t = self.captures, self.capture_s
        rows = sorted({bucket(i, top=kv.slots) for i in range(1, kv.slots + 1)})
        cols = sorted({bucket(i, top=kv.capacity, low=MIN_COLUMNS) for i in range(1, kv.capacity + 1)})
        with torch.no_grad():
            for r in rows:
                for c in cols:
                    k = (r, c, *key)
                    if k not in self.steps:
                        t0 = time.perf_counter()
                        self.steps[k] = self._make(model, r, c, params)
                        self.captures += 1
                        self.capture_s += time.perf_counter() - t0
        print(
            f"rollout.compile: captured {self.captures - n} decode graphs (slots {rows[0]}-{rows[-1]}, columns "
            f"{cols[0]}-{cols[-1]}, temperature {params.temperature}) in {self.capture_s - t:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    def run(self, model: Any, slots: int, cols: int, params: SamplingParams) -> None:
        """One decode step of bucket (``slots``, ``cols``), captured or compiled the first time."""
        key = (slots, cols, params.temperature, params.top_p)
        with torch.no_grad():
            step = self.steps.get(key)
            if step is None:
                t0 = time.perf_counter()
                step = self.steps[key] = self._make(model, slots, cols, params)
                self.captures += 1
                self.capture_s += time.perf_counter() - t0
            step()

    def _make(self, model: Any, slots: int, cols: int, params: SamplingParams) -> Callable[[], None]:
        assert self.kv is not None
        kv = self.kv
        fn = _step_fn(model, kv, slots, cols, params)
        runner = self.runner or ("graph" if kv.lens.is_cuda else "compile")
        if runner == "eager":
            return fn
        if runner == "compile":
            compiled = torch.compile(fn, dynamic=False)

            def run() -> None:
                # every bucket is a specialisation of the same function: more than dynamo's default 8
                with torch._dynamo.config.patch(_RECOMPILE_LIMIT, 1024):
                    compiled()

            state = _snapshot(kv)
            run()  # compiles now: the time is the capture's, not the first step's
            _restore(kv, state)
            return run
        if not kv.lens.is_cuda:
            raise ValueError("runner 'graph' needs a CUDA device; on a CPU use 'compile' or 'eager'")
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # cuDNN's attention builds plans on the host per shape; the memory-efficient kernel takes the mask and
        # is captured as it is
        kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        state = _snapshot(kv)
        side = torch.cuda.Stream(device=kv.lens.device)
        side.wait_stream(torch.cuda.current_stream(kv.lens.device))
        with (
            torch.cuda.stream(side),
            sdpa_kernel(kernels),
        ):  # one eager run first: lazy initialisation, workspaces
            fn()
        torch.cuda.current_stream(kv.lens.device).wait_stream(side)
        _restore(kv, state)
        graph = torch.cuda.CUDAGraph()
        # thread_local: an asynchronous trainer may run its own kernels on another thread meanwhile
        with (
            sdpa_kernel(kernels),
            torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"),
        ):
            fn()  # recorded, not run
        return graph.replay


def _snapshot(kv: StaticKV) -> list[torch.Tensor]:
    """The state one untimed run of a step changes (keys and values written at ``lens`` are beyond every slot's
    tokens, so they are overwritten before they are read)."""
    return [kv.lens.clone(), kv.tok.clone(), kv.result.clone()]


def _restore(kv: StaticKV, state: list[torch.Tensor]) -> None:
    for t, s in zip((kv.lens, kv.tok, kv.result), state):
        t.copy_(s)


class GraphStream(Requests):
    """`searchrl.rollout.continuous.HFStream`'s interface (``add``, ``step``, ``len``, ``version``,
    ``forwards``, ``close``) over `DecodeGraphs`: ``step`` replays the captured step for the running slots
    (one token each), then admits queued requests into free slots (prefilled eagerly, their first token
    sampled from the prefill's logits). A slot that finishes is freed; when nothing waits and at most half of
    the slot bucket runs, the running slots are packed to the front so that a smaller bucket serves them."""

    def __init__(self, gen: Any, model: Any, params: SamplingParams, graphs: DecodeGraphs) -> None:
        super().__init__(gen, model, params, gen.batch_size)
        self.graphs = graphs
        self.lens = [0] * gen.batch_size  # the host's copy of the device's ``lens``
        graphs.attach(model)

    def close(self) -> None:
        self.queue.clear()
        if self.graphs.kv is not None and self.running:
            self.graphs.kv.free(torch.tensor(self._live(), device=self.graphs.kv.lens.device))
        self.slots = [None] * len(self.slots)
        self.running = 0

    def step(self) -> list[tuple[Hashable, Generation]]:
        done: list[tuple[Hashable, Generation]] = []
        freed: list[int] = []
        if self.running:
            kv = self.graphs.kv
            assert kv is not None
            live = self._live()
            slots = bucket(live[-1] + 1, top=kv.slots)
            cols = bucket(max(self.lens[j] for j in live) + 1, top=kv.capacity, low=MIN_COLUMNS)
            self.graphs.warmup(self.model, self.params)
            self.graphs.run(self.model, slots, cols, self.params)
            self.forwards += 1
            toks, logps = kv.result[:, :slots].tolist()
            for j in live:
                self.lens[j] += 1
                self._take(j, int(toks[j]), logps[j], done, freed)
        self._admit(done, freed)
        if freed:
            kv = self.graphs.kv
            assert kv is not None
            kv.free(torch.tensor(freed, device=kv.lens.device))
        self._pack()
        return done

    # ------------------------------------------------------------------------------------- internals
    def _live(self) -> list[int]:
        return [j for j, r in enumerate(self.slots) if r is not None]

    def _take(self, j: int, t: int, lp: float, done: list, freed: list[int]) -> None:
        """Slot ``j``'s new token: recorded; the request finishes at EOS, a stop tag or its budget."""
        r = self.slots[j]
        assert r is not None
        gen = self.gen
        r.tokens.append(t)
        r.logprobs.append(lp)
        r.versions.append(self.version)
        if t in gen.eos_ids:
            finish = "eos"
        elif t in gen.stop_ids or gen.text_stop(r.tokens):
            finish = "stop"
            if gen.reuse_cache:  # every token but the stop token has been fed: columns [0, lens)
                kv = self.graphs.kv
                assert kv is not None
                gen._save_layers(
                    r.key, r.prompt + r.tokens[:-1], [(k[j], v[j]) for k, v in zip(kv.k, kv.v)], self.lens[j]
                )
        elif len(r.tokens) >= r.max_new_tokens:
            finish = "length"
        else:
            return
        done.append((r.key, Generation(r.tokens, r.logprobs, finish, r.versions)))  # type: ignore[arg-type]
        self.slots[j] = None
        self.lens[j] = 0
        self.running -= 1
        freed.append(j)

    def _admit(self, done: list, freed: list[int]) -> None:
        """Queued requests into free slots: prefilled in one forward, placed, their first token sampled."""
        from searchrl.rollout.decoding import output_cache

        free = [j for j, r in enumerate(self.slots) if r is None and j not in freed]
        if not self.queue or not free:
            return
        new = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        prompts = [r.prompt for r in new]
        out, mask, _ = self.gen._prefill(
            self.model, prompts, self.gen._take_saved([r.key for r in new], prompts)
        )
        self.forwards += 1
        layers = [(x.keys, x.values) for x in output_cache(out).layers]
        need = max(len(r.prompt) + r.max_new_tokens for r in new)
        kv = self.graphs.kv
        if kv is None or not kv.fits([k for k, _ in layers]) or (not self.running and kv.capacity < need):
            kv = self.graphs.buffers([k for k, _ in layers], len(self.slots), need, self.gen.pad_id)
        elif kv.capacity < need:
            kv = self.graphs.grow(need)
        slots = free[: len(new)]
        sel = torch.tensor(slots, device=kv.lens.device)
        kv.place(sel, layers, mask)
        tok, logp = sample(out.logits[:, -1, :], self.params)
        kv.lens[sel] = torch.tensor([len(p) for p in prompts], device=kv.lens.device)
        kv.tok[sel] = tok
        kv.live[sel] = True
        for j, r in zip(slots, new):
            self.slots[j] = r
            self.lens[j] = len(r.prompt)
        self.running += len(new)
        for j, t, lp in zip(slots, tok.tolist(), logp.tolist()):
            self._take(j, t, lp, done, freed)

    def _pack(self) -> None:
        """With nothing queued and at most half of the slot bucket running, the running slots moved to the
        front (their first columns copied), so that the next steps run a smaller bucket."""
        kv = self.graphs.kv
        if kv is None or self.queue or not self.running:
            return
        live = self._live()
        if bucket(live[-1] + 1, top=kv.slots) < 2 * bucket(len(live), top=kv.slots):
            return
        moved = [(j, i) for i, j in enumerate(live) if i != j]
        if not moved:
            return
        cols = bucket(max(self.lens[j] for j in live) + 1, top=kv.capacity, low=MIN_COLUMNS)
        src = torch.tensor([j for j, _ in moved], device=kv.lens.device)
        dst = torch.tensor([i for _, i in moved], device=kv.lens.device)
        kv.move(src, dst, cols)
        vacated = sorted({j for j, _ in moved} - {i for _, i in moved})
        if vacated:
            kv.free(torch.tensor(vacated, device=kv.lens.device))
        slots, lens = list(self.slots), list(self.lens)
        for j, i in moved:
            self.slots[i], self.lens[i] = slots[j], lens[j]
        for j in vacated:
            self.slots[j], self.lens[j] = None, 0
