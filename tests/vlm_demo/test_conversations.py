"""The digits VLM's training conversations (``train.conversation_batch``): every turn is a question of its canvas with
its answer, the loss falls on the answers and their ``<eos>`` only, and a conversation asks every question its canvas
answers."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from vitrim.demos.vlm.data import DigitsScenes
from vitrim.demos.vlm.train import conversation_batch
from vitrim.demos.vlm.words import BOS_ID, EOS_ID, IMAGE_ID, PAD_ID, WORDS

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


def test_every_turn_is_a_question_of_its_canvas_with_its_answer() -> None:
    scenes = DigitsScenes("train", 24, seed=1)
    indices = list(range(24))
    batch = conversation_batch(scenes, indices, order_seed=5)
    orders = set()
    for row, index in enumerate(indices):
        canvas = scenes.canvas(index)
        asked = [*scenes.drill(index, canvas), *scenes.questions(index)]
        every = {" ".join(q.words): " ".join(q.answer) for q in asked}
        turns = _turns(batch["input_ids"][row].tolist(), batch["labels"][row].tolist())
        assert all(every[q] == a for q, a in turns)  # each question asked is the canvas's, answered right
        assert len({q for q, _ in turns}) == len(turns)  # no question twice
        assert {q for q, _ in turns} == set(every)  # every question of the canvas, "which digit ?" where asked
        orders.add(tuple(KIND_OF_FIRST_WORD[q.split()[0]] for q, _ in turns))
    assert len(orders) > 12  # the kinds come in a random order
