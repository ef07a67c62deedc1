"""Evaluation metrics: hop counts are reported only where the data has a decomposition."""

import json

from searchrl.app.eval_episodes import episode_metrics, write_results
from searchrl.core.records import Example, Hop
from searchrl.core.types import EnvState, StepInfo


def finished(ex: Example, answer: str) -> EnvState:
    st = EnvState(example=ex, prompt="q")
    st.infos.append(StepInfo(kind="answer", valid=True, answer=answer))
    st.done, st.finish_reason = True, "answer"
    return st


def test_em_by_hops_says_unknown_without_a_decomposition(tmp_path):
    hop = Hop(question="x?", answer="y")
    two = Example(id="a", question="q", answers=("Paris",), hops=(hop, hop))
    flat = Example(id="b", question="q", answers=("Rome",))  # HotpotQA / FlashRAG rows carry no hops
    m = episode_metrics([finished(two, "Paris"), finished(flat, "Rome"), finished(flat, "Oslo")])
    assert m["em_by_hops"] == {"2": 1.0, "unknown": 0.5}  # no invented hop 0
    js, _ = write_results(tmp_path, "r", m)
    assert json.loads(js.read_text())["em_by_hops"] == {"2": 1.0, "unknown": 0.5}
