"""Pure translation functions of the OpenAI dialect, table-driven."""

from __future__ import annotations

import pytest

from blazar.admission import HeaderError, schedule
from dialects.openai.translate import structured_output_receipt
from dialects.wire import (
    ChatStreamRewriter,
    RequestError,
    ThinkFilter,
    bridge_reasoning,
    check_choices,
    strip_think_text,
    thinking_requested,
)


@pytest.mark.parametrize(("chunks", "expected"), [
    (["<think>abc</think>Hello"], "Hello"),
    (["<thi", "nk>abc</th", "ink>  Hel", "lo"], "Hello"),
    (["Hello <", "b>world"], "Hello <b>world"),
    (["no tags at all"], "no tags at all"),
    (["<think>never closed"], ""),
    (["a<think>x</think>b<think>y</think>c"], "abc"),
    (["ends with <", "/"], "ends with </"),
])
def test_think_filter_across_chunk_boundaries(chunks, expected):
    think = ThinkFilter()
    assert "".join(think.feed(c) for c in chunks) + think.flush() == expected


def test_buffered_strip():
    assert strip_think_text("<think>\nplan\n</think>\n\nAnswer") == "Answer"


@pytest.mark.parametrize(("body", "asked"), [
    ({}, False), ({"think": True}, True), ({"enable_thinking": True}, True),
    ({"chat_template_kwargs": {"enable_thinking": True}}, True), ({"reasoning_effort": "off"}, False),
    ({"reasoning_effort": "low"}, True), ({"chat_template_kwargs": {"enable_thinking": False}}, False),
])
def test_thinking_opt_ins(body, asked):
    assert thinking_requested(body) is asked


def test_reasoning_effort_is_bridged_and_the_request_value_wins():
    bridged = bridge_reasoning({"reasoning_effort": "high",
                                "chat_template_kwargs": {"reasoning_effort": "low", "x": 1}})
    assert bridged["chat_template_kwargs"] == {"reasoning_effort": "high", "x": 1}
    assert bridge_reasoning({"a": 1}) == {"a": 1}


@pytest.mark.parametrize(("n", "message"), [
    (0, "from 1 to 8"), (9, "from 1 to 8"), ("2", "from 1 to 8"), (True, "from 1 to 8"), (3, "at most 2 choices"),
])
def test_n_validation(n, message):
    with pytest.raises(RequestError, match=message) as caught:
        check_choices({"n": n}, lane="llamacpp", ceiling=2)
    assert caught.value.param == "n"


def test_structured_output_receipts():
    assert structured_output_receipt({"response_format": {"type": "json_schema", "json_schema": {}}}) == "json_schema"
    assert structured_output_receipt({"response_format": {"type": "json_object"}}) == "json_object"
    assert structured_output_receipt({"response_format": {"type": "text"}}) is None
    assert structured_output_receipt({"grammar": "root ::= \"a\""}) == "gbnf"


def test_stream_rewriter_keeps_events_it_does_not_change_byte_for_byte():
    rewriter = ChatStreamRewriter(strip_think=True)
    event = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    assert rewriter.feed(event[:10]) == b""
    assert rewriter.feed(event[10:] + b"data: [DONE]\n\n") == event + b"data: [DONE]\n\n"


@pytest.mark.parametrize(("priority", "deadline", "due", "expire", "strict"), [
    (None, None, 30, 60, False), ("HIGH", None, 2, 60, False), ("low", None, 120, 60, False),
    ("urgent", None, 30, 60, False), (None, "5000", 5, 5, True), ("high", "90000", 90, 60, True),
])
def test_schedule(priority, deadline, due, expire, strict):
    plan = schedule(100.0, priority=priority, deadline_ms=deadline, max_wait=60)
    assert (plan.due - 100, plan.expire_at - 100, plan.strict) == (due, expire, strict)


@pytest.mark.parametrize("deadline", ["soon", "-5", "0"])
def test_bad_deadline_header_teaches(deadline):
    with pytest.raises(HeaderError, match="X-Blazar-Deadline-Ms"):
        schedule(0, priority=None, deadline_ms=deadline, max_wait=60)
