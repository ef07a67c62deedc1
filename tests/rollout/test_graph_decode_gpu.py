"""The captured decode step as CUDA graphs (``rollout.compile`` on a GPU): run by `benchmarks/gpu_session.sh
decode` on a lent GPU, never in CPU CI. Float32 (matrix products without TF32), a random model at Qwen2.5's
real vocabulary: greedy episodes equal the eager continuous batch's, sampled log-probs are the model's within
1e-4, and weights changed in place are read by the next replay without a new capture."""

from __future__ import annotations

import pytest
import torch

from searchrl.envs.search import SearchEnv
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.graph_decode import DecodeGraphs
from searchrl.rollout.hf import HFGenerator
from searchrl.rollout.loop import rollout

from ..helpers import gpu_only, qwen_model
from .test_agent_loop import assert_same
from .test_graph_decode import _filled
from .test_text_tags import logprob_gap

pytestmark = gpu_only()


@pytest.mark.parametrize("batch_size", [3, 16])
def test_graphs_give_the_eager_batchs_greedy_episodes(qwen_tok, small_world, world_bm25, batch_size):
    model = qwen_model().cuda()
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=2)
    ex = small_world.examples("train")[:8]
    out = []
    for kw in ({}, {"compile": True, "prefix_sharing": True}):
        gen = HFGenerator(model, qwen_tok, env.tags.stop_strings, batch_size=batch_size, **kw)
        out.append((rollout(ex, env, gen, qwen_tok, SamplingParams(0.0, 1.0, 24), 2, 300), gen))
    assert_same(out[0][0][0], out[1][0][0])
    graphs = out[1][1]._graphs
    assert graphs.runner is None and graphs._pool is not None and graphs.captures >= 1  # CUDA graphs ran


def test_graph_sampled_log_probs_are_the_models(qwen_tok, small_world, world_bm25):
    model = qwen_model().cuda()
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=2)
    torch.manual_seed(1)
    gen = HFGenerator(model, qwen_tok, env.tags.stop_strings, batch_size=8, compile=True)
    trajs, stats = rollout(
        small_world.examples("train")[:8], env, gen, qwen_tok, SamplingParams(0.7, 0.9, 24), 4, 300
    )
    assert stats.tokens_generated > 300
    assert logprob_gap(model.cpu(), trajs, qwen_tok.pad_token_id, 0.7) <= 1e-4  # the full pass on the CPU


def test_a_replay_reads_weights_changed_in_place():
    model = qwen_model().cuda()
    graphs = DecodeGraphs("graph")
    graphs.attach(model)
    ids = torch.randint(0, 1000, (3, 10), device="cuda")
    kv, _ = _filled(model, ids=ids)
    graphs.kv = kv
    params = SamplingParams(0.0, 1.0, 8)
    seq = torch.cat([ids, torch.tensor([[5], [6], [7]], device="cuda")], 1)
    for change in range(2):
        with torch.no_grad():
            if change:
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
                _filled(model, kv=kv, ids=ids)
            ref = torch.log_softmax(model(input_ids=seq).logits[:, -1].float(), -1)
        graphs.run(model, 4, 64, params)
        torch.cuda.synchronize()
        assert kv.result[0, :3].long().tolist() == ref.argmax(-1).tolist()
        assert torch.allclose(kv.result[1, :3].float(), ref.max(-1).values, atol=1e-4)
    assert graphs.captures == 1
