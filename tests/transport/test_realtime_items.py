"""A Realtime session's items and the LLM context they render (pure)."""

from __future__ import annotations

from duplexd.transport.realtime_items import MAX_CONTEXT_CHARS, Items, heard_part, render


def message(item_id: str, role: str, text: str, kind: str = "input_text") -> dict:
    field = "transcript" if kind in ("input_audio", "output_audio") else "text"
    return {"id": item_id, "type": "message", "role": role, "content": [{"type": kind, field: text}]}


def test_items_keep_order_inserts_deletes_and_the_last_item() -> None:
    items = Items(max_items=3)
    items.add(message("a", "user", "Hi"))
    items.keep(message("b", "assistant", "", "output_audio"), reply=1)  # (a response in progress)
    assert items.last == "a" and items.reply_of("b") == 1
    items.keep(message("b", "assistant", "Hello there.", "output_audio"), reply=1, audio_ms=900.0)
    items.last = "b"
    items.insert(message("s", "system", "Be brief."), None)  # (root: first)
    assert [i["id"] for i in items.values()] == ["s", "a", "b"] and items.audio_ms("b") == 900.0
    items.set_words("b", "Hello")
    assert items.get("b")["content"][0]["transcript"] == "Hello"
    items.insert(message("c", "user", "Bye"), "b")  # (after the last: the new last; the bound drops "s")
    assert [i["id"] for i in items.values()] == ["a", "b", "c"] and items.last == "c"
    items.delete("c")
    assert items.last == "b" and "c" not in items and len(items) == 2
    items.delete("b")
    assert items.reply_of("b") is None and items.audio_ms("b") == 0.0


def test_render_gives_the_system_prompt_and_the_newest_turns() -> None:
    items = [
        message("s", "system", "Be brief."),
        message("u", "user", "What is the capital of France?", "input_audio"),
        message("a", "assistant", "Paris.", "output_audio"),
        {"id": "f", "type": "function_call_output", "call_id": "c", "output": "{}"},
        message("e", "user", ""),  # (an empty user message adds nothing)
        message("x", "assistant", ""),  # (a reply cut to nothing still takes its turn)
    ]
    system, turns = render(items, "You are kind.")
    assert system == "You are kind.\n\nBe brief."
    assert turns == [("user", "What is the capital of France?"), ("assistant", "Paris."), ("assistant", "")]
    long = [message(str(i), "user", "x" * 1000) for i in range(20)]
    _, kept = render(long, "")
    assert len(kept) == MAX_CONTEXT_CHARS // 1000 and kept[-1] == ("user", "x" * 1000)


def test_the_heard_part_is_cut_at_a_word() -> None:
    text = "Paris is the capital of France."
    assert heard_part(text, 1.0) == text and heard_part(text, 0.0) == ""
    assert heard_part(text, 0.5) == "Paris is the"
