"""Instruct prompts through the tokenizer's chat template (Qwen2.5's): one system + user turn, the assistant
turn opened, and the whole episode inside that one assistant turn."""

import pytest

from searchrl.core.errors import ConfigError
from searchrl.envs.search import SearchEnv
from searchrl.envs.tags import RESEARCH_SYSTEM, TEMPLATES


def chat_of(tok):
    return lambda messages: tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_research_instruct_is_the_system_turn_and_the_question_the_user_turn(
    qwen_tok, world_bm25, small_world
):
    env = SearchEnv(world_bm25, tags="research", template="research_instruct", chat=chat_of(qwen_tok))
    ex = small_world.examples("train")[0]
    prompt = env.reset(ex).prompt
    assert prompt == (
        f"<|im_start|>system\n{RESEARCH_SYSTEM}<|im_end|>\n<|im_start|>user\n{ex.question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "\\boxed{answer here}" in prompt


def test_search_r1_instruct_is_its_prompt_as_the_user_turn_under_the_default_system(
    qwen_tok, world_bm25, small_world
):
    env = SearchEnv(world_bm25, template="search_r1_instruct", chat=chat_of(qwen_tok))
    ex = small_world.examples("train")[0]
    prompt = env.reset(ex).prompt
    user = TEMPLATES["search_r1"].format(question=ex.question).rstrip("\n")
    assert prompt.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert prompt.endswith(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def test_an_episode_stays_in_one_assistant_turn(qwen_tok, world_bm25, small_world):
    env = SearchEnv(world_bm25, template="short_chat", topk=1, chat=chat_of(qwen_tok))
    st = env.reset(small_world.examples("train")[0])
    env.step(st, "<think> x </think>\n<search> Zelka </search>", stopped=True)
    env.step(st, "<think> y </think>\n<answer> z </answer>", stopped=True)
    text = st.text()
    assert text.count("<|im_start|>assistant\n") == 1 and text.endswith("</answer>")
    assert "<|im_start|>" not in "".join(st.observations) and "<information>" in st.observations[0]


def test_a_chat_template_needs_a_tokenizer_that_has_one(make_exp, world_bm25):
    with pytest.raises(ValueError, match="chat template"):
        SearchEnv(world_bm25, template="research_instruct")
    from searchrl.app.resources import Resources

    exp = make_exp("env.template=research_instruct", "model.path=null")
    with pytest.raises(ConfigError, match="the local tokenizer has none"):
        Resources(exp).env()
