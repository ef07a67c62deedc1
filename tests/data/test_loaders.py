import json

import pytest

from searchrl.core.errors import DataError
from searchrl.data import Example, keys_from_subquestion, load_corpus, load_examples


def test_corpus_formats(fixtures):
    jl = load_corpus(fixtures / "corpus.jsonl")
    assert jl[0].id == "0" and jl[0].title == "Hamlet" and jl[0].text.startswith("Hamlet is a tragedy")
    assert jl[0].contents == '"Hamlet"\nHamlet is a tragedy written by William Shakespeare.'
    hp = load_corpus(fixtures / "hotpotqa_corpus.json")  # dict of title -> sentences
    assert [d.title for d in hp] == ["Acme Rockets", "Wile Coyote", "Road Runner"]
    assert hp[1].text == "Wile Coyote is an engineer. He was born in Springfield."
    ms = load_corpus(fixtures / "musique_corpus.json")  # list of {title, text}
    assert ms[2].title == "American Psychological Association" and ms[2].id == "2"


def test_corpus_errors(tmp_path):
    with pytest.raises(DataError, match="none.jsonl: corpus file not found"):
        load_corpus(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"foo": 1}]))
    with pytest.raises(ValueError, match=r"bad.json: record 0 is not a corpus entry"):
        load_corpus(bad)


def test_flashrag(fixtures):
    ex = load_examples(fixtures / "flashrag.jsonl")
    assert ex[0] == Example(
        id="test_0", question="Who wrote Hamlet?", answers=("William Shakespeare", "Shakespeare")
    )
    assert ex[1].metadata == {"subj": "France"}


def test_hotpotqa_maps_gold_titles_to_corpus_ids(fixtures):
    corpus = load_corpus(fixtures / "hotpotqa_corpus.json")
    ex = load_examples(fixtures / "hotpotqa.json", corpus=corpus)
    assert ex[0].answers == ("Springfield",) and ex[0].gold_doc_ids == ("0", "1")
    assert ex[0].metadata["gold_titles"] == ["Acme Rockets", "Wile Coyote"]
    assert ex[1].metadata["type"] == "comparison"


def test_musique_decomposition_becomes_hops(fixtures):
    corpus = load_corpus(fixtures / "musique_corpus.json")
    [ex] = load_examples(fixtures / "musique.jsonl", corpus=corpus)
    assert ex.answers == ("G. Stanley Hall", "Stanley Hall")
    h1, h2 = ex.hops
    assert h1.question == "Journal X >> publisher" and h1.keys[:2] == ("Journal X publisher", "Journal X")
    assert h1.gold_doc_id == "1" and h1.gold_title == "Journal X"
    # "#1" is replaced by the first sub-answer
    assert h2.question == "Who was the first president of American Psychological Association ?"
    assert h2.answer == "G. Stanley Hall" and h2.gold_doc_id == "2"
    assert 2 <= len(h2.keys) <= 3
    assert ex.gold_doc_ids == ("1", "2")


def test_2wiki_evidences_become_hops(fixtures):
    corpus = load_corpus(fixtures / "twowiki_corpus.json")
    [ex] = load_examples(fixtures / "twowiki.json", corpus=corpus)
    assert [h.answer for h in ex.hops] == ["Ann Lee", "Oslo"]
    assert [h.gold_doc_id for h in ex.hops] == ["0", "1"]
    assert ex.hops[1].question == "Ann Lee >> place of birth"


def test_format_sniffing_and_errors(fixtures, tmp_path):
    assert load_examples(fixtures / "musique.jsonl", fmt="auto")[0].n_hops == 2
    with pytest.raises(ValueError, match="unknown data format 'csv'; valid: auto, flashrag"):
        load_examples(fixtures / "flashrag.jsonl", fmt="csv")
    with pytest.raises(DataError, match="question file not found"):
        load_examples(tmp_path / "x.jsonl")
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"q": 1}\n')
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_examples(odd)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "x", "golden_answers": ["y"]}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken.jsonl: line 2 is not valid JSON"):
        load_examples(broken, fmt="flashrag")


def test_keys_from_natural_subquestion():
    keys = keys_from_subquestion("Who directed The Silent Sea?")
    assert keys[0] == "directed Silent Sea" and "The Silent Sea" in keys and len(keys) <= 3


def test_example_json_round_trip(small_world):
    ex = small_world.examples("test")[0]
    assert Example.from_json(json.loads(json.dumps(ex.to_json()))) == ex


@pytest.mark.parametrize(
    "sub, fmt",
    [
        ("musique/hipporag_musique_train_100.json", "musique"),
        ("hotpotqa/hipporag_hotpotqa_train_100.json", "hotpotqa"),
        ("bamboogle/test.jsonl", "flashrag"),
        ("popqa/test_subsample.jsonl", "flashrag"),
    ],
)
def test_real_samples_when_present(sub, fmt, shared_data):
    """The real files in ../shared/data (used only when present; the fixtures above cover the formats)."""
    path = shared_data / sub
    ex = load_examples(path)
    assert len(ex) >= 100 and all(e.answers for e in ex)
    if fmt == "musique":
        corpus = load_corpus(path.with_name("hipporag_musique_train_100_corpus.json"))
        ex = load_examples(path, corpus=corpus)
        hops = [h for e in ex for h in e.hops]
        assert sum(h.gold_doc_id is not None for h in hops) / len(hops) > 0.95
