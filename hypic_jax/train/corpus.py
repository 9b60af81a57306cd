"""A generated multi-document corpus for training and evaluating retrieval (no network, deterministic from a seed).

A `World` holds generated people (name, city, birth year, code, colleague) and registries of key -> value pairs.
A `Prompt` is a list of documents (the engine's segments, one text each) and several short question / answer pairs
over them, of these task families:
  single    one attribute of one person, read from that person's document;
  multihop  an attribute of a person's colleague: the person's document names the colleague, whose document
            holds the attribute (two documents);
  count     how many people of the prompt live in a city (every person document counts, and every move);
  needle    the value of a key in one registry document (RULER-style key lookup);
  update    a person's city or a key's value as a LATER document changed it ("{name} moved to {city}.", "The value
            of key {key} was changed to {value}."): asked with the very words of a single or needle question, so
            the earlier value, stated the same way as any other fact, is the answer of a model that misses the
            change (two documents; `Question.distractor` holds the earlier value).
`FAMILIES` (the first four) is the default; "update" is drawn only when asked for (`ALL_FAMILIES`), and a prompt
without it is generated exactly as before the family existed. With it, a prompt's changes also hold for the other
families: single and multihop questions never ask a changed city, needle questions never a changed key, and counts
are of the cities people live in after every move.
Each question records the documents that hold its evidence, so the position of the answer is known.
`Curriculum` maps training progress to documents per prompt and document lengths (short and few first).
"""

from __future__ import annotations

import dataclasses
import math
import random

FAMILIES = ("single", "multihop", "count", "needle")  # the default mix
ALL_FAMILIES = FAMILIES + ("update",)

_ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "cr",
           "dr", "gl", "kr", "pl", "st", "tr", "sh", "ch", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou")
_CODAS = ("", "", "", "n", "r", "s", "l", "m", "th", "x", "nd", "rt")
_FILLER_WORDS = ("the", "old", "river", "market", "winter", "garden", "station", "library", "quiet", "morning",
                 "bridge", "harbor", "mountain", "festival", "evening", "road", "school", "north", "south", "small",
                 "large", "green", "stone", "window", "letter", "music", "travel", "often", "during", "near")
_KEY_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"

# (document sentence, question, attribute); several wordings per attribute so that questions do not always repeat
# the document's words
_FACTS = {
    "city": (("{name} lives in {value}.", "{name} has a home in {value}."),
             ("Where does {name} live?", "In which city is the home of {name}?")),
    "year": (("{name} was born in {value}.", "The birth year of {name} is {value}."),
             ("When was {name} born?", "What is the birth year of {name}?")),
    "code": (("The code of {name} is {value}.", "{name} holds the badge code {value}."),
             ("What is the code of {name}?", "Which badge code does {name} hold?")),
}
_COLLEAGUE = "{name} works with {value}."
# the update family's changes, stated in a later document than the fact they change (never with a "lives in" or a
# "Key ... holds" of the facts' own wording)
_MOVES = ("{name} moved to {value}.", "{name} has since moved to {value}.")
_CHANGES = ("The value of key {key} was changed to {value}.", "The value of key {key} is now {value}.")
_MULTIHOP = {
    "city": "Where does the colleague of {name} live?",
    "year": "When was the colleague of {name} born?",
    "code": "What is the code of the colleague of {name}?",
}


@dataclasses.dataclass(frozen=True)
class Question:
    family: str
    text: str
    answer: str
    evidence: tuple[int, ...]  # indices of the documents that hold the answer's facts
    distractor: str = ""  # update family: the earlier value, which a later document replaced


@dataclasses.dataclass(frozen=True)
class Prompt:
    documents: tuple[str, ...]
    questions: tuple[Question, ...]


@dataclasses.dataclass(frozen=True)
class Curriculum:
    """Documents per prompt and filler sentences per document as training progresses (0 -> 1): both grow
    geometrically from the start values to the end values over the first `ramp` of training."""

    min_docs: tuple[int, int] = (2, 2)  # documents per prompt at the start: (low, high)
    max_docs: tuple[int, int] = (2, 64)  # at the end of the ramp
    min_filler: int = 0
    max_filler: int = 4
    ramp: float = 0.7

    def at(self, progress: float) -> tuple[tuple[int, int], int]:
        t = min(max(progress / self.ramp, 0.0), 1.0) if self.ramp > 0 else 1.0
        grow = lambda a, b: int(round(a * (b / a) ** t)) if a > 0 else int(round(b * t))  # noqa: E731
        low = grow(self.min_docs[0], self.max_docs[0])
        high = max(low, grow(self.min_docs[1], self.max_docs[1]))
        return (low, high), int(round(self.min_filler + (self.max_filler - self.min_filler) * t))


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(_KEY_CHARS) for _ in range(4))


def _filler(rng: random.Random) -> str:
    words = [rng.choice(_FILLER_WORDS) for _ in range(rng.randint(4, 9))]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


class World:
    """Entities of one prompt: people with unique names and codes, drawn from `rng`."""

    def __init__(self, rng: random.Random, people: int, cities: int):
        self.cities = sorted({_word(rng, 2).capitalize() for _ in range(cities * 2)})[:cities]
        rng.shuffle(self.cities)
        names, codes = set(), set()
        self.people = []
        while len(self.people) < people:
            name = f"{_word(rng, rng.randint(1, 2)).capitalize()} {_word(rng, 2).capitalize()}"
            code = f"{_key(rng)}-{rng.randint(10, 99)}"
            if name in names or code in codes:
                continue
            names.add(name)
            codes.add(code)
            self.people.append(dict(name=name, city=rng.choice(self.cities), year=str(rng.randint(1900, 2020)),
                                    code=code))
        for i, person in enumerate(self.people):  # a colleague among the others
            person["colleague"] = rng.choice([j for j in range(len(self.people)) if j != i]) if people > 1 else None


def _insert(rng: random.Random, sentences: list[str], extra) -> None:
    """`extra` sentences at random places among `sentences` (no draws when there are none)."""
    for sentence in extra:
        sentences.insert(rng.randint(0, len(sentences)), sentence)


def person_document(rng: random.Random, person: dict, world: World, filler: int, extra=()) -> str:
    """A person's facts in random order, with `extra` sentences (changes to earlier documents' facts) and `filler`
    sentences among them."""
    sentences = [rng.choice(_FACTS[attr][0]).format(name=person["name"], value=person[attr])
                 for attr in ("city", "year", "code")]
    if person["colleague"] is not None:
        sentences.append(_COLLEAGUE.format(name=person["name"], value=world.people[person["colleague"]]["name"]))
    rng.shuffle(sentences)
    _insert(rng, sentences, extra)
    for _ in range(filler):
        sentences.insert(rng.randint(0, len(sentences)), _filler(rng))
    return f"About {person['name']}. " + " ".join(sentences)


def registry_document(rng: random.Random, pairs: list[tuple[str, str]], filler: int, extra=()) -> str:
    sentences = [f"Key {k} holds {v}." for k, v in pairs]
    _insert(rng, sentences, extra)
    for _ in range(filler):
        sentences.insert(rng.randint(0, len(sentences)), _filler(rng))
    return "Registry. " + " ".join(sentences)


def make_prompt(seed: int, num_docs: int, questions: int = 8, filler: int = 0,
                families: tuple[str, ...] = FAMILIES) -> Prompt:
    """One prompt of `num_docs` documents (about one in four a registry, at least one person document) and
    `questions` question / answer pairs cycling through `families`, all drawn from `seed`. With "update" in
    `families`, about one change per four documents (`_updates`), each in a document after the one it changes."""
    if num_docs < 1:
        raise ValueError("num_docs must be >= 1")
    rng = random.Random(seed)
    registries = min(num_docs - 1, max(1 if "needle" in families else 0, num_docs // 4)) if num_docs > 1 else 0
    people = num_docs - registries
    world = World(rng, people, cities=max(2, min(8, people // 2 + 1)))
    keys = set()
    registry_pairs = []
    for _ in range(registries):
        pairs = []
        while len(pairs) < 3:
            k = _key(rng)
            if k not in keys:
                keys.add(k)
                pairs.append((k, str(rng.randint(100, 999))))
        registry_pairs.append(pairs)
    kinds = [("person", i) for i in range(people)] + [("registry", i) for i in range(registries)]
    rng.shuffle(kinds)
    doc_of_person = {i: d for d, (kind, i) in enumerate(kinds) if kind == "person"}
    doc_of_registry = {i: d for d, (kind, i) in enumerate(kinds) if kind == "registry"}
    moves, changes, extra = (_updates(rng, world, registry_pairs, doc_of_person, doc_of_registry, num_docs)
                             if "update" in families else ({}, {}, {}))
    documents = tuple(
        person_document(rng, world.people[i], world, filler, extra.get(d, ())) if kind == "person"
        else registry_document(rng, registry_pairs[i], filler, extra.get(d, ()))
        for d, (kind, i) in enumerate(kinds)
    )
    usable = [f for f in families if f != "needle" or registries] or ["single"]
    usable = [f for f in usable if f != "multihop" or people > 1] or ["single"]
    usable = [f for f in usable if f != "update" or moves or changes] or ["single"]
    city_now = [moves[i][0] if i in moves else p["city"] for i, p in enumerate(world.people)]
    out = []
    for q in range(questions):
        family = usable[(q + rng.randrange(len(usable))) % len(usable)]
        if family == "single":
            while True:  # a city that a later document changed is the update family's question
                i, attr = rng.randrange(people), rng.choice(tuple(_FACTS))
                if not (attr == "city" and i in moves):
                    break
            person = world.people[i]
            out.append(Question(family, rng.choice(_FACTS[attr][1]).format(name=person["name"]), person[attr],
                                (doc_of_person[i],)))
        elif family == "multihop":
            while True:
                i, attr = rng.randrange(people), rng.choice(tuple(_MULTIHOP))
                j = world.people[i]["colleague"]
                if not (attr == "city" and j in moves):
                    break
            out.append(Question(family, _MULTIHOP[attr].format(name=world.people[i]["name"]),
                                world.people[j][attr], (doc_of_person[i], doc_of_person[j])))
        elif family == "count":
            city = rng.choice(world.cities)
            holders = [i for i in range(people) if city_now[i] == city]
            # the documents that say where anyone who lives or lived in the city lives: their own, and their move
            involved = [i for i, p in enumerate(world.people) if city in (p["city"], city_now[i])]
            evidence = {doc_of_person[i] for i in involved} | {moves[i][1] for i in involved if i in moves}
            out.append(Question(family, f"How many people live in {city}?", str(len(holders)),
                                tuple(sorted(evidence))))
        elif family == "needle":
            while True:  # a changed key is the update family's question
                r = rng.randrange(registries)
                k, v = rng.choice(registry_pairs[r])
                if k not in changes:
                    break
            out.append(Question(family, f"Which value does key {k} hold?", v, (doc_of_registry[r],)))
        else:
            subject = rng.choice(sorted(moves) + sorted(changes))
            if subject in moves:  # a person index
                person, (city, d) = world.people[subject], moves[subject]
                out.append(Question(family, rng.choice(_FACTS["city"][1]).format(name=person["name"]), city,
                                    (doc_of_person[subject], d), distractor=person["city"]))
            else:  # a key
                r, old, value, d = changes[subject]
                out.append(Question(family, f"Which value does key {subject} hold?", value,
                                    (doc_of_registry[r], d), distractor=old))
    return Prompt(documents, tuple(out))


def _updates(rng: random.Random, world: World, registry_pairs: list, doc_of_person: dict, doc_of_registry: dict,
             num_docs: int) -> tuple[dict, dict, dict]:
    """The update family's changes: max(1, num_docs // 4) of them (fewer when not enough facts sit before the last
    document), each a person's move to another of the prompt's cities or a registry key's new value, stated in a
    document drawn after the one holding the fact. Returns (moves {person: (city, document)}, changes {key:
    (registry, old value, new value, document)}, {document: its change sentences})."""
    moves, changes, extra = {}, {}, {}
    last = num_docs - 1
    people = [i for i, d in sorted(doc_of_person.items()) if d < last]
    keys = [(r, k, v) for r, d in sorted(doc_of_registry.items()) if d < last for k, v in registry_pairs[r]]
    for _ in range(max(1, num_docs // 4)):
        people = [i for i in people if i not in moves]
        keys = [key for key in keys if key[1] not in changes]
        if not people and not keys:
            break
        if people and (not keys or rng.random() < 0.5):
            i = rng.choice(people)
            person = world.people[i]
            city = rng.choice([c for c in world.cities if c != person["city"]])
            d = rng.randint(doc_of_person[i] + 1, last)
            moves[i] = (city, d)
            sentence = rng.choice(_MOVES).format(name=person["name"], value=city)
        else:
            r, k, old = rng.choice(keys)
            value = old
            while value == old:
                value = str(rng.randint(100, 999))
            d = rng.randint(doc_of_registry[r] + 1, last)
            changes[k] = (r, old, value, d)
            sentence = rng.choice(_CHANGES).format(key=k, value=value)
        extra.setdefault(d, []).append(sentence)
    return moves, changes, extra


def sample_prompt(seed: int, curriculum: Curriculum, progress: float, questions: int = 8,
                  families: tuple[str, ...] = FAMILIES) -> Prompt:
    """A training prompt at `progress` of the curriculum: its size is drawn from `seed` too."""
    (low, high), filler = curriculum.at(progress)
    rng = random.Random(seed ^ 0x5EED)
    # log-uniform number of documents: small prompts stay frequent as the range grows
    docs = int(round(math.exp(rng.uniform(math.log(low), math.log(high + 0.999))))) if high > low else low
    return make_prompt(seed, max(1, min(docs, high)), questions, rng.randint(0, filler), families)


def sample_text(seed: int, prompts: int = 200, families: tuple[str, ...] = FAMILIES) -> list[str]:
    """Text for training a tokenizer: documents and question / answer lines of many prompts."""
    out = []
    for s in range(prompts):
        prompt = make_prompt(seed * 1_000_003 + s, num_docs=1 + s % 12, filler=s % 4, families=families)
        out.extend(prompt.documents)
        out.extend(f"{q.text} {q.answer}" for q in prompt.questions)
    return out
