"""Reading and checking a streamed /v1/responses answer, as a strict client would.

A Responses stream is Server-Sent Events `event: <type>\\ndata: <JSON of that type>`, with no
`data: [DONE]` at the end (OpenAI sends none): it ends with its terminal event,
`response.completed`, `response.incomplete` or `response.failed`, which carries the whole response.

`check_response_stream(raw)` asserts what a client may rely on and returns the events:
- every block is one `event:` line and one `data:` line, and the data's `type` is the event's name;
- `sequence_number` counts 0, 1, 2, ... in the order the events arrive;
- `response.created` and `response.in_progress` first, exactly one terminal event, last; no `error`;
- the items one at a time, in output order: `response.output_item.added`, the events of its type in
  their order (ITEM_EVENTS), `response.output_item.done`; every event names the open item
  (`item_id`, `output_index`, `content_index` 0);
- an item's deltas add up to its `.done` text and to the text of the item in `output_item.done`;
- the terminal response's `output` is the list of done items, its status the terminal event's,
  and its id and model those of `response.created`.
"""

from __future__ import annotations

import json
import re

TERMINAL = ("response.completed", "response.incomplete", "response.failed")
# an item's events between output_item.added and output_item.done: a regex over " type" each
ITEM_EVENTS = {
    "message": r" response\.content_part\.added( response\.output_text\.delta)* response\.output_text\.done "
               r"response\.content_part\.done",
    "reasoning": r"( response\.reasoning_text\.delta)* response\.reasoning_text\.done",
    "function_call": r"( response\.function_call_arguments\.delta)* response\.function_call_arguments\.done",
}
_DONE_TEXT = {"response.output_text.done": "text", "response.reasoning_text.done": "text",
              "response.function_call_arguments.done": "arguments"}


def parse_events(raw: bytes) -> list[dict]:
    """The events of a Responses stream; asserts each block is `event: T` + `data: {..."type": T}`."""
    events = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block[:300]
        event = json.loads(lines[1].removeprefix("data: "))
        assert event["type"] == lines[0].removeprefix("event: "), block[:300]
        events.append(event)
    return events


def check_response_stream(raw: bytes) -> list[dict]:
    """The events of `raw`, a whole Responses stream, after checking them all (module docstring)."""
    events = parse_events(raw)
    kinds = [event["type"] for event in events]
    assert [event["sequence_number"] for event in events] == list(range(len(events))), kinds
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:2]
    assert "error" not in kinds, events[kinds.index("error")]
    assert kinds[-1] in TERMINAL and not set(TERMINAL) & set(kinds[:-1]), kinds[-3:]
    items = replay_items(events[2:-1])
    created, final = events[0]["response"], events[-1]["response"]
    assert final["status"] == kinds[-1].removeprefix("response.") and created["status"] == "in_progress"
    assert (final["id"], final["model"]) == (created["id"], created["model"])
    assert final["output"] == items
    return events


def replay_items(events: list[dict]) -> list[dict]:
    """The items the events between `response.in_progress` and the terminal event build, one at a
    time; asserts each item's events are in order and its deltas add up to its text."""
    items: list[dict] = []
    i = 0
    while i < len(events):
        added = events[i]
        assert added["type"] == "response.output_item.added", added["type"]
        end = next((j for j in range(i + 1, len(events)) if events[j]["type"] == "response.output_item.done"), None)
        assert end is not None, f"item {len(items)} is never done"
        items.append(_checked_item(added, events[i + 1:end], events[end], len(items)))
        i = end + 1
    return items


def _checked_item(added: dict, inner: list[dict], done: dict, index: int) -> dict:
    item = added["item"]
    pattern = ITEM_EVENTS.get(item["type"])
    assert pattern is not None, f"an item of type {item['type']!r}"
    kinds = "".join(f" {event['type']}" for event in inner)
    assert re.fullmatch(pattern, kinds), (item["type"], kinds)
    for event in (added, *inner, done):
        assert event["output_index"] == index, (event["type"], event["output_index"], index)
    for event in inner:
        assert event["item_id"] == item["id"] and event.get("content_index", 0) == 0, event
    text = "".join(event["delta"] for event in inner if event["type"].endswith(".delta"))
    closing = next(event for event in inner if event["type"] in _DONE_TEXT)
    assert closing[_DONE_TEXT[closing["type"]]] == text, (closing, text)
    final = done["item"]
    assert (final["id"], final["type"]) == (item["id"], item["type"])
    assert _item_text(final) == text, (final, text)
    return final


def _item_text(item: dict) -> str:
    if item["type"] == "function_call":
        return item["arguments"]
    return "".join(part["text"] for part in item["content"])
