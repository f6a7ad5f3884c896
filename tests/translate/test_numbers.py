"""The number-translation data: num2words' text, its tokens, the alignment rule, the split, the vocabulary."""

from __future__ import annotations

import pytest

from vitrim.data.numbers import (
    GERMAN_MORPHEMES,
    Vocab,
    build_pairs,
    detokenize,
    make_pair,
    split_numbers,
    tokenize,
    words,
)


def aligned(number: int, lang: str) -> list[tuple[str, str | None]]:
    pair = make_pair(number, lang)
    return [(tok, None if j is None else pair.source[j]) for tok, j in zip(pair.target, pair.alignment)]


def test_the_text_is_num2words_own() -> None:
    assert words(21, "en") == "twenty-one"
    assert words(21, "de") == "einundzwanzig"
    assert words(97, "fr") == "quatre-vingt-dix-sept"
    assert words(2345, "en") == "two thousand, three hundred and forty-five"


def test_german_twenty_one_crosses() -> None:
    """The issue's example: "twenty-one" -> "ein und zwanzig", units first, so the alignment runs backwards."""
    pair = make_pair(21, "de")
    assert pair.source == ("twenty", "-", "one")
    assert pair.target == ("ein", "und", "zwanzig")
    assert pair.alignment == (2, 1, 0)


@pytest.mark.parametrize(
    ("number", "lang", "expected"),
    [
        (2345, "de", [("zwei", "two"), ("tausend", "thousand"), ("drei", "three"), ("hundert", "hundred"),
                      ("fünf", "five"), ("und", "-"), ("vierzig", "forty")]),
        (101, "de", [("ein", "one"), ("hundert", "hundred"), ("eins", "one")]),
        (17, "de", [("siebzehn", "seventeen")]),
        (97, "fr", [("quatre", "ninety"), ("-", None), ("vingt", "ninety"), ("-", None), ("dix", "ninety"),
                    ("-", None), ("sept", "seven")]),
        (71, "fr", [("soixante", "seventy"), ("et", "-"), ("onze", "one")]),
        (17, "fr", [("dix", "seventeen"), ("-", None), ("sept", "seventeen")]),
        (1100, "fr", [("mille", "thousand"), ("cent", "hundred")]),
        (280, "fr", [("deux", "two"), ("cent", "hundred"), ("quatre", "eighty"), ("-", None), ("vingts", "eighty")]),
    ],
)  # fmt: skip
def test_alignment_rule_by_hand(number: int, lang: str, expected: list[tuple[str, str | None]]) -> None:
    assert aligned(number, lang) == expected


def check_round_trips_and_alignment(pairs: list) -> None:
    """Tokens give back num2words' text; only French hyphens are unaligned, and nothing aligns to 'and' or ','."""
    for p in pairs:
        assert detokenize(p.target, p.lang) == words(p.number, p.lang)
        assert detokenize(p.source, "en") == words(p.number, "en")
        for tok, j in zip(p.target, p.alignment):
            assert (j is None) == (tok == "-"), (p.number, p.lang, tok)
            if j is not None:
                assert p.source[j] not in ("and", ",")


def test_a_spread_of_pairs_round_trips_and_every_word_is_aligned() -> None:
    """Every 37th number of 1 … 9999 and the edges of each order of magnitude (the whole range: make test-all)."""
    numbers = sorted({*range(1, 10000, 37), *(n + d for n in (1, 10, 100, 1000) for d in (-1, 0, 1, 20, 21)), 9999})
    pairs = build_pairs([n for n in numbers if 1 <= n <= 9999])
    check_round_trips_and_alignment(pairs)
    crossing = [p for p in pairs if p.lang == "de" and p.number % 100 > 20 and p.number % 10]
    assert crossing and all(p.alignment[-3] > p.alignment[-1] for p in crossing)  # German units before tens


@pytest.mark.full  # 23 s on the shared machine
def test_every_pair_round_trips_and_every_word_is_aligned() -> None:
    """All 1 … 9999 in both languages: tokens give back num2words' text; only French hyphens are unaligned."""
    pairs = build_pairs(range(1, 10000))
    assert len(pairs) == 2 * 9999
    check_round_trips_and_alignment(pairs)
    german = {tok for p in pairs if p.lang == "de" for tok in p.target}
    assert german == set(GERMAN_MORPHEMES)
    # the German rest r ≥ 21 that is not a round ten always crosses: units before tens
    crossing = [p for p in pairs if p.lang == "de" and p.number % 100 > 20 and p.number % 10]
    assert len(crossing) == 72 * 100  # r in 21 … 99, not a round ten: 72 in each hundred of 0 … 9999
    for p in crossing:
        assert p.alignment[-3] > p.alignment[-1]


def test_tokenize_refuses_german_that_is_not_made_of_morphemes() -> None:
    with pytest.raises(ValueError, match="'einundzwanzigx' is not a sequence of the known morphemes"):
        tokenize("einundzwanzigx", "de")
    with pytest.raises(ValueError, match="lang must be one of"):
        tokenize("one", "es")


def test_split_is_fixed_disjoint_and_complete() -> None:
    train, test = split_numbers(9999, 0.2, seed=0)
    assert not set(train) & set(test)
    assert sorted(train + test) == list(range(1, 10000))
    assert len(test) == 2000
    assert split_numbers(9999, 0.2, seed=0) == (train, test)
    assert split_numbers(9999, 0.2, seed=1)[1] != test
    with pytest.raises(ValueError, match="max_number must be an int in \\[10, 9999\\], got 10000"):
        split_numbers(10000, 0.2, 0)


def test_every_test_token_is_seen_in_training() -> None:
    train, test = split_numbers(9999, 0.2, seed=0)
    seen = {tok for p in build_pairs(train) for tok in (*p.source, *p.target)}
    assert {tok for p in build_pairs(test) for tok in (*p.source, *p.target)} <= seen


def test_vocab_names_an_unknown_word() -> None:
    vocab = Vocab(["one", "two"], name="English source")
    assert vocab.encode(["two", "one"]) == [2, 1]
    assert vocab.decode([1, 2]) == ["one", "two"]
    with pytest.raises(
        ValueError, match="word 'tree' is out of vocabulary for the English source; known words: 'one' 'two'"
    ):
        vocab.id("tree")
