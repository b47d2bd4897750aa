"""One line from pydantic's report: the first problem by its field (renamed as the boundary names
it), the value where pydantic's own message lacks it, a whole-model check as its message alone."""

import random

import pytest
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from foundation.validation_error import InvalidSetting, describe


class Run(BaseModel):
    steps: int = Field(ge=1)
    warmup_steps: int = 0
    name: str = "run"

    @field_validator("name")
    @classmethod
    def _name(cls, value):
        if " " in value:
            raise ValueError(f"no spaces in a name, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds steps ({self.steps})")
        return self


def refusal(**fields) -> ValidationError:
    with pytest.raises(ValidationError) as error:
        Run(**fields)
    return error.value


def test_a_bound_names_the_field_and_the_value():
    steps = -random.randrange(1, 1000)
    assert describe(refusal(steps=steps)) == f"steps: Input should be greater than or equal to 1, got {steps}"


def test_a_validator_s_message_is_kept_and_the_field_renamed_by_the_boundary():
    error = refusal(steps=3, name="a b")
    assert describe(error, lambda field: "--" + field) == "--name: no spaces in a name, got 'a b'"


def test_a_check_of_the_whole_model_is_its_message_without_an_empty_name():
    warmup = random.randrange(6, 100)
    assert describe(refusal(steps=5, warmup_steps=warmup)) == f"warmup_steps ({warmup}) exceeds steps (5)"


def test_an_invalid_setting_is_one_line_with_its_field_apart():
    setting = InvalidSetting(refusal(steps=0, name="x y"))
    assert isinstance(setting, ValueError) and "\n" not in str(setting)
    assert (setting.field, str(setting)) == ("steps", f"steps: {setting.message}")
