import pytest

from searchrl.core.answers import (
    answer_scores,
    exact_match,
    f1_score,
    normalize_answer,
    sub_exact_match,
    word_f1,
)


def test_normalisation_follows_squad():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a pear") == "apple pear"


def test_exact_match_takes_max_over_gold():
    assert exact_match("paris", ["Lyon", "Paris"]) == 1.0
    assert exact_match("Paris France", ["Paris"]) == 0.0


def test_f1_hand_computed():
    # pred tokens {new, york, city}, gold {new, york}: P = 2/3, R = 1, F1 = 0.8
    assert f1_score("New York City", "New York") == pytest.approx(0.8)
    assert f1_score("x", ["New York", "x"]) == 1.0
    assert word_f1("w x y z", "y z q") == pytest.approx(2 * (2 / 4) * (2 / 3) / (2 / 4 + 2 / 3))


def test_yes_no_rule():
    # HotpotQA: yes/no/noanswer only score on an exact match
    assert f1_score("yes it is", "yes") == 0.0
    assert f1_score("yes", "yes") == 1.0
    assert f1_score("no", "no way") == 0.0


def test_sub_em_and_missing_prediction():
    assert sub_exact_match("it was William Shakespeare indeed", ["Shakespeare"]) == 1.0
    assert sub_exact_match("Marlowe", ["Shakespeare"]) == 0.0
    assert answer_scores(None, ["x"]) == {"em": 0.0, "f1": 0.0, "sub_em": 0.0}


def test_sub_em_never_matches_an_empty_gold():
    # a gold that normalises to "" ("The", "?") is a data error; Search-R1's check (`"" in prediction`) scores
    # every prediction 1 against it, ours 0, so a broken label cannot hand out free reward
    assert sub_exact_match("anything at all", ["The"]) == 0.0
    assert sub_exact_match("anything at all", ["?", "all"]) == 1.0  # the other gold still counts
