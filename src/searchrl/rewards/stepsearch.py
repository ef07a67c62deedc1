"""StepSearch's rewards (Wang et al., 2025, §2.3, equations 2-13), as one process reward.

Global reward, placed at the last action token (eq. 6):

    r_overall = r_answer + γ_key · r_key
    r_answer  = F1(a_pred, a_gt) if the format is valid else 0                                  (eq. 2-3)
    r_key     = 1/M Σ_i max_j max_t F1(q_t, k_ij)   over the M sub-questions with gold keys     (eq. 4-5)

Step reward of each search round t, placed at that round's last action token (eq. 7):

    r_step^t = G^t − P^t
    c_i^t = max_j cos(d_i^g, d_j^r(t))   TF-IDF cosine to each of the n gold documents           (eq. 8)
    G^t   = 1/n Σ_i max(c_i^t − m_i^{t−1}, 0),   m_i^t = max(m_i^{t−1}, c_i^t),  m^0 = 0        (eq. 9-11)
    P^t   = 1/k Σ_j 1(d_j^r(t) ∈ H^{t−1}),       H^t = H^{t−1} ∪ D^r(t),         H^0 = ∅        (eq. 12-13)

The format is a hard constraint (§2.3.1): searches in <search> pairs, at least one round of think and
search, exactly one <answer> pair, at the end. An episode that breaks it scores 0 everywhere (global and
step rewards). Each term has a switch for the paper's ablations (§4.2): ``information_gain: false``
(w/o ig), ``redundancy_penalty: false`` (w/o rp), both false (only the search-key reward, ow-skr),
``search_key: false`` (only the step score, ow-ss).

The paper does not give γ_key or a step-reward scale; ``gamma_key`` (0.1) and ``step_coef`` (1.0, eq. 7
unscaled) are our defaults. TF-IDF weights are fitted once on the retrieval corpus (``docs``); gold
documents come from the example's decomposition (``hops[i].gold_doc_id``, else ``gold_doc_ids``).

``public_code_compat: true`` reproduces two behaviours of the public StepSearch code that differ from
the paper, for comparisons with its published numbers:

1. the step reward is added at (1 + step_coef)× instead of step_coef× (the code scales a row in place and
   then adds it on top of the unscaled one; with its configured 0.6 the effective weight is 1.6);
2. the search-key score keeps, per sub-question, the score of the *latest* query instead of the maximum
   over queries (the per-group score is overwritten by each new round).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from searchrl.answers import f1_score, word_f1
from searchrl.data.corpus import Doc
from searchrl.data.example import Hop
from searchrl.rewards.registry import RewardOutput
from searchrl.rewards.research import research_format_ok, response_text

_WORD = re.compile(r"\w+")


class TfIdf:
    """Sparse TF-IDF vectors (raw term counts × smoothed idf, L2-normalised), idf fitted on a corpus."""

    def __init__(self, texts: Sequence[str]) -> None:
        df: Counter[str] = Counter()
        for t in texts:
            df.update(set(_WORD.findall(t.lower())))
        n = len(texts)
        self.idf = {w: math.log((1 + n) / (1 + c)) + 1.0 for w, c in df.items()}
        self.unseen_idf = math.log(1 + n) + 1.0

    def vector(self, text: str) -> dict[str, float]:
        tf = Counter(_WORD.findall(text.lower()))
        v = {w: c * self.idf.get(w, self.unseen_idf) for w, c in tf.items()}
        norm = math.sqrt(sum(x * x for x in v.values()))
        return {w: x / norm for w, x in v.items()} if norm > 0 else {}

    @staticmethod
    def cosine(a: Mapping[str, float], b: Mapping[str, float]) -> float:
        if len(a) > len(b):
            a, b = b, a
        return sum(x * b.get(w, 0.0) for w, x in a.items())


_TFIDF: dict[int, tuple[Any, TfIdf]] = {}


def corpus_tfidf(docs: Mapping[str, Doc]) -> TfIdf:
    """One fitted `TfIdf` per corpus mapping (kept alive with it, so its id is not reused)."""
    key = id(docs)
    if key not in _TFIDF:
        _TFIDF[key] = (docs, TfIdf([d.contents for d in docs.values()]))
    return _TFIDF[key][1]


def search_key_reward(queries: Sequence[str], hops: Sequence[Hop], latest_only: bool = False) -> float:
    """Eq. 4-5: the mean over sub-questions with gold keys of max_j max_t F1(q_t, k_ij).
    ``latest_only`` (public-code behaviour): the last query's score per sub-question instead of the max."""
    groups = [h.keys for h in hops if h.keys]
    if not groups or not queries:
        return 0.0
    scored = queries[-1:] if latest_only else queries
    return sum(max(word_f1(q, k) for k in keys for q in scored) for keys in groups) / len(groups)


def information_gains(rounds: Sequence[Sequence[str]], gold: Sequence[str], tfidf: TfIdf) -> list[float]:
    """Eq. 8-11: G^t for each round's retrieved texts against the gold texts, with the memory vector."""
    if not gold:
        return [0.0] * len(rounds)
    gold_v = [tfidf.vector(g) for g in gold]
    memory = [0.0] * len(gold)
    out = []
    for texts in rounds:
        vecs = [tfidf.vector(t) for t in texts]
        c = [max((TfIdf.cosine(g, v) for v in vecs), default=0.0) for g in gold_v]
        out.append(sum(max(ci - mi, 0.0) for ci, mi in zip(c, memory)) / len(gold))
        memory = [max(mi, ci) for mi, ci in zip(memory, c)]
    return out


def redundancy_penalties(rounds: Sequence[Sequence[str]]) -> list[float]:
    """Eq. 12-13: P^t, the share of round t's documents already retrieved in an earlier round."""
    history: set[str] = set()
    out = []
    for ids in rounds:
        out.append(sum(d in history for d in ids) / len(ids) if ids else 0.0)
        history.update(ids)
    return out


def stepsearch_format_ok(traj: Any, info_tag: str = "information") -> bool:
    """§2.3.1: the tag structure is valid, with at least one <think> and one valid search."""
    st = traj.state
    text = response_text(traj)
    searched = any(i.kind == "search" and i.valid for i in st.infos)
    return searched and "<think>" in text and research_format_ok(text, info_tag, boxed=False)


def stepsearch_reward(
    traj: Any,
    *,
    answers: Sequence[str],
    hops: Sequence[Hop],
    example: Any,
    docs: Mapping[str, Doc] | None = None,
    gamma_key: float = 0.1,
    step_coef: float = 1.0,
    answer: bool = True,
    search_key: bool = True,
    information_gain: bool = True,
    redundancy_penalty: bool = True,
    public_code_compat: bool = False,
    info_tag: str = "information",
) -> RewardOutput:
    """r_overall as the score, and step_coef · (G^t − P^t) for every search step (0 for other steps)."""
    st = traj.state
    n_steps = len(traj.steps)
    search_steps = [i for i, info in enumerate(st.infos) if info.kind == "search" and info.valid]
    queries = [st.infos[i].query or "" for i in search_steps]
    rounds = [st.retrieved[i] for i in search_steps]
    fmt = stepsearch_format_ok(traj, info_tag)
    r_answer = f1_score(st.answer, answers) if fmt and st.answer is not None else 0.0
    r_key = search_key_reward(queries, hops, latest_only=public_code_compat) if fmt else 0.0
    gains = [0.0] * len(rounds)
    if information_gain and rounds:
        if docs is None:
            raise ValueError(
                "the stepsearch information gain needs the corpus (`docs`) to read gold documents"
            )
        gold_ids = [h.gold_doc_id for h in hops if h.gold_doc_id] or list(example.gold_doc_ids)
        gold = [docs[g].contents for g in gold_ids if g in docs]
        gains = information_gains([[d.contents for d in r] for r in rounds], gold, corpus_tfidf(docs))
    penalties = redundancy_penalties([[d.id for d in r] for r in rounds])
    scale = (1.0 + step_coef) if public_code_compat else step_coef
    step_of = {id(s.info): k for k, s in enumerate(traj.steps)}  # env step -> trajectory step (same info)
    step_scores = [0.0] * n_steps
    for k, i in enumerate(search_steps):
        g = gains[k] if information_gain else 0.0
        p = penalties[k] if redundancy_penalty else 0.0
        if fmt and id(st.infos[i]) in step_of:
            step_scores[step_of[id(st.infos[i])]] = scale * (g - p)
    score = (r_answer if answer else 0.0) + (gamma_key * r_key if search_key else 0.0)
    redundant = sum(p == 1.0 for p in penalties)
    return RewardOutput(
        score,
        tuple(step_scores),
        metrics={"answer_f1": r_answer, "key": r_key, "format_ok": float(fmt),
                 "gain": sum(gains) / max(len(gains), 1), "redundancy": sum(penalties) / max(len(penalties), 1),
                 "redundant_searches": float(redundant), "searches": float(len(rounds))},
    )  # fmt: skip
