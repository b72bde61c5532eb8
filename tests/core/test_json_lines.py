"""The one check of a loose-JSON line that every reader of such files shares."""

from __future__ import annotations

import pytest

from gpt2forge.core.json_lines import json_object, string_field


@pytest.mark.parametrize("raw", [b'{"text": "caf\xc3\xa9"}', '{"text": "café"}', '\ufeff{"text": "café"}',
                                 b'\xef\xbb\xbf{"text": "caf\xc3\xa9"}'])
def test_a_good_line_gives_its_object_as_bytes_or_text_with_or_without_a_bom(raw):
    assert json_object(raw) == ("", {"text": "café"})


@pytest.mark.parametrize("raw,problem", [
    (b'{"text": "caf\xe9"}', "invalid UTF-8 at byte 13 of the line"),
    ('{"text": oops}', "not valid JSON (Expecting value at column 10)"),
    ('["text"]', "a JSON list, not an object"),
    ("7", "a JSON int, not an object"),
])
def test_a_bad_line_is_named_and_gives_no_object(raw, problem):
    assert json_object(raw) == (problem, None)


def test_string_field_names_what_is_missing_or_of_the_wrong_type():
    assert string_field({"text": "a"}, "text") == ""
    assert string_field({"url": "u", "body": "b"}, "text") == "no 'text' field (fields: url, body)"
    assert string_field({}, "text") == "no 'text' field (fields: none)"
    assert string_field({"text": ["a"]}, "text") == "the 'text' field is a JSON list, not a string"
