"""The demo's scores against hand counts: exact match, chrF (sacrebleu itself), alignment hits, layer choice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sacrebleu
import torch

from vitrim.data.numbers import build_pairs
from vitrim.demos.translate.task import Batch, build_vocabs, encode_pairs, strip
from vitrim.demos.translate.train import alignment_hits, translation_scores


@pytest.fixture(scope="module")
def batch():
    pairs = build_pairs([21, 97])  # 21 de, 21 fr, 97 de, 97 fr
    source, target = build_vocabs(pairs)
    return encode_pairs(pairs, source, target), target


def test_batch_rows_are_tag_tokens_eos(batch) -> None:
    data, vocab = batch
    assert vocab.decode(data.tgt[0].tolist()) == [
        "<de>",
        "ein",
        "und",
        "zwanzig",
        "<eos>",
        "<pad>",
        "<pad>",
        "<pad>",
        "<pad>",
    ]
    assert strip(data.tgt[0, 1:].tolist(), vocab) == ["ein", "und", "zwanzig"]
    src, tgt = data.select(torch.tensor([0, 2]))  # German only: trimmed to the longest of the two
    assert src.shape == (2, 3) and tgt.shape == (2, 5)


def test_exact_match_and_chrf(batch) -> None:
    data, _ = batch
    hypotheses = [list(p.target) for p in data.pairs]
    hypotheses[3] = ["quatre", "-", "vingt", "-", "dix", "-", "huit"]  # 98 for 97, in French
    scores = translation_scores(data, hypotheses)
    assert scores["exact_match"] == 0.75 and scores["de"]["exact_match"] == 1.0 and scores["fr"]["exact_match"] == 0.5
    expected = sacrebleu.corpus_chrf(["vingt et un", "quatre-vingt-dix-huit"],
                                     [["vingt et un", "quatre-vingt-dix-sept"]]).score  # fmt: skip
    assert scores["fr"]["chrf"] == pytest.approx(expected)
    assert scores["de"]["chrf"] == pytest.approx(100.0)


def one_hot_maps(looked: list[list[int]], lengths: list[int], layers: int = 2) -> list[list[torch.Tensor]]:
    """Per sentence, ``layers`` maps (H=2, rows, Ls) whose head-mean argmax of row i is ``looked[i]``."""
    maps = []
    for rows, ls in zip(looked, lengths):
        m = torch.zeros(2, len(rows), ls)
        for i, j in enumerate(rows):
            m[0, i, j], m[1, i, j] = 0.7, 0.4  # head 1 splits its weight, the mean still peaks at j
            m[1, i, (j + 1) % ls] = 0.6
        maps.append([m] * layers)
    return maps


def test_alignment_hits_count_by_hand(batch) -> None:
    data, _ = batch
    # 21 de: ein->one(2) und->-(1) zwanzig->twenty(0); 21 fr: vingt->0, et->1, un->2
    # 97 de: sieben->seven(2), und->1, neunzig->0; 97 fr: quatre, vingt, dix -> ninety(0), '-' unscored, sept->2
    looked = [
        [2, 1, 0, 1],  # all right (the last row, <eos>, is never scored)
        [0, 0, 2, 0],  # et wrong: 2 of 3
        [0, 1, 0, 0],  # sieben wrong: 2 of 3
        [0, 1, 0, 2, 2, 0, 2, 0],  # quatre, vingt right, dix wrong (row 4), sept right: 3 of 4
    ]
    maps = one_hot_maps(looked, [3, 3, 3, 3])
    assert alignment_hits(maps, data, layer=1) == (3 + 2 + 2 + 3, 3 + 3 + 3 + 4)


def test_layer_is_chosen_on_train_never_on_test(batch, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0 aligns on the training pairs, layer 1 on the test pairs: the score must be layer 0's, on test."""
    import vitrim.demos.translate.train as train_module

    data, _ = batch
    test = Batch(data.src, data.tgt, list(data.pairs))  # the same pairs, another object: "the test split"

    def fake_maps(model: object, subset: Batch, chunk: int = 512) -> list[list[torch.Tensor]]:
        right = [[0 if j is None else j for j in p.alignment] + [0] for p in subset.pairs]
        wrong = [[(j + 1) % 3 for j in rows] for rows in right]
        good, bad = one_hot_maps(right, [3] * len(right), 1), one_hot_maps(wrong, [3] * len(right), 1)
        first, second = (bad, good) if subset is test else (good, bad)
        return [[x[0], y[0]] for x, y in zip(first, second)]

    monkeypatch.setattr(train_module, "cross_attention", fake_maps)
    model = SimpleNamespace(config=SimpleNamespace(decoder_depth=2))
    scores = train_module.alignment_scores(model, data, test, train_sample=4)  # type: ignore[arg-type]
    assert scores["alignment_train_by_layer"] == [1.0, 0.0]
    assert scores["alignment_test_by_layer"] == [0.0, 1.0]
    assert scores["alignment_layer"] == 0 and scores["alignment_accuracy"] == 0.0
