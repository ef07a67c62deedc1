import random

from searchrl.envs.synthetic.world import SPLITS, World, WorldConfig


def test_same_seed_gives_byte_identical_files(tmp_path):
    cfg = WorldConfig(
        seed=5,
        persons=60,
        cities=20,
        countries=4,
        films=20,
        companies=10,
        universities=8,
        bands=10,
        questions=(100, 20, 30),
    )
    a, b = World.generate(cfg).save(tmp_path / "a"), World.generate(cfg).save(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert names == ["corpus.jsonl", "dev.jsonl", "test.jsonl", "train.jsonl", "world.json"]
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    c = World.generate(WorldConfig(**{**cfg.__dict__, "seed": 6})).save(tmp_path / "c")
    assert (c / "corpus.jsonl").read_bytes() != (a / "corpus.jsonl").read_bytes()


def test_load_round_trip(tmp_path, small_world):
    small_world.save(tmp_path)
    again = World.load(tmp_path)
    assert again.config == small_world.config
    assert again.examples("test") == small_world.examples("test")
    assert again.documents() == small_world.documents()


def test_documents_one_per_entity_with_facts(small_world):
    docs = small_world.documents()
    assert len(docs) == len(small_world.entities)
    by_id = {d.id: d for d in docs}
    for e in small_world.entities:
        doc = by_id[e.id]
        assert doc.title == e.display
        for obj in e.facts.values():  # every fact's object is named in the subject's document
            assert small_world.by_id[obj].display in doc.text


def _phrasings_used(world):
    """(facts stated with their relation's first phrasing, facts stated with another) in the documents."""
    from searchrl.envs.synthetic.schema import RELATIONS_BY_SUBJECT

    text = {d.id: d.text for d in world.documents()}
    first = other = 0
    for e in world.entities:
        for rel in RELATIONS_BY_SUBJECT[e.kind]:
            said = [
                f.format(s=e.display, o=world.by_id[e.facts[rel.name]].display) in text[e.id]
                for f in rel.facts
            ]
            first, other = first + said[0], other + any(said[1:])
    return first, other


def test_one_phrasing_states_every_fact_the_same_way(small_world):
    plain = World.generate(WorldConfig(**{**small_world.config.__dict__, "phrasings": 1}))
    facts = sum(len(e.facts) for e in plain.entities)
    assert _phrasings_used(plain) == (facts, 0)
    assert _phrasings_used(small_world)[1] > facts / 2  # by default every phrasing is used
    assert plain.examples("test") == small_world.examples("test")  # the questions do not change


def test_coverage_leaves_documents_out_of_the_corpus_only(small_world):
    """``coverage``: the corpus keeps that share of the entity documents, unchanged; the questions are the
    same; the full corpus is the default's, byte for byte."""
    full = small_world.documents()
    part = World.generate(WorldConfig(**{**small_world.config.__dict__, "coverage": 0.8}))
    kept = part.documents()
    assert len(kept) == round(0.8 * len(full))
    by_id = {d.id: d for d in full}
    assert all(by_id[d.id] == d for d in kept)  # the same documents, texts unchanged
    assert part.examples("test") == small_world.examples("test")
    assert World.generate(WorldConfig(**{**small_world.config.__dict__, "coverage": 1.0})).documents() == full


def test_questions_have_decompositions(small_world):
    for split in SPLITS:
        for ex in small_world.examples(split):
            assert 1 <= ex.n_hops <= 4 and ex.metadata["n_hops"] == ex.n_hops
            assert ex.hops[-1].answer == ex.answers[0]
            for i, hop in enumerate(ex.hops):
                assert 2 <= len(hop.keys) <= 3 and hop.gold_doc_id == ex.metadata["chain"][i]
                if i:
                    assert ex.hops[i - 1].answer in hop.question  # the chain passes the answer on
    hop_counts = {ex.n_hops for ex in small_world.examples("train")}
    assert hop_counts == {1, 2, 3, 4}


def test_test_facts_never_appear_in_train_questions(small_world):
    def facts(ex):
        chain, rels = ex.metadata["chain"], ex.metadata["relations"]
        return {(chain[i], rels[i]) for i in range(len(rels))}

    train = set().union(*(facts(e) for e in small_world.examples("train")))
    test = set().union(*(facts(e) for e in small_world.examples("test")))
    assert train and test and not (train & test)
    train_subjects = {s for s, _ in train}
    assert not train_subjects & {s for s, _ in test}


def test_renaming_is_consistent_and_complete(small_world):
    ex = small_world.examples("test")[3]
    docs = {d.id: d for d in small_world.documents()}
    texts = [ex.question, docs[ex.hops[0].gold_doc_id].text, ex.answers[0]]
    mapping = small_world.rename_map(random.Random(0), texts)
    assert mapping and set(mapping) == set(small_world.names_in(" ".join(texts)))
    for old, new in mapping.items():
        assert small_world.kind_of_name[old] == small_world.kind_of_name[new]
    renamed = [small_world.apply_renaming(t, mapping) for t in texts]
    assert not set(small_world.names_in(" ".join(renamed))) & set(mapping)  # no old name survives
    assert len(set(mapping.values())) == len(mapping)
