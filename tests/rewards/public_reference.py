"""Reference restatements of the papers' public reward code, used only to test `public_code_compat`.

Each works on the decoded strings alone, as the public code does (no environment state), and is written from
reading that code, step by step, independently of searchrl's implementation (StepSearch's TF-IDF is
scikit-learn's `TfidfVectorizer`, as in the public code):

- StepSearch (Zillwang/StepSearch): ``qa_step.compute_score_f1_steps_plan_with_support_docs`` and the reward
  manager of ``verl/trainer/main_ppo.py``;
- ReSearch (Agent-RL/ReSearch): ``re_search.compute_score``;
- Search-R1 (PeterGriffinJin/Search-R1): ``qa_em_format.compute_score_em``.
"""

from __future__ import annotations

import re
import string
from collections import Counter


def norm(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


# ----------------------------------------------------------------------------------------------- StepSearch
def stepsearch_f1(pred, golds):
    if pred is None:
        return 0.0
    p = norm(pred).split()
    best = 0.0
    for g in [golds] if isinstance(golds, str) else golds:
        t = norm(g).split()
        same = sum((Counter(p) & Counter(t)).values())
        if same:
            prec, rec = same / len(p), same / len(t)
            best = max(best, 2 * prec * rec / (prec + rec))
    return round(best, 4)


def tfidf_cosines(text, golds):
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.metrics.pairwise import cosine_similarity

    if text == "":
        return [0.0] * len(golds)
    m = TfidfVectorizer().fit_transform([text, *golds])
    return [max(float(x), 0.0) for x in cosine_similarity(m[0], m[1:]).flatten()]


def stepsearch_public(solution: str, answers, key_groups, gold_paragraphs, gamma_key=0.618):
    """(score, step scores in the order of the search/information pairs of ``solution``)."""
    found = list(re.finditer(r"<answer>(.*?)</answer>", solution, re.S))
    answer = found[-1].group(1).strip() if found else None
    correct = stepsearch_f1(answer, answers)
    if not found or solution[found[-1].end() :].strip():
        return -1.0, []
    score = correct
    pairs = list(re.finditer(r"<search>.*?</search>\s*<information>(.*?)</information>", solution, re.S))
    rounds = [[piece.split("<##")[0].strip() for piece in m.group(1).strip().split("##>")[1:]] for m in pairs]
    gains, pens = [], []
    if gold_paragraphs:
        golds = [norm(g) for g in gold_paragraphs]
        prev = [0.0] * len(golds)
        for docs in rounds:
            cur = [0.0] * len(golds)
            for d in docs:
                for i, c in enumerate(tfidf_cosines(norm(d), golds)):
                    cur[i] = max(cur[i], c)
            gains.append(sum(max(c - p, 0) for c, p in zip(cur, prev)) / len(golds))
            prev = [max(c, p) for c, p in zip(cur, prev)]
        pens = [0.0] * len(gains)
        got = set()
        for i, docs in enumerate(rounds):
            for d in docs:
                if d in got:
                    pens[i] += 1 / len(docs)
                else:
                    got.add(d)
    steps = [g - p for g, p in zip(gains, pens)]
    searches = [
        re.sub(r"</?search>", "", m).strip() for m in re.findall(r"<search>.*?</search>", solution, re.S)
    ]
    key = 0.0
    if searches and key_groups:
        matched = {i: 0 for i in range(len(key_groups))}
        for q in searches:
            best, which = 0, -1
            for i, group in enumerate(key_groups):
                f = stepsearch_f1(q, list(group))
                if f > best:
                    best, which = f, i
            matched[which] = best
        key = sum(matched.values()) / len(key_groups)
    score += key * gamma_key
    return score, steps


def stepsearch_step_positions(response: str) -> list[int]:
    """Where the reward manager puts the step scores: each pair's `</search>` end in the response alone."""
    pattern = r"<search>.*?</search>\s*<information>.*?</information>"
    return [
        m.start() + m.group().find("</search>") + len("</search>")
        for m in re.finditer(pattern, response, re.S)
    ]


# ----------------------------------------------------------------------------------------------- ReSearch
def research_format(text):
    if text.count("<think>") != text.count("</think>") or text.count("<think>") == 0:
        return False
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False
    pos = 0
    while True:
        s = text.find("<search>", pos)
        if s == -1:
            break
        r = text.find("<result>", s)
        se = text.find("</search>", s)
        re_ = text.find("</result>", r)
        if -1 in (r, se, re_) or not (s < se < r < re_):
            return False
        pos = re_
    a, ae = text.find("<answer>"), text.find("</answer>")
    if a > ae:
        return False
    inside = text[a:ae]
    return "\\boxed{" in inside and "}" in inside


def research_f1(pred, golds):
    best = 0.0
    for g in [golds] if isinstance(golds, str) else golds:
        p, t = norm(pred), norm(g)
        if (p in ("yes", "no", "noanswer") or t in ("yes", "no", "noanswer")) and p != t:
            continue
        same = sum((Counter(p.split()) & Counter(t.split())).values())
        if same:
            prec, rec = same / len(p.split()), same / len(t.split())
            best = max(best, 2 * prec * rec / (prec + rec))
    return best


def research_public(solution: str, answers, eos="<|endoftext|>"):
    parts = (
        solution.split("<|im_start|>assistant\n")
        if "<|im_start|>assistant\n" in solution
        else solution.split("Assistant:")
    )
    response = parts[1]
    if not research_format(response):
        return 0.0
    if not response.endswith(eos):
        return 0.0
    response = response[: -len(eos)]
    m = re.search(r"<answer>(.*?)</answer>", response.strip(), re.S)
    if m is None:
        return 0.0
    part = m.group(1)
    try:
        if "\\boxed " in part:
            boxed = "\\boxed " + part.split("\\boxed ")[-1].split("$")[0]
        else:
            idx = part.rfind("\\boxed")
            if idx < 0:
                idx = part.rfind("\\fbox")
            boxed = None
            if idx >= 0:
                depth = 0
                for i in range(idx, len(part)):
                    if part[i] == "{":
                        depth += 1
                    if part[i] == "}":
                        depth -= 1
                        if depth == 0:
                            boxed = part[idx : i + 1]
                            break
        if "\\boxed " in boxed:
            answer = boxed[len("\\boxed ") :]
        else:
            assert boxed.startswith("\\boxed{") and boxed[-1] == "}"
            answer = boxed[len("\\boxed{") : -1]
    except Exception:  # the public code scores any extraction error 0
        return 0.0
    f1 = research_f1(answer, answers)
    return f1 if f1 > 0 else 0.1


# ----------------------------------------------------------------------------------------------- Search-R1
def search_r1_valid(text):
    m = re.search(r"<\|im_start\|>assistant\s*", text)
    if not m:
        return False
    content = text[m.end() :]
    for tag in ("think", "search", "information", "answer"):
        if len(re.findall(f"<{tag}>", content)) != len(re.findall(f"</{tag}>", content)):
            return False
    state = "start"
    for part in re.split(r"(</?(?:think|search|information|answer)>)", content):
        if not part.strip():
            continue
        if re.match(r"</?(?:think|search|information|answer)>", part):
            nxt = {
                ("<think>", "start"): "in_think",
                ("<think>", "information"): "in_think",
                ("</think>", "in_think"): "after_think",
                ("<search>", "after_think"): "in_search",
                ("</search>", "in_search"): "after_search",
                ("<information>", "after_search"): "in_information",
                ("</information>", "in_information"): "information",
                ("<answer>", "after_think"): "in_answer",
                ("</answer>", "in_answer"): "end",
            }.get((part, state))
            if nxt is None:
                return False
            state = nxt
        elif state in ("start", "after_think", "after_search", "information", "end"):
            return False
    return state == "end"


def search_r1_public(solution: str, answers, structure=0.2, final=0.1, retrieval=0.0, score=1.0):
    valid = search_r1_valid(solution)
    retrieved = valid and any(
        norm(g) in norm(b.strip())
        for b in re.findall(r"<information>(.*?)</information>", solution, re.S)
        for g in answers
    )
    found = list(re.finditer(r"<answer>(.*?)</answer>", solution, re.S))
    answer = found[-1].group(1).strip() if len(found) > 1 else None
    if answer is None:
        return (structure + retrieval if retrieved else structure) if valid else 0.0
    if any(norm(g) == norm(answer) for g in answers):
        return score if valid else score - structure
    if valid:
        return structure + retrieval if retrieved else structure
    return final
