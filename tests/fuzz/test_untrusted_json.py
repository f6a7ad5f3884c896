"""vitrim.untrusted: JSON from files is parsed as data, and a hostile file ends in one ValueError naming it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitrim.untrusted import MAX_JSON_DEPTH, expect_object, parse_json, read_json

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(JSON_VALUES)
def test_valid_json_parses_as_the_standard_parser_does(value: object) -> None:
    text = json.dumps(value)
    assert parse_json(text, "f.json") == json.loads(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested 100000 levels deep"),
        ('{"mean": [NaN, 0, 0]}', "non-finite number NaN"),
        ('{"std": Infinity}', "non-finite number Infinity"),
        ('{"n": -Infinity}', "non-finite number -Infinity"),
        (b"\xff\xfe{}", "not UTF-8"),
        ('{"a": 1', "not valid JSON"),
        ("", "not valid JSON"),
    ],
)
def test_hostile_json_is_one_value_error_naming_the_file(text: str | bytes, expected: str) -> None:
    with pytest.raises(ValueError, match="^config.json: .*" + expected):
        parse_json(text, "config.json")


def test_depth_limit_counts_brackets_outside_strings_only() -> None:
    assert parse_json(json.dumps({"s": "[" * 1000}), "f") == {"s": "[" * 1000}
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(nested, "f") == json.loads(nested)
    with pytest.raises(ValueError, match="nested 65 levels"):
        parse_json("[" + nested + "]", "f")


def test_read_json_and_expect_object(tmp_path) -> None:
    path = tmp_path / "run.json"
    path.write_text("[]")
    with pytest.raises(ValueError, match=r"run.json: expected a JSON object, got list \[\]"):
        expect_object(read_json(path), "run.json")
    path.write_text('{"data": "x"}')
    assert expect_object(read_json(path), "run.json") == {"data": "x"}
