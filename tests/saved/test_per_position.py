"""Choices kept per forward position (saved/per_position.py): made once, kept while the key holds, made again
when it changes or after REESTIMATE_STEPS steps."""

from __future__ import annotations

from daftrain.saved.per_position import REESTIMATE_STEPS, PerPosition


def test_a_choice_is_kept_until_its_key_changes_or_it_is_due() -> None:
    made: list[int] = []
    choices: PerPosition[int] = PerPosition()

    def make(value: int):  # type: ignore[no-untyped-def]
        return lambda: made.append(value) or value

    assert choices.get(0, 3, "a", make(1)) == 1
    assert choices.get(REESTIMATE_STEPS - 1, 3, "a", make(2)) == 1  # kept
    assert choices.get(0, 4, "a", make(3)) == 3  # another position
    assert choices.get(1, 3, "b", make(4)) == 4  # its key changed
    assert choices.get(1 + REESTIMATE_STEPS, 3, "b", make(5)) == 5  # due again
    assert made == [1, 3, 4, 5]


def test_a_choice_of_none_is_kept_too() -> None:
    # a position whose fitted grid or column layout came out as None (the plain one) is not made again each step
    made: list[int] = []
    choices: PerPosition[int | None] = PerPosition()
    assert choices.get(0, 0, "a", lambda: made.append(0)) is None
    assert choices.get(1, 0, "a", lambda: made.append(1)) is None
    assert made == [0]


def test_a_noted_value_is_known_while_recent() -> None:
    noted: PerPosition[bool] = PerPosition()
    assert noted.known(0, 2, "a") is None
    noted.note(5, 2, "a", True)
    assert noted.known(5 + REESTIMATE_STEPS - 1, 2, "a") is True
    assert noted.known(5 + REESTIMATE_STEPS, 2, "a") is None  # due again
    assert noted.known(6, 2, "b") is None  # another key
