"""Answer normalisation and metrics (SQuAD / HotpotQA official scripts), max over gold answers."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)
_NO_F1 = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, collapse white space (SQuAD v1.1)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(gold: str | Sequence[str]) -> list[str]:
    return [gold] if isinstance(gold, str) else list(gold)


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(gold)))


def sub_exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """1 if some normalised gold answer occurs inside the normalised prediction (FlashRAG 'acc').

    A gold that normalises to "" never matches (Search-R1's check would score every prediction 1 against it):
    an empty label is a data error and must not hand out free reward."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) and normalize_answer(g) in pred for g in _golds(gold)))


def _f1_pr(prediction: str, gold: str, yes_no_rule: bool = True) -> tuple[float, float, float]:
    pred_n, gold_n = normalize_answer(prediction), normalize_answer(gold)
    # HotpotQA rule: yes/no/noanswer only score when they match exactly.
    if yes_no_rule and (pred_n in _NO_F1 or gold_n in _NO_F1) and pred_n != gold_n:
        return 0.0, 0.0, 0.0
    pred_toks, gold_toks = pred_n.split(), gold_n.split()
    common = Counter(pred_toks) & Counter(gold_toks)
    same = sum(common.values())
    if same == 0:
        return 0.0, 0.0, 0.0
    precision, recall = same / len(pred_toks), same / len(gold_toks)
    return 2 * precision * recall / (precision + recall), precision, recall


def f1_score(prediction: str, gold: str | Sequence[str]) -> float:
    """Token F1 with HotpotQA's yes/no rule (the official evaluation's), max over gold answers."""
    return max((_f1_pr(prediction, g)[0] for g in _golds(gold)), default=0.0)


def plain_f1(prediction: str, gold: str | Sequence[str]) -> float:
    """Token F1 of normalised words, max over gold answers, without the yes/no rule (StepSearch eq. 2 and 4:
    "yes queen" against "yes" scores 0.667, where `f1_score` gives 0)."""
    return max((_f1_pr(prediction, g, yes_no_rule=False)[0] for g in _golds(gold)), default=0.0)


def word_f1(a: str, b: str) -> float:
    """Plain word-level F1 between two strings (StepSearch search-key reward, eq. 4)."""
    return _f1_pr(a, b, yes_no_rule=False)[0]


def answer_scores(prediction: str | None, gold: str | Sequence[str]) -> dict[str, float]:
    """EM, F1 and sub-EM of a prediction; a missing prediction scores 0 everywhere."""
    if prediction is None:
        return {"em": 0.0, "f1": 0.0, "sub_em": 0.0}
    return {
        "em": exact_match(prediction, gold),
        "f1": f1_score(prediction, gold),
        "sub_em": sub_exact_match(prediction, gold),
    }
