"""``eagle3.errors.refusal``: a pydantic ValidationError of a record as one line naming where, the field path, what
is wrong (with the value given) and the fix."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

import pytest
from pydantic import BaseModel, Field, StrictInt, ValidationError, field_validator

from eagle3.errors import refusal


class Turn(BaseModel):
    role: Literal["user", "assistant"]
    tokens: Optional[list[Annotated[StrictInt, Field(ge=0)]]] = None


class Rec(BaseModel):
    id: str
    turns: Annotated[list[Turn], Field(min_length=1)]

    @field_validator("id")
    @classmethod
    def _no_space(cls, v: str) -> str:
        if " " in v:
            raise ValueError("has a space; ids are single words")
        return v


@pytest.mark.parametrize(
    "rec, line",
    [
        ([1], "f.jsonl:3: the record should be a JSON object, got list; fix it"),
        ({"turns": [{"role": "user"}]}, "f.jsonl:3: field 'id' is missing; fix it"),
        (
            {"id": "a", "turns": []},
            "f.jsonl:3: field 'turns' should hold at least 1 item(s), got []; fix it",
        ),
        ({"id": "a", "turns": "x"}, "f.jsonl:3: field 'turns' should be a list, got 'x'; fix it"),
        (
            {"id": "a", "turns": [{"role": "user", "tokens": [1, True]}]},
            "f.jsonl:3: field 'turns[0].tokens[1]' should be a valid integer, got True; fix it",
        ),
        (
            {"id": "a", "turns": [{"role": "bot"}]},
            "f.jsonl:3: field 'turns[0].role' should be 'user' or 'assistant', got 'bot'; fix it",
        ),
        (
            {"id": "a b", "turns": [{"role": "user"}]},
            "f.jsonl:3: field 'id' has a space; ids are single words; fix it",
        ),
        (
            {"id": "a", "turns": [{"role": "user", "tokens": [-1] * 40}]},
            "f.jsonl:3: field 'turns[0].tokens[0]' should be greater than or equal to 0, got -1; fix it",
        ),
    ],
)
def test_refusal_is_one_line_naming_the_field(rec, line):
    with pytest.raises(ValidationError) as e:
        Rec.model_validate(rec)
    assert str(refusal(e.value, "f.jsonl:3", "fix it")) == line


def test_a_long_value_is_cut_and_no_fix_adds_nothing():
    with pytest.raises(ValidationError) as e:
        Rec.model_validate({"id": "a", "turns": ["x" * 200]})
    msg = str(refusal(e.value, "f.jsonl:1"))
    assert msg == "f.jsonl:1: field 'turns[0]' should be a JSON object, got str"
    with pytest.raises(ValidationError) as e:
        Turn.model_validate({"role": "x" * 100})
    msg = str(refusal(e.value, "w"))
    assert msg.endswith("got '" + "x" * 56 + "...") and len(msg.split("got ")[1]) == 60
