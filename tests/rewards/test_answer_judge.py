"""Answer judges: verdict parsing, the judge and generation-accuracy rewards (batched, through the reward
pipeline) against a scripted OpenAI-compatible server, failures counted, evaluation's judge columns, and
`validate` naming a bad argument."""

import re
import threading
from http.server import ThreadingHTTPServer

import pytest

from searchrl.core.config import RewardSpec
from searchrl.core.records import Example
from searchrl.core.types import Segment, Trajectory
from searchrl.envs.search import SearchEnv
from searchrl.rewards.answer_judge import AnswerJudge, judge_accuracy, parse_verdict
from searchrl.rewards.pipeline import RewardPipeline
from tests.helpers import JSONHandler


@pytest.mark.parametrize(
    "reply, verdict",
    [
        ("<verdict>correct</verdict>", True),
        ("thinking... <verdict> Incorrect </verdict>", False),
        ("<verdict>incorrect</verdict> no wait <verdict>correct</verdict>", True),
        ("Correct.", True),
        ("incorrect", False),
        ("It is correct or incorrect", None),  # two bare words: no verdict
        ("The answer is correct because", None),  # a sentence, not a verdict
        ("", None),
        (None, None),
    ],
)
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply) is verdict


ALIASES = {"obama": "barack obama", "44th president": "barack obama"}


class Grader(JSONHandler):
    """Correct when the prediction, lower-cased, is a gold answer or an alias of one; "maybe" for a prediction
    containing "unsure" (a reply without a verdict)."""

    seen: list

    def do_POST(self):
        prompt = self.read_json()["messages"][-1]["content"]
        gold = re.search(r"Gold answer\(s\): (.*)", prompt).group(1).lower().split(" | ")
        pred = re.search(r"Predicted answer: (.*)", prompt).group(1).lower().strip()
        self.seen.append(pred)
        if "unsure" in pred:
            content = "maybe"
        else:
            ok = pred in gold or ALIASES.get(pred) in gold
            content = f"<verdict>{'correct' if ok else 'incorrect'}</verdict>"
        self.reply(200, {"choices": [{"message": {"role": "assistant", "content": content}}]})


@pytest.fixture
def grader():
    seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (Grader,), {"seen": seen}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    server.shutdown()
    server.server_close()


EX = Example(id="q", question="Who was the 44th US president?", answers=("Barack Obama",))


class NoDocs:
    def search(self, queries, k):
        return [[] for _ in queries]


def answered(text):
    env = SearchEnv(NoDocs(), template="short")
    state = env.reset(EX)
    if text is not None:
        env.step(state, f"<answer> {text} </answer>")
    else:
        env.step(state, "nothing", eos=True)
    return Trajectory(EX, [Segment("prompt", [1])], state=state)


PREDICTIONS = ["Barack Obama", "Obama", "president Barack Obama", "George Bush", "unsure", None]
# hand-computed: EM, cover EM (gold inside the prediction), the grader's verdict
EM = [1, 0, 0, 0, 0, 0]
COVER = [1, 0, 1, 0, 0, 0]
JUDGE = [
    1,
    1,
    0,
    0,
    0,
    0,
]  # "president barack obama" is not in the grader's list; "unsure" fails; None: no ask


def test_judge_and_gen_acc_rewards_through_the_pipeline(grader):
    url, seen = grader
    trajs = [answered(p) for p in PREDICTIONS]
    args = {"backend": "openai", "url": url, "model": "m", "api_key_env": None, "retries": 0}
    pipe = RewardPipeline([RewardSpec("judge", args=args)])
    metrics = pipe(trajs)
    assert [t.reward for t in trajs] == JUDGE
    assert sorted(seen) == sorted(p.lower() for p in PREDICTIONS if p)  # no answer: never sent
    assert float(metrics["reward/judge/failed"]) == pytest.approx(1 / 6)  # "maybe" has no verdict
    seen.clear()
    pipe = RewardPipeline([RewardSpec("gen_acc", args=args)])
    pipe(trajs)
    assert [t.reward for t in trajs] == [max(c, j) for c, j in zip(COVER, JUDGE)]  # s3: cover EM or the judge
    # cover EM decided the first and third: only the others were asked
    assert sorted(seen) == sorted(["obama", "george bush", "unsure"])


def test_the_pipeline_builds_a_batched_reward_once(grader):
    url, seen = grader
    pipe = RewardPipeline([RewardSpec("judge", args={"url": url, "model": "m", "api_key_env": None})])
    pipe([answered("Obama")])
    judge = pipe._batched[0]
    pipe([answered("Obama")])
    assert pipe._batched[0] is judge and len(seen) == 2


def test_judge_accuracy_columns(grader):
    url, _ = grader
    judge = AnswerJudge(url=url, model="m", api_key_env=None, retries=0)
    items = [(EX.question, EX.answers, p) for p in PREDICTIONS]
    m = judge_accuracy(judge, items)
    n = len(PREDICTIONS)
    assert m["judge_acc"] == pytest.approx(sum(JUDGE) / n)
    assert m["gen_acc"] == pytest.approx(sum(max(c, j) for c, j in zip(COVER, JUDGE)) / n)
    assert m["judge_failures"] == pytest.approx(1 / n)
    assert m["judge_em_agreement"] == pytest.approx(sum(e == j for e, j in zip(EM, JUDGE)) / n)


def test_an_unreachable_judge_scores_zero_and_counts():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = AnswerJudge(url=f"http://127.0.0.1:{port}/v1", model="m", timeout=1, retries=0)
    assert judge([(EX.question, EX.answers, "Obama")]) == [None]
    assert judge.client.counter.failures == 1


def test_validate_names_a_bad_judge_argument(tmp_path):
    from searchrl.app.experiment import check_arguments, load_experiment
    from searchrl.core.errors import ConfigError

    base = "name: j\nrewards: [{name: em}]\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text(base.replace("{name: em}", "{name: judge, args: {modle: x}}"))
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.args\.modle") as err:
        check_arguments(load_experiment(bad), str(bad))
    assert "model" in str(err.value)
    bad.write_text(base + "eval: {judge: {urll: x}}\n")
    with pytest.raises(ConfigError, match=r"eval\.judge\.urll"):
        check_arguments(load_experiment(bad), str(bad))
