"""The digits VLM's training conversations (``train.conversation_batch``): every turn is a question of its canvas with
its answer, the loss falls on the answers and their ``<eos>`` only, and with ``one_kind`` a conversation never asks
both "which" and "where" (an answer of one kind would give away answers of the other in the text, issue 44)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from vitrim.vlm_demo.data import DigitsScenes
from vitrim.vlm_demo.train import conversation_batch
from vitrim.vlm_demo.words import BOS_ID, EOS_ID, IMAGE_ID, PAD_ID, WORDS

KIND_OF_FIRST_WORD = {"which": "which", "where": "where", "how": "count"}


def _turns(ids: list[int], labels: list[int]) -> list[tuple[str, str]]:
    """(question, answer) texts of one left-padded row, read back by hand: the words after the image, split at each
    ``<eos>``, the answer being the words that carry a label."""
    start = max(i for i, t in enumerate(ids) if t == IMAGE_ID) + 1
    assert ids[start - 65] == BOS_ID and all(t == PAD_ID for t in ids[: start - 65])
    turns, question, answer = [], [], []
    for token, label in zip(ids[start:], labels[start:]):
        if token == EOS_ID:
            assert label == EOS_ID
            turns.append((" ".join(question), " ".join(answer)))
            question, answer = [], []
        elif label == -100:
            assert not answer, "a question word after an answer word, before <eos>"
            question.append(WORDS[token])
        else:
            assert label == token
            answer.append(WORDS[token])
    assert not question and not answer
    return turns


@pytest.mark.parametrize("one_kind", [False, True])
def test_every_turn_is_a_question_of_its_canvas_with_its_answer(one_kind: bool) -> None:
    scenes = DigitsScenes("train", 24, seed=1)
    indices = list(range(24))
    batch = conversation_batch(scenes, indices, order_seed=5, one_kind=one_kind)
    kinds_seen = set()
    for row, index in enumerate(indices):
        canvas = scenes.canvas(index)
        every = {" ".join(q.words): " ".join(q.answer) for q in [*scenes.drill(index, canvas), *scenes.questions(index)]}
        turns = _turns(batch["input_ids"][row].tolist(), batch["labels"][row].tolist())
        assert all(every[q] == a for q, a in turns)  # each question asked is the canvas's, answered right
        assert len({q for q, _ in turns}) == len(turns)  # no question twice
        kinds = {KIND_OF_FIRST_WORD[q.split()[0]] for q, _ in turns}
        if one_kind:
            assert "count" in kinds and not {"which", "where"} <= kinds
            kinds_seen |= kinds
            asked = {q for q in every if KIND_OF_FIRST_WORD[q.split()[0]] in kinds}
        else:
            assert kinds == {"which", "where", "count"}
            asked = set(every)
        assert {q for q, _ in turns} == asked  # every question of the kinds asked
    if one_kind:
        assert kinds_seen == {"which", "where", "count"}
