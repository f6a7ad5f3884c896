"""vitrim.vllm.selection_record: the record of what a served model kept is kept only when asked for
(``VITRIM_VLLM_RECORD=1``, which tests/vllm/conftest.py sets), so a served model does not hash every image's pixels.
No engine: the record and the switch alone."""

from __future__ import annotations

import pytest
import torch

from vitrim.vllm.selection_record import RECORD_ENV, SelectionRecord, recorded_selections, recording


def test_the_record_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RECORD_ENV, raising=False)
    assert not recording()
    with pytest.raises(RuntimeError, match=f"vitrim: selections are recorded only with {RECORD_ENV}=1"):
        recorded_selections(object())  # refused before the engine is asked
    monkeypatch.setenv(RECORD_ENV, "0")
    assert not recording()
    monkeypatch.setenv(RECORD_ENV, "1")
    assert recording()


def test_add_all_keeps_each_image_under_its_seed_and_nothing_without_seeds() -> None:
    record = SelectionRecord()
    record.add_all(None, [torch.tensor([0, 2])])  # not recording: the family passes no seeds
    assert record.as_dict() == {}
    record.add_all(torch.tensor([11, 7]), [torch.tensor([0, 2]), torch.tensor([1])])
    assert record.as_dict() == {11: [0, 2], 7: [1]}
    with pytest.raises(ValueError):  # one kept list per seed
        record.add_all(torch.tensor([1, 2]), [torch.tensor([0])])
