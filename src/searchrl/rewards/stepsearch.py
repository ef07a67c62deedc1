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
documents come from the example's decomposition (``hops[i].gold_doc_id``, else ``gold_doc_ids``). Where the
paper is silent or its code differs, the paper is the default: answer F1 (eq. 2) and search-key F1 (eq. 4)
are plain word F1 of normalised text (no HotpotQA yes/no rule); a broken format scores 0.

``public_code_compat: true`` computes the reward exactly as StepSearch's public code does (Zillwang/StepSearch:
``verl/utils/reward_score/qa_step.py`` and the reward manager in ``verl/trainer/main_ppo.py``), from the
decoded transcript, malformed episodes included; `stepsearch_public` lists every difference. Its parser
splits documents on StepSearch's own format, so use ``env.doc_format: stepsearch`` with it. Its defaults are
the code's: γ_key 0.618 and a step scale of 0.6 added on top of the unscaled step score (1.6×).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from searchrl.core.answers import normalize_answer, plain_f1, word_f1
from searchrl.core.records import Doc, Hop
from searchrl.rewards.contract import RewardOutput
from searchrl.rewards.research import cut_at_stop, research_format_ok, response_text

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


def search_key_reward(queries: Sequence[str], hops: Sequence[Hop]) -> float:
    """Eq. 4-5: the mean over sub-questions with gold keys of max_j max_t F1(q_t, k_ij)."""
    groups = [h.keys for h in hops if h.keys]
    if not groups or not queries:
        return 0.0
    return sum(max(word_f1(q, k) for k in keys for q in queries) for keys in groups) / len(groups)


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
    gamma_key: float | None = None,
    step_coef: float | None = None,
    answer: bool = True,
    search_key: bool = True,
    information_gain: bool = True,
    redundancy_penalty: bool = True,
    public_code_compat: bool = False,
    info_tag: str = "information",
) -> RewardOutput:
    """r_overall as the score, and step_coef · (G^t − P^t) for every search step (0 for other steps).
    ``gamma_key`` / ``step_coef`` default to 0.1 / 1.0, or to the public code's 0.618 / 0.6 (applied as
    1.6×) with ``public_code_compat``."""
    if public_code_compat:
        return stepsearch_public(
            traj,
            answers=answers,
            hops=hops,
            example=example,
            docs=docs,
            gamma_key=0.618 if gamma_key is None else gamma_key,
            step_scale=0.6 if step_coef is None else step_coef,
            answer=answer,
            search_key=search_key,
            information_gain=information_gain,
            redundancy_penalty=redundancy_penalty,
        )
    gamma_key = 0.1 if gamma_key is None else gamma_key
    step_coef = 1.0 if step_coef is None else step_coef
    st = traj.state
    n_steps = len(traj.steps)
    search_steps = [i for i, info in enumerate(st.infos) if info.kind == "search" and info.valid]
    queries = [st.infos[i].query or "" for i in search_steps]
    rounds = [st.retrieved[i] for i in search_steps]
    fmt = stepsearch_format_ok(traj, info_tag)
    r_answer = plain_f1(st.answer, answers) if fmt and st.answer is not None else 0.0
    r_key = search_key_reward(queries, hops) if fmt else 0.0
    gains = [0.0] * len(rounds)
    if information_gain and rounds:
        gains = information_gains(
            [[d.contents for d in r] for r in rounds],
            gold_texts(hops, example, docs),
            corpus_tfidf(_need_docs(docs)),
        )
    penalties = redundancy_penalties([[d.id for d in r] for r in rounds])
    step_of = {id(s.info): k for k, s in enumerate(traj.steps)}  # env step -> trajectory step (same info)
    step_scores = [0.0] * n_steps
    for k, i in enumerate(search_steps):
        g = gains[k] if information_gain else 0.0
        p = penalties[k] if redundancy_penalty else 0.0
        if fmt and id(st.infos[i]) in step_of:
            step_scores[step_of[id(st.infos[i])]] = step_coef * (g - p)
    score = (r_answer if answer else 0.0) + (gamma_key * r_key if search_key else 0.0)
    redundant = sum(p == 1.0 for p in penalties)
    return RewardOutput(
        score,
        tuple(step_scores),
        metrics={
            "answer_f1": r_answer,
            "key": r_key,
            "format_ok": float(fmt),
            "gain": sum(gains) / max(len(gains), 1),
            "redundancy": sum(penalties) / max(len(penalties), 1),
            "redundant_searches": float(redundant),
            "searches": float(len(rounds)),
        },
    )


def _need_docs(docs: Mapping[str, Doc] | None) -> Mapping[str, Doc]:
    if docs is None:
        raise ValueError("the stepsearch information gain needs the corpus (`docs`) to read gold documents")
    return docs


def gold_texts(
    hops: Sequence[Hop], example: Any, docs: Mapping[str, Doc] | None, with_title: bool = True
) -> list[str]:
    """The gold documents' texts: from the decomposition's gold ids, else the example's gold ids."""
    ids = [h.gold_doc_id for h in hops if h.gold_doc_id] or list(example.gold_doc_ids)
    found = [_need_docs(docs)[g] for g in ids if g in _need_docs(docs)]
    return [d.contents if with_title else d.text for d in found]


# ----------------------------------------------------------------------------------------- public code
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_SEARCH = re.compile(r"<search>.*?</search>", re.S)
_SEARCH_INFO = re.compile(r"<search>.*?</search>\s*<information>(.*?)</information>", re.S)
_SK_TOKEN = re.compile(r"(?u)\b\w\w+\b")  # scikit-learn's TfidfVectorizer tokens: 2+ word characters


def rounded_f1(prediction: str | None, golds: Sequence[str]) -> float:
    """The public code's F1: normalised words, no yes/no rule, max over golds, rounded to 4 decimals."""
    return 0.0 if prediction is None else round(plain_f1(prediction, golds), 4)


def pairwise_tfidf_cosines(text: str, golds: Sequence[str]) -> list[float]:
    """Cosine of ``text`` to each of ``golds`` under TF-IDF fitted on [text] + golds alone, with
    scikit-learn's default `TfidfVectorizer` (lower-case, tokens of 2+ word characters, raw counts, smoothed
    idf ln((1+n)/(1+df)) + 1, L2 norm): the public code fits one per retrieved document."""
    if text == "":
        return [0.0] * len(golds)
    docs = [Counter(_SK_TOKEN.findall(t.lower())) for t in [text, *golds]]
    df: Counter[str] = Counter(w for d in docs for w in d)
    n = len(docs)
    vecs = []
    for d in docs:
        v = {w: c * (math.log((1 + n) / (1 + df[w])) + 1.0) for w, c in d.items()}
        norm = math.sqrt(sum(x * x for x in v.values()))
        vecs.append({w: x / norm for w, x in v.items()} if norm > 0 else {})
    return [max(TfIdf.cosine(vecs[0], g), 0.0) for g in vecs[1:]]


def search_keys_public(queries: Sequence[str], groups: Sequence[Sequence[str]]) -> float:
    """The public search-key score: each query is assigned to the one key group it matches best (the first
    group with the highest rounded F1, none when every F1 is 0), that group's score is *overwritten* with
    it, and the scores are averaged over all groups."""
    if not queries or not groups:
        return 0.0
    scores = [0.0] * len(groups)
    for q in queries:
        best, best_group = 0.0, None
        for g, keys in enumerate(groups):
            f = rounded_f1(q, list(keys))
            if f > best:
                best, best_group = f, g
        if best_group is not None:
            scores[best_group] = best
    return sum(scores) / len(groups)


def split_documents(block: str) -> list[str]:
    """The public parser's documents of one information block: the text after each ``##>`` up to the next
    ``<##`` — which keeps the next document's ``Doc k`` label, so one document repeated at another rank
    reads as a different one."""
    return [part.split("<##")[0].strip() for part in block.strip().split("##>")[1:]]


def stepsearch_public(
    traj: Any,
    *,
    answers: Sequence[str],
    hops: Sequence[Hop],
    example: Any,
    docs: Mapping[str, Doc] | None,
    gamma_key: float,
    step_scale: float,
    answer: bool = True,
    search_key: bool = True,
    information_gain: bool = True,
    redundancy_penalty: bool = True,
) -> RewardOutput:
    """StepSearch's reward as its public code computes it. Differences from the paper (`stepsearch_reward`):

    - the text scored is the decoded transcript (after the chat template's last ``<|im_start|>assistant``
      when there is one, else including the prompt); actions are cut at their first closing tag;
    - format gate: the text must end with an ``<answer>…</answer>`` block (anything else: -1 and no step
      rewards); nothing else is checked — two answer blocks, no search, no think are all scored normally;
    - answer: the last answer block's F1, normalised, no yes/no rule, rounded to 4 decimals;
    - search-key score: `search_keys_public` (best-group assignment, overwritten) averaged over every hop's
      key group, empty groups included, weight γ_key = 0.618;
    - information gain: documents are cut out of each ``<search>…</search> <information>…</information>``
      pair by `split_documents`, normalised, and compared by `pairwise_tfidf_cosines` with the gold
      documents' normalised texts, titles excluded;
    - redundancy: a document counts as seen when its cut-out text was seen, in an earlier round or earlier in
      the same round; each repeat adds 1/k;
    - step rewards land on the search whose ``</search>`` ends each pair of the response (without the
      prompt), paired with the step scores by index, and are added at (1 + step_scale)× (the code scales
      the step row in place and adds it to itself: 1.6× with its 0.6).
    """
    st = traj.state
    response = response_text(traj, cut=True)
    text = st.prompt + response
    marker = "<|im_start|>assistant"
    solution = text.split(marker)[-1].strip() if marker in text else text
    matches = list(_ANSWER.finditer(solution))
    predicted = matches[-1].group(1).strip() if matches else None
    answer_f1 = rounded_f1(predicted, answers)
    n_steps = len(traj.steps)
    metrics = {"answer_f1": answer_f1, "format_ok": 0.0}
    if not matches or solution[matches[-1].end() :].strip():
        return RewardOutput(-1.0, tuple([0.0] * n_steps), metrics=metrics)
    blocks = list(_SEARCH_INFO.finditer(solution))
    rounds = [split_documents(m.group(1)) for m in blocks]
    gold = [
        normalize_answer(g) for g in (gold_texts(hops, example, docs, with_title=False) if rounds else [])
    ]
    gains, penalties = _public_rounds(rounds, gold)
    step_values = [
        (g if information_gain else 0.0) - (p if redundancy_penalty else 0.0)
        for g, p in zip(gains, penalties)
    ]
    queries = [re.sub(r"</?search>", "", q).strip() for q in _SEARCH.findall(solution)]
    # every hop's group, an empty one included: the public code averages over all of them, so a hop without
    # keys (never matched) halves a two-hop score where the paper's eq. (5) averages over the keyed hops only
    groups = [list(h.keys) for h in hops]
    key = search_keys_public(queries, groups)
    score = (answer_f1 if answer else 0.0) + (gamma_key * key if search_key else 0.0)
    # the reward manager finds the positions again in the response alone (no prompt) and pairs them with the
    # step scores by index: each pair's `</search>` falls in one action, whose step carries the score
    ends = [
        m.start() + m.group().find("</search>") + len("</search>") for m in _SEARCH_INFO.finditer(response)
    ]
    step_scores = [0.0] * n_steps
    for end, v in zip(ends, step_values):
        k = _step_at(traj, len(st.prompt) + end)
        if k is not None:
            step_scores[k] += (1.0 + step_scale) * v
    metrics.update(
        format_ok=1.0,
        key=key,
        gain=sum(gains) / max(len(gains), 1),
        redundancy=sum(penalties) / max(len(penalties), 1),
        searches=float(len(rounds)),
    )
    return RewardOutput(score, tuple(step_scores), metrics=metrics)


def _public_rounds(rounds: list[list[str]], gold: list[str]) -> tuple[list[float], list[float]]:
    """The public code's information gain and redundancy penalty of each search round (its documents' cut-out,
    normalised texts against the gold documents'): the mean over gold documents of the best TF-IDF cosine's
    rise, and 1/k for each document whose text was seen before, earlier in the round included."""
    gains, penalties = [], []
    seen_by_text: set[str] = set()
    best = [0.0] * len(gold)
    for round_docs in rounds:
        if gold:
            current = [0.0] * len(gold)
            for d in round_docs:
                for i, c in enumerate(pairwise_tfidf_cosines(normalize_answer(d), gold)):
                    current[i] = max(current[i], c)
            gains.append(sum(max(c - b, 0.0) for c, b in zip(current, best)) / len(gold))
            best = [max(c, b) for c, b in zip(current, best)]
        penalty = 0.0
        for d in round_docs:
            if d in seen_by_text:
                penalty += 1 / len(round_docs)
            else:
                seen_by_text.add(d)
        penalties.append(penalty)
    return gains, penalties


def _step_at(traj: Any, char_end: int) -> int | None:
    """The trajectory step whose (cut) action covers the character just before ``char_end`` of the
    transcript (prompt + cut actions + observations), else the last step before it."""
    st = traj.state
    step_of = {id(s.info): k for k, s in enumerate(traj.steps)}
    pos, last = len(st.prompt), None
    for action, obs, info in zip(st.actions, st.observations, st.infos):
        if pos >= char_end:
            break
        k = step_of.get(id(info))
        last = k if k is not None else last
        pos += len(cut_at_stop(action))
        if char_end <= pos:
            return last
        pos += len(obs)
    return last
