"""The captured decode step (`searchrl.rollout.graph_decode`, ``rollout.compile``) and prefix sharing
(``rollout.prefix_sharing``) against the eager continuous batch: greedy episodes give the same ids, sampled
log-probs are the model's within 1e-4 (float32), through admissions, departures and packing; on the quickstart's
tiny model and on a random model at Qwen2.5's real vocabulary; LoRA and full; the step does nothing that a CUDA
graph cannot capture (no host synchronisation) and reads weights changed in place."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from searchrl.engine.metrics import read_metrics
from searchrl.envs.search import SearchEnv
from searchrl.models import load_model_and_tokenizer
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.graph_decode import DecodeGraphs, GraphStream, StaticKV, _step_fn, bucket, check_model
from searchrl.rollout.hf import HFGenerator, _common_prefix
from searchrl.rollout.loop import branch, rollout, run, start_trajectories

from ..helpers import qwen_model
from .test_agent_loop import Steered, assert_same, same_stats
from .test_text_tags import logprob_gap

# compares two computation paths of the same numbers: .ci/run runs these again under a second floating-point
# path (other kernels, one thread), so a tolerance that holds on one CPU's kernels only fails in CI
pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def steered(agent_model_dir, world_bm25, small_world):
    """The steered agent of test_agent_loop: greedy episodes search, answer and stop at different tokens."""
    model, tok = load_model_and_tokenizer(agent_model_dir)
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3)
    for seed in range(20):
        m = Steered(model, tok, seed=seed).eval()
        trajs = start_trajectories(env, tok, small_world.examples("test")[:24])
        stats = run(
            trajs, env, HFGenerator(m, tok, env.tags.stop_strings), tok, SamplingParams(0.0, 1.0, 24), 400
        )
        if stats.searches > 0:
            return m, tok, env
    raise AssertionError("no steering seed in 0-19 made a valid search")


def episodes(model, tok, env, examples, params, batch_size, group=1, **kw):
    gen = HFGenerator(model, tok, env.tags.stop_strings, batch_size=batch_size, **kw)
    trajs = start_trajectories(env, tok, examples, group)
    stats = run(trajs, env, gen, tok, params, 400)
    assert gen._saved == {}  # every kept cache released
    return trajs, stats, gen


@pytest.mark.parametrize("batch_size", [5, 64])
@pytest.mark.parametrize("continuous", [True, False])
def test_greedy_episodes_equal_the_eager_batch(steered, small_world, batch_size, continuous):
    """Batch 5 < 48 episodes: requests join and leave mid-decode, slots are reused and packed; 64: one batch.
    The turn loop (continuous False) runs through the captured step too."""
    model, tok, env = steered
    ex = small_world.examples("test")[:24]
    params = SamplingParams(0.0, 1.0, 24)
    old, so, _ = episodes(model, tok, env, ex, params, batch_size, 2, continuous=continuous)
    new, sn, gen = episodes(
        model,
        tok,
        env,
        ex,
        params,
        batch_size,
        2,
        continuous=continuous,
        compile=True,
        compile_runner="eager",
    )
    assert_same(old, new)
    assert same_stats(so, sn)
    assert sn.searches > 0 and sn.actions > len(ex) * 2
    assert gen._graphs.captures > 1  # several buckets were met


def test_greedy_branched_prefixes_match(steered, small_world):
    """SLATE / RAG-Gym candidates: k copies of a recorded prefix, one step each (equal prompts admitted
    together: prefix sharing computes each once)."""
    model, tok, env = steered
    params = SamplingParams(0.0, 1.0, 24)
    prefixes = start_trajectories(env, tok, small_world.examples("test")[:8])
    run(prefixes, env, HFGenerator(model, tok, env.tags.stop_strings, continuous=False), tok, params, 400, 1)
    live = [p for p in prefixes if not p.state.done]
    assert live
    out = []
    for kw in ({}, {"compile": True, "compile_runner": "eager"}, {"prefix_sharing": True}):
        gen = HFGenerator(model, tok, env.tags.stop_strings, batch_size=64, **kw)
        kids = branch(live, 3)
        out.append((kids, run(kids, env, gen, tok, params, 400, max_steps=1), gen))
    for kids, stats, _ in out[1:]:
        assert_same(out[0][0], kids)
        assert same_stats(out[0][1], stats)
    assert out[2][2].shared_tokens >= 2 * sum(len(p) for p in live)  # 2 of each 3 copies not prefilled


def test_prefix_sharing_gives_the_same_episodes(steered, small_world):
    """A GRPO group's 8 episodes share their prompt, and the questions share the template's prefix: computed
    once each; greedy ids equal, log-probs within 1e-4."""
    model, tok, env = steered
    ex = small_world.examples("test")[:12]
    params = SamplingParams(0.0, 1.0, 24)
    for continuous in (True, False):
        old, so, _ = episodes(model, tok, env, ex, params, 64, 8, continuous=continuous)
        new, sn, gen = episodes(
            model, tok, env, ex, params, 64, 8, continuous=continuous, prefix_sharing=True
        )
        assert_same(old, new)
        assert same_stats(so, sn)
        prompt = sum(len(t.segments[0].token_ids) for t in new)
        assert gen.shared_tokens >= prompt * 7 / 8  # 7 of 8 copies of each prompt at least


def test_common_prefix():
    assert _common_prefix([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5]]) == 2
    assert _common_prefix([[1, 2, 3], [1, 2, 3]]) == 2  # one token of its own each
    assert _common_prefix([[1], [1]]) == 0
    assert _common_prefix([[5, 1], [6, 1]]) == 0


def test_shared_prefix_of_distinct_prompts_is_computed_once(steered, small_world, monkeypatch):
    """Distinct prompts that share 32 or more tokens: the prefix is one forward of one row, then each prompt's
    tail; the last logits equal those of whole prompts within 1e-4."""
    import searchrl.rollout.hf as hf

    model, tok, env = steered
    prompts = [
        tok(env.reset(e).prompt, add_special_tokens=False)["input_ids"]
        for e in small_world.examples("test")[:6]
    ]
    n = _common_prefix(prompts)
    assert 4 < n < min(len(p) for p in prompts)
    monkeypatch.setattr(hf, "SHARED_PREFIX_MIN", n)
    rows = []
    model.lm.register_forward_pre_hook(lambda _m, a, k: rows.append(k["input_ids"].shape), with_kwargs=True)
    with torch.no_grad():
        plain = HFGenerator(model, tok, [])._prefill(model, prompts, [None] * len(prompts))
        rows.clear()
        gen = HFGenerator(model, tok, [], prefix_sharing=True)
        shared = gen._prefill(model, prompts, [None] * len(prompts))
    assert rows[0] == (1, n) and rows[1][0] == len(prompts) and rows[1][1] == max(len(p) for p in prompts) - n
    assert gen.shared_tokens == n * (len(prompts) - 1)
    assert torch.allclose(plain[0].logits[:, -1], shared[0].logits[:, -1], atol=1e-4)


def test_sampled_log_probs_are_the_models(steered, small_world):
    """Sampling (temperature 0.7, top-p 0.9) through the captured step and prefix sharing: every action token's
    log-prob equals a full forward pass's within 1e-4."""
    model, tok, env = steered
    torch.manual_seed(0)
    gen = HFGenerator(
        model,
        tok,
        env.tags.stop_strings,
        batch_size=6,
        compile=True,
        compile_runner="eager",
        prefix_sharing=True,
    )
    trajs, stats = rollout(
        small_world.examples("test")[:6], env, gen, tok, SamplingParams(0.7, 0.9, 24), 4, 400
    )
    assert stats.tokens_generated > 200
    assert logprob_gap(model, trajs, tok.pad_token_id, 0.7) <= 1e-4


def test_qwen_vocabulary_log_probs_and_greedy_ids(qwen_tok, small_world, world_bm25):
    """A random Qwen2 model with all 151,936 output rows and Qwen2.5's tokenizer (tags are text): greedy ids
    equal the eager batch's; sampled log-probs equal a full forward's within 1e-4."""
    model = qwen_model()
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=2)
    ex = small_world.examples("train")[:4]
    out = []
    for kw in ({}, {"compile": True, "compile_runner": "eager", "prefix_sharing": True}):
        gen = HFGenerator(model, qwen_tok, env.tags.stop_strings, batch_size=3, **kw)
        out.append(rollout(ex, env, gen, qwen_tok, SamplingParams(0.0, 1.0, 12), 2, 200))
    assert_same(out[0][0], out[1][0])
    torch.manual_seed(1)
    gen = HFGenerator(
        model, qwen_tok, env.tags.stop_strings, batch_size=8, compile=True, compile_runner="eager"
    )
    trajs, _ = rollout(ex, env, gen, qwen_tok, SamplingParams(0.7, 1.0, 12), 2, 200)
    assert logprob_gap(model, trajs, qwen_tok.pad_token_id, 0.7) <= 1e-4


def test_lora_policy(tiny_model_dir, small_world, world_bm25):
    """A peft LoRA policy (adapter non-zero): the captured step gives the eager batch's greedy episodes."""
    from peft import LoraConfig, get_peft_model

    model, tok = load_model_and_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    for n, p in lora.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    lora.eval()
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=2)
    ex = small_world.examples("test")[:6]
    out = []
    for kw in ({}, {"compile": True, "compile_runner": "eager"}):
        gen = HFGenerator(lora, tok, env.tags.stop_strings, batch_size=4, **kw)
        out.append(rollout(ex, env, gen, tok, SamplingParams(0.0, 1.0, 16), 2, 300))
    assert_same(out[0][0], out[1][0])


class _Syncs(TorchDispatchMode):
    """Records operators that read a device value on the host or whose output size depends on values: a
    CUDA graph cannot capture them."""

    SYNC = ("_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal", "masked_select", "unique")

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(s in str(func) for s in self.SYNC):
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


def _filled(model, slots=4, cols=64, kv=None, ids=None):
    """Static buffers (``kv``'s, or new ones) with three slots holding the prompts ``ids`` (default: random,
    10 tokens) prefilled by ``model``, each with its next token to feed, the fourth slot free."""
    ids = torch.randint(0, 100, (3, 10)) if ids is None else ids
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    layers = [(x.keys, x.values) for x in out.past_key_values.layers]
    dev = ids.device
    kv = StaticKV([k for k, _ in layers], slots, cols, 0) if kv is None else kv
    kv.place(torch.tensor([0, 1, 2], device=dev), layers, torch.ones(3, 10, dtype=torch.long, device=dev))
    kv.lens[:3] = 10
    kv.live[:3] = True
    kv.tok[:3] = torch.tensor([5, 6, 7], device=dev)
    return kv, ids


@pytest.mark.parametrize("params", [SamplingParams(0.0, 1.0, 8), SamplingParams(0.7, 0.9, 8)])
def test_the_step_never_synchronises_with_the_host(tiny_model_dir, params):
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    kv, _ = _filled(model.eval())
    fn = _step_fn(model, kv, 4, 64, params)
    with torch.no_grad(), _Syncs() as m:
        fn()
    assert m.found == []
    assert kv.lens.tolist() == [11, 11, 11, 0]  # running slots advance, the free one does not


def test_the_step_equals_an_eager_forward_and_reads_weights_changed_in_place(tiny_model_dir):
    """Compiled with inductor (the CPU's runner): the greedy token and its log-prob equal a full forward's,
    before and after the weights are changed in place (an optimizer step, a weight sync) without a new
    capture."""
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    model.eval()
    graphs = DecodeGraphs("compile")
    graphs.attach(model)
    kv, ids = _filled(model)
    graphs.kv = kv
    params = SamplingParams(0.0, 1.0, 8)
    seq = torch.cat([ids, torch.tensor([[5], [6], [7]])], 1)
    for change in range(2):
        with torch.no_grad():
            if change:
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
                _filled(model, kv=kv, ids=ids)  # the prompts prefilled again by the new weights
            ref = torch.log_softmax(model(input_ids=seq).logits[:, -1].float(), -1)
        graphs.run(model, 4, 64, params)
        tok, logp = kv.result[0, :3].long(), kv.result[1, :3]
        assert tok.tolist() == ref.argmax(-1).tolist()
        assert torch.allclose(logp.float(), ref.max(-1).values, atol=1e-4)
    assert graphs.captures == 1  # compiled once: the new weights were read where they lie


def test_compiled_stream_equals_the_eager_batch(steered, small_world):
    """The CPU's runner end to end (inductor, a few buckets): the same greedy episodes."""
    model, tok, env = steered
    ex = small_world.examples("test")[:2]
    params = SamplingParams(0.0, 1.0, 12)
    old, _, _ = episodes(model, tok, env, ex, params, 2)
    new, _, gen = episodes(model, tok, env, ex, params, 2, compile=True)
    assert_same(old, new)
    assert gen._graphs.runner is None and gen._graphs.captures >= 1


def test_graphs_are_dropped_when_the_parameters_move(tiny_model_dir):
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    graphs = DecodeGraphs("eager")
    graphs.attach(model)
    graphs.steps[("x",)] = lambda: None
    graphs.attach(model)
    assert graphs.steps  # same tensors: kept
    model.float().double()  # new storage
    graphs.attach(model)
    assert not graphs.steps


def test_refusals(tiny_model_dir):
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention implementation"):
        check_model(model)
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    with pytest.raises(ValueError, match="sliding-window"):
        check_model(model)
    with pytest.raises(ValueError, match="runner"):
        DecodeGraphs("fast")


def test_bucket():
    assert [bucket(n, 256) for n in (1, 2, 3, 5, 64, 65, 300)] == [1, 2, 4, 8, 64, 128, 256]
    assert bucket(3, 1024, low=64) == 64


def test_capacity_grows_while_requests_run(steered, small_world):
    """A request longer than the buffers' columns, admitted while others run: the buffers grow (contents
    kept, steps captured anew) and the episodes equal the eager batch's."""
    model, tok, env = steered
    ex = small_world.examples("test")[:4]
    params = SamplingParams(0.0, 1.0, 24)
    old, _, _ = episodes(model, tok, env, ex, params, 3)
    gen = HFGenerator(model, tok, env.tags.stop_strings, batch_size=3, compile=True, compile_runner="eager")
    import searchrl.rollout.graph_decode as gd

    first = gd.MIN_COLUMNS
    try:
        gd.MIN_COLUMNS = 16  # start small: the first requests' prompts + budgets need more
        trajs = start_trajectories(env, tok, ex)
        run(trajs, env, gen, tok, params, 400)
    finally:
        gd.MIN_COLUMNS = first
    assert_same(old, trajs)
    assert isinstance(gen._graphs.kv, StaticKV) and gen._graphs.kv.capacity >= 64


def test_stream_close_frees_slots(tiny_model_dir):
    """A stream left with requests running frees their slots: the next stream starts empty."""
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    gen = HFGenerator(model, tok, [], batch_size=4, compile=True, compile_runner="eager")
    gen.eos_ids = set()
    model.generation_config.eos_token_id = None
    with gen.stream(SamplingParams(0.0, 1.0, 24)) as s:
        assert isinstance(s, GraphStream)
        for i in range(3):
            s.add(i, [5, 6, 7, 8])
        s.step()
        s.step()
        assert s.running == 3 and gen._graphs.kv.live.tolist() == [True, True, True, False]
    assert not bool(gen._graphs.kv.live.any())


FAST = ("rollout.compile=true", "rollout.prefix_sharing=true", "rollout.backend_args={compile_runner: eager}")


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_asynchronous_training_through_the_captured_step(make_exp, agent_model_dir, tmp_path, worker):
    """GRPO at max_staleness 1 with the worker as a thread or a process, decoding through the captured step
    with prefix sharing: three steps train, every shipped weight reaches the worker's copy (its graphs read
    them in place), and step 1's sampled log-probs equal the trainer's to rounding."""
    from tests.rollout.test_async_rollout import async_trainer, check_shipped_weights

    extra = {"worker": "process", "worker_threads": 1} if worker == "process" else {}
    tr = async_trainer(make_exp, agent_model_dir, tmp_path, *FAST, **extra)
    assert tr.ctx.generator._graphs is not None and tr.ctx.generator.prefix_sharing
    tr.run()
    rows = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    check_shipped_weights(rows)


def test_synchronous_training_through_the_captured_step(make_exp, agent_model_dir, tmp_path):
    from searchrl.core.config import TrainerConfig
    from tests.engine.test_trainer import trainer_for

    exp = make_exp(f"model.path={agent_model_dir}", "rollout.temperature=1.0", *FAST)
    cfg = TrainerConfig(steps=2, batch_size=2, micro_batch_size=8, lr=1e-3, save_every=10**6)
    tr = trainer_for(exp, "grpo", cfg, args={"group_size": 4}, out=tmp_path / "s")
    tr.run()
    gen = tr.ctx.generator
    assert gen._graphs.captures > 0 and gen.shared_tokens > 0
    rows = read_metrics(tmp_path / "s" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]


def test_warmup_captures_every_bucket_once(tiny_model_dir, monkeypatch, capsys):
    """With CUDA graphs every (slots, columns) bucket is captured at the run's first step, once per sampling
    setting, and said (here `_make` is a stand-in: no GPU)."""
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    graphs = DecodeGraphs("graph", columns=100)
    made = []
    monkeypatch.setattr(graphs, "_make", lambda m, r, c, p: made.append((r, c)) or (lambda: None))
    ids = torch.randint(0, 100, (3, 10))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    kv = graphs.buffers([x.keys for x in out.past_key_values.layers], 5, 20, 0)
    assert kv.capacity == 128  # the columns asked for up front, not the 20 needed now
    for _ in range(2):
        graphs.warmup(model, SamplingParams(0.7, 1.0, 8))
    assert sorted(made) == [(r, c) for r in (1, 2, 4, 5) for c in (64, 128)]
    graphs.warmup(model, SamplingParams(0.0, 1.0, 8))  # greedy: its own graphs
    assert len(made) == 16 and graphs.captures == 16
    assert "captured 8 decode graphs (slots 1-5, columns 64-128" in capsys.readouterr().err
