"""The saved tensors a context still holds, counted once (saved/live_saves.py)."""

from __future__ import annotations

import gc

from daftrain.saved.live_saves import LiveSaves


class _Handle:
    """Stands in for a saved tensor's handle."""


def test_listeners_hear_when_the_first_is_held_and_the_last_released() -> None:
    heard: list[tuple[str, bool]] = []
    live = LiveSaves([lambda held: heard.append(("a", held)), lambda held: heard.append(("b", held))])
    handles = [_Handle(), _Handle()]
    live.hold(handles[0])
    live.hold(handles[1])
    assert heard == [("a", True), ("b", True)]  # once, on the first
    handles.pop()
    gc.collect()
    assert heard == [("a", True), ("b", True)]  # one still held
    handles.pop()
    gc.collect()
    assert heard == [("a", True), ("b", True), ("a", False), ("b", False)]
    live.hold(again := _Handle())
    assert heard[-2:] == [("a", True), ("b", True)]
    del again
    assert heard[-2:] == [("a", False), ("b", False)]
