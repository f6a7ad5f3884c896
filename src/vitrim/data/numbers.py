"""English number words -> German and French number words, from ``num2words``, with a known word alignment.

A real translation task whose every sentence is written by a maintained library (``num2words``, the text is
its output, never edited) and whose word alignment is known, so that a model's cross-attention can be scored.

Tokens (``tokenize``; ``detokenize`` gives back num2words' exact string, checked for every pair built):

* English: words, "-" and "," are tokens: "two thousand, three hundred and forty-five" ->
  ``two thousand , three hundred and forty - five``.
* German: one word is split into its morphemes (longest match over the 31 morphemes in ``GERMAN_MORPHEMES``):
  "zweitausenddreihundertfünfundvierzig" -> ``zwei tausend drei hundert fünf und vierzig``. Teens ("dreizehn")
  and tens ("zwanzig") stay whole: each is one English word too. Detokenized by joining without spaces.
* French: words and "-": "quatre-vingt-dix-sept" -> ``quatre - vingt - dix - sept``.

Alignment rule (``align``): every number n = 1000·t + 100·h + r (r < 100) has up to three groups, written in
the same order in all three languages: thousands (t), hundreds (h), rest (r). Each token gets a role within its
group, and a target token is aligned to the English token of the same group and role:

* ``digit`` (the word before thousand/hundred: "two" / "zwei" / "deux") and ``word`` ("thousand" / "tausend" /
  "mille", "hundred" / "hundert" / "cent(s)"). French writes 1000 "mille" and 100 "cent" with no digit word, so
  English "one" there is aligned to nothing.
* in the rest r: ``units`` (1-9), ``teen`` (10-19), ``tens`` (20, 30, … 90) and ``connector``. English writes
  r = 45 as ``forty - five`` (tens, connector, units); German as ``fünf und vierzig`` (units, connector, tens),
  so the alignment crosses; "und" is aligned to the hyphen, the English token that joins tens and units.
  French ``vingt et un`` aligns "et" to the hyphen as well.
* French tens are built from several words, all aligned to the one English tens word: soixante-dix (70) and
  quatre-vingt-dix (90) ↔ "seventy" / "ninety". The last word of a French rest r ≥ 20 that is not a round ten
  is its units word and is aligned to the English units word, also when it is a teen: 71 "soixante et onze" ->
  soixante ↔ seventy, et ↔ "-", onze ↔ one; 97 "quatre-vingt-dix-sept" -> quatre, vingt, dix ↔ ninety,
  sept ↔ seven. For r in 17-19 ("dix-sept") both words are aligned to the one English teen word.
* French "-" tokens are spelling, not words: aligned to nothing (``None``) and not scored. English "and" and ","
  have no counterpart and are simply never aligned to.

Every target token except French hyphens has exactly one aligned source token; ``build_pairs`` checks it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vitrim.data.digits import check_test_fraction

LANGUAGES = ("de", "fr")
SOURCE_LANGUAGE = "en"
PAD, EOS = "<pad>", "<eos>"
# the decoder's first input names the language to write (one model translates into both)
LANGUAGE_TAGS = {lang: f"<{lang}>" for lang in LANGUAGES}

GERMAN_MORPHEMES = (
    "ein", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun",
    "zehn", "elf", "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn",
    "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig",
    "und", "hundert", "tausend",
)  # fmt: skip
_GERMAN_SPLIT = re.compile("|".join(sorted(GERMAN_MORPHEMES, key=len, reverse=True)))  # longest match first
_WORDS = re.compile(r"[^\s,-]+|[,-]")

Role = tuple[str, str]  # (group: "thousands" | "hundreds" | "rest", role within the group)


@dataclass(frozen=True)
class Pair:
    """One sentence pair: the number, its English and target tokens, and the alignment of each target token."""

    number: int
    lang: str
    source: tuple[str, ...]
    target: tuple[str, ...]
    alignment: tuple[int | None, ...]  # per target token: index of its English token, None = not scored ("-")


def words(number: int, lang: str) -> str:
    """num2words' text for ``number`` in ``lang`` ("en", "de" or "fr")."""
    from num2words import num2words

    return str(num2words(number, lang=lang))


def tokenize(text: str, lang: str) -> list[str]:
    """Split a sentence into the task's tokens (module doc). Raises if German text has a non-morpheme part."""
    _check_lang(lang, (SOURCE_LANGUAGE, *LANGUAGES))
    if lang != "de":
        return _WORDS.findall(text)
    tokens = _GERMAN_SPLIT.findall(text)
    if "".join(tokens) != text:
        raise ValueError(f"German text {text!r} is not a sequence of the known morphemes {GERMAN_MORPHEMES}")
    return tokens


def detokenize(tokens: Sequence[str], lang: str) -> str:
    """The inverse of :func:`tokenize`: German morphemes are joined, French hyphens bind their neighbours."""
    _check_lang(lang, (SOURCE_LANGUAGE, *LANGUAGES))
    if lang == "de":
        return "".join(tokens)
    return " ".join(tokens).replace(" - ", "-").replace(" ,", ",")


def roles(number: int, tokens: Sequence[str], lang: str) -> list[Role | None]:
    """The (group, role) of each token of ``number``'s sentence in ``lang`` (module doc); None: not aligned.

    Raises ValueError when the tokens do not have the structure of ``number`` (num2words changed its spelling).
    """
    t, h, r = number // 1000, number // 100 % 10, number % 100
    out: list[Role | None] = []
    rest = list(tokens)

    def take(group: str, word: str, has_digit: bool) -> None:
        if has_digit:
            out.append((group, "digit"))
            rest.pop(0)
        if not rest or not rest[0].startswith(word):
            raise ValueError(f"{lang} tokens {list(tokens)} of {number}: expected {word!r} in the {group}")
        out.append((group, "word"))
        rest.pop(0)
        while lang == SOURCE_LANGUAGE and rest and rest[0] in (",", "and"):
            out.append(None)
            rest.pop(0)

    if not 1 <= number <= 9999:
        raise ValueError(f"number must be in [1, 9999], got {number}")
    thousand, hundred = {"en": ("thousand", "hundred"), "de": ("tausend", "hundert"), "fr": ("mille", "cent")}[lang]
    if t:
        take("thousands", thousand, has_digit=lang != "fr" or t > 1)
    if h:
        take("hundreds", hundred, has_digit=lang != "fr" or h > 1)
    if r:
        out.extend(_rest_roles(r, rest, lang, number))
    elif rest:
        raise ValueError(f"{lang} tokens {list(tokens)} of {number}: unexpected {rest} after the hundreds")
    return out


def _rest_roles(r: int, tokens: list[str], lang: str, number: int) -> list[Role | None]:
    """Roles of the tokens that write r = number % 100 (1 … 99)."""
    words_at = [i for i, tok in enumerate(tokens) if tok != "-"]
    roles_: list[Role | None] = [None] * len(tokens)
    if r < 20 or r % 10 == 0:
        kind = "units" if r < 10 else "teen" if r < 20 else "tens"
        for i in words_at:
            roles_[i] = ("rest", kind)
    elif lang == "de":  # fünf und vierzig
        if tokens[1:2] != ["und"] or len(tokens) != 3:
            raise ValueError(f"de tokens {tokens} of {number}: expected 'units und tens'")
        roles_ = [("rest", "units"), ("rest", "connector"), ("rest", "tens")]
    elif lang == "en":  # forty - five
        if tokens[1:2] != ["-"] or len(tokens) != 3:
            raise ValueError(f"en tokens {tokens} of {number}: expected 'tens - units'")
        roles_ = [("rest", "tens"), ("rest", "connector"), ("rest", "units")]
    else:  # fr: quarante - cinq, vingt et un, soixante et onze, quatre - vingt - dix - sept
        if len(words_at) < 2:
            raise ValueError(f"fr tokens {tokens} of {number}: expected tens words then a units word")
        *head, last = words_at
        roles_[last] = ("rest", "units")
        for i in head:
            roles_[i] = ("rest", "connector" if tokens[i] == "et" else "tens")
    if not words_at:
        raise ValueError(f"{lang} tokens {tokens} of {number}: no word for {r}")
    return roles_


def align(source_roles: Sequence[Role | None], target_roles: Sequence[Role | None]) -> list[int | None]:
    """For each target token, the index of the English token with the same (group, role); None stays None."""
    where = {role: i for i, role in enumerate(source_roles) if role is not None}
    missing = [role for role in target_roles if role is not None and role not in where]
    if missing:
        raise ValueError(f"target roles {missing} have no English token (source roles {list(source_roles)})")
    return [None if role is None else where[role] for role in target_roles]


def make_pair(number: int, lang: str, source_text: str | None = None) -> Pair:
    """Build and check one pair: tokens round-trip to num2words' text, every scored token is aligned.

    ``source_text``: the English text if already known (num2words is the slow part of building the data).
    """
    _check_lang(lang, LANGUAGES)
    source_text = words(number, SOURCE_LANGUAGE) if source_text is None else source_text
    target_text = words(number, lang)
    source, target = tokenize(source_text, SOURCE_LANGUAGE), tokenize(target_text, lang)
    for text, tokens, code in ((source_text, source, SOURCE_LANGUAGE), (target_text, target, lang)):
        if detokenize(tokens, code) != text:
            raise ValueError(f"{code} tokens {tokens} of {number} do not give back num2words' {text!r}")
    alignment = align(roles(number, source, SOURCE_LANGUAGE), roles(number, target, lang))
    return Pair(number, lang, tuple(source), tuple(target), tuple(alignment))


def build_pairs(numbers: Iterable[int], languages: Sequence[str] = LANGUAGES) -> list[Pair]:
    """Every (number, language) pair, numbers in the given order, languages inner."""
    pairs: list[Pair] = []
    for n in numbers:
        english = words(n, SOURCE_LANGUAGE)
        pairs.extend(make_pair(n, lang, english) for lang in languages)
    return pairs


_UNITS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
_TEENS = ["ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_VALUES = {**{w: i + 1 for i, w in enumerate(_UNITS)}, **{w: i + 10 for i, w in enumerate(_TEENS)},
           **{w: 10 * (i + 2) for i, w in enumerate(_TENS)}}  # fmt: skip


def number_of(source: Sequence[str]) -> int | None:
    """The number 1 … 9999 whose English tokens are exactly ``source``, or None (then no alignment is known)."""
    total = group = 0
    for token in source:
        if token in _VALUES:
            group += _VALUES[token]
        elif token == "hundred":
            group *= 100
        elif token == "thousand":
            total, group = total + group * 1000, 0
        elif token not in ("-", ",", "and"):
            return None
    number = total + group
    if not 1 <= number <= 9999 or tokenize(words(number, SOURCE_LANGUAGE), SOURCE_LANGUAGE) != list(source):
        return None
    return number


def split_numbers(max_number: int, test_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A fixed, seeded split of 1 … ``max_number`` into train and test numbers (sorted; no number in both).

    Both languages share the split, so a held-out number is never seen in any language.
    """
    if isinstance(max_number, bool) or not isinstance(max_number, int) or not 10 <= max_number <= 9999:
        raise ValueError(f"max_number must be an int in [10, 9999], got {max_number!r}")
    test_fraction = check_test_fraction(test_fraction)
    numbers = list(range(1, max_number + 1))
    random.Random(seed).shuffle(numbers)
    num_test = max(1, round(test_fraction * len(numbers)))
    return sorted(numbers[num_test:]), sorted(numbers[:num_test])


class Vocab:
    """Tokens <-> ids. Special tokens come first, in the order given (``<pad>`` must be id 0)."""

    def __init__(self, tokens: Iterable[str], specials: Sequence[str] = (PAD,), name: str = "vocabulary") -> None:
        if not specials or specials[0] != PAD:
            raise ValueError(f"specials must start with {PAD!r} (id 0), got {list(specials)}")
        self.name = name
        self.tokens: list[str] = list(dict.fromkeys([*specials, *sorted(set(tokens) - set(specials))]))
        self.index = {tok: i for i, tok in enumerate(self.tokens)}
        self.num_specials = len(specials)

    def __len__(self) -> int:
        return len(self.tokens)

    def __contains__(self, token: object) -> bool:
        return token in self.index

    def id(self, token: str) -> int:
        if token not in self.index:
            known = " ".join(repr(tok) for tok in self.tokens[self.num_specials :])
            raise ValueError(f"word {token!r} is out of vocabulary for the {self.name}; known words: {known}")
        return self.index[token]

    def encode(self, tokens: Iterable[str]) -> list[int]:
        return [self.id(tok) for tok in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.tokens[i] for i in ids]


def _check_lang(lang: str, allowed: Sequence[str]) -> None:
    if lang not in allowed:
        raise ValueError(f"lang must be one of {list(allowed)}, got {lang!r}")
