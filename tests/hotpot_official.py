"""The answer half of HotpotQA's official evaluation script (`hotpot_evaluate_v1.py`, hotpotqa/hotpot on
GitHub), restated here as an independent reference: its normalisation, F1 with the yes/no/noanswer rule, EM,
and its loop over the gold file, which counts a question missing from the prediction file as 0."""

import json
import re
import string
from collections import Counter


def normalize_answer(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def f1_score(prediction, ground_truth):
    normalized_prediction = normalize_answer(prediction)
    normalized_ground_truth = normalize_answer(ground_truth)
    zero = (0, 0, 0)
    if (
        normalized_prediction in ["yes", "no", "noanswer"]
        and normalized_prediction != normalized_ground_truth
    ):
        return zero
    if (
        normalized_ground_truth in ["yes", "no", "noanswer"]
        and normalized_prediction != normalized_ground_truth
    ):
        return zero
    prediction_tokens = normalized_prediction.split()
    ground_truth_tokens = normalized_ground_truth.split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return zero
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    f1 = (2 * precision * recall) / (precision + recall)
    return f1, precision, recall


def exact_match_score(prediction, ground_truth):
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def evaluate(prediction_file, gold_file):
    with open(prediction_file) as f:
        prediction = json.load(f)
    with open(gold_file) as f:
        gold = json.load(f)
    metrics = {"em": 0, "f1": 0}
    for dp in gold:
        cur_id = dp["_id"]
        if cur_id in prediction["answer"]:
            metrics["em"] += float(exact_match_score(prediction["answer"][cur_id], dp["answer"]))
            metrics["f1"] += f1_score(prediction["answer"][cur_id], dp["answer"])[0]
    return {k: v / len(gold) for k, v in metrics.items()}
