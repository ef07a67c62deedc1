"""Entity kinds, relations and every phrasing the synthetic world uses.

A relation is functional: each subject has exactly one object. ``{s}``/``{o}`` are the subject's and
object's display names, ``{d}`` a (possibly nested) description of the subject.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("person", "city", "country", "film", "company", "university", "band")


@dataclass(frozen=True)
class Relation:
    subject: str
    name: str
    object: str
    facts: tuple[str, ...]  # document sentences, one chosen per document
    noun: str  # noun phrase used inside nested questions, e.g. "the director of {d}"
    question: str  # wh-question about {d}
    keys: tuple[str, ...]  # gold search keys for the hop, filled with the subject's name
    inverse: str  # sentence for the object's document listing subjects: {o} ... {subjects}


RELATIONS: tuple[Relation, ...] = (
    Relation(
        "person",
        "born_in",
        "city",
        (
            "{s} was born in {o}.",
            "{s} is a native of {o}.",
            "The birthplace of {s} is {o}.",
            "{s} was born and raised in {o}.",
        ),
        "the birthplace of {d}",
        "In which city was {d} born?",
        ("{s} birthplace", "{s} born in", "where was {s} born"),
        "People born in {o} include {subjects}.",
    ),
    Relation(
        "person",
        "educated_at",
        "university",
        (
            "{s} studied at {o}.",
            "{s} graduated from {o}.",
            "{s} was educated at {o}.",
            "{s} is an alumnus of {o}.",
        ),
        "the university attended by {d}",
        "Which university did {d} attend?",
        ("{s} university", "{s} educated at", "where did {s} study"),
        "Alumni of {o} include {subjects}.",
    ),
    Relation(
        "city",
        "located_in",
        "country",
        (
            "{s} is a city in {o}.",
            "{s} is located in {o}.",
            "{s} lies in the country of {o}.",
            "{s} is one of the cities of {o}.",
        ),
        "the country of {d}",
        "In which country is {d}?",
        ("{s} country", "{s} located in", "which country is {s} in"),
        "Cities of {o} include {subjects}.",
    ),
    Relation(
        "university",
        "located_in",
        "city",
        (
            "{s} is located in {o}.",
            "{s} is a university in {o}.",
            "The campus of {s} is in {o}.",
            "{s} is based in the city of {o}.",
        ),
        "the city of {d}",
        "In which city is {d} located?",
        ("{s} city", "{s} located in", "where is {s}"),
        "{o} is home to {subjects}.",
    ),
    Relation(
        "film",
        "directed_by",
        "person",
        (
            "{s} was directed by {o}.",
            "{o} directed {s}.",
            "The director of {s} is {o}.",
            "{s} is a film by director {o}.",
        ),
        "the director of {d}",
        "Who directed {d}?",
        ("{s} director", "{s} directed by", "who directed {s}"),
        "{o} directed {subjects}.",
    ),
    Relation(
        "company",
        "founded_by",
        "person",
        (
            "{s} was founded by {o}.",
            "{o} founded {s}.",
            "The founder of {s} is {o}.",
            "{s} was started by the entrepreneur {o}.",
        ),
        "the founder of {d}",
        "Who founded {d}?",
        ("{s} founder", "{s} founded by", "who founded {s}"),
        "{o} founded {subjects}.",
    ),
    Relation(
        "company",
        "headquartered_in",
        "city",
        (
            "{s} is headquartered in {o}.",
            "The headquarters of {s} are in {o}.",
            "{s} has its head office in {o}.",
        ),
        "the headquarters city of {d}",
        "In which city is {d} headquartered?",
        ("{s} headquarters", "{s} headquartered in", "where is {s} headquartered"),
        "Companies headquartered in {o} include {subjects}.",
    ),
    Relation(
        "band",
        "formed_in",
        "city",
        (
            "{s} was formed in {o}.",
            "{s} is a band from {o}.",
            "{s} was founded in the city of {o}.",
            "The band {s} formed in {o}.",
        ),
        "the city where {d} formed",
        "In which city was {d} formed?",
        ("{s} formed in", "{s} band origin", "where was {s} formed"),
        "Bands formed in {o} include {subjects}.",
    ),
)

RELATIONS_BY_SUBJECT: dict[str, tuple[Relation, ...]] = {
    kind: tuple(r for r in RELATIONS if r.subject == kind) for kind in KINDS
}

# Intro sentence and attribute phrasings (facts no question asks about; they make documents realistic).
INTROS: dict[str, tuple[str, ...]] = {
    "person": ("{s} is {a_occupation}.", "{s} is a well-known {occupation}.", "{s} works as {a_occupation}."),
    "city": ("{s} is a city with about {population} inhabitants.", "{s} is a {size} city."),
    "country": ("{s} is a country.", "{s} is a {size} country."),
    "film": ("{s} is a {genre} film released in {year}.", "{s} is a {year} {genre} film."),
    "company": ("{s} is a {industry} company.", "{s} is a company in the {industry} industry."),
    "university": ("{s} is a {size} university founded in {year}.", "{s} is a public university."),
    "band": ("{s} is a {genre} band.", "{s} is a {genre} group active since {year}."),
}
ATTRIBUTES = {
    "occupation": (
        "painter",
        "engineer",
        "writer",
        "chemist",
        "teacher",
        "architect",
        "singer",
        "lawyer",
        "pilot",
    ),
    "genre": ("drama", "comedy", "thriller", "rock", "folk", "jazz", "horror", "documentary", "pop"),
    "industry": ("shipping", "software", "textile", "mining", "banking", "food", "energy", "toy"),
    "size": ("small", "large", "old", "young", "busy", "quiet"),
}

# Distractors: other entities mentioned in roles no question asks about.
DISTRACTORS: dict[str, tuple[tuple[str, str], ...]] = {
    "person": (
        ("{s} once visited {x}.", "city"),
        ("{s} worked with {x} for many years.", "person"),
        ("{s} gave a lecture at {x}.", "university"),
        ("{s} admired the films of {x}.", "person"),
    ),
    "city": (
        ("{s} is twinned with {x}.", "city"),
        ("{s} lies near the border with {x}.", "country"),
        ("The mayor of {s} met {x} in a public debate.", "person"),
    ),
    "country": (
        ("{s} shares a border with {x}.", "country"),
        ("The largest port of {s} trades with {x}.", "city"),
    ),
    "film": (
        ("{s} stars {x}.", "person"),
        ("{s} was partly shot in {x}.", "city"),
        ("{s} won a prize at a festival in {x}.", "city"),
    ),
    "company": (
        ("{s} opened a sales office in {x}.", "city"),
        ("{s} hired {x} as an adviser.", "person"),
        ("{s} competes with {x}.", "company"),
    ),
    "university": (
        ("{s} has an exchange programme with {x}.", "university"),
        ("{s} awarded an honorary degree to {x}.", "person"),
    ),
    "band": (
        ("{s} toured through {x}.", "city"),
        ("{s} recorded an album with {x}.", "person"),
        ("{s} shared a stage with {x}.", "band"),
    ),
}

QUESTION_WRAPPERS = ("{q}", "{q}", "Can you tell me: {q_lower}")
