"""A Realtime session's conversation items, as the client sees them, and the LLM context they describe.

Pure: the items are dicts as they were last reported (for `conversation.item.retrieve`), oldest first, at
most `MAX_ITEMS`; an assistant item also keeps its reply's number and the audio sent for it (for
`conversation.item.truncate`). `render` turns them into the (system prompt, turns) the LLM reads.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from duplexd.tools.calls import ToolCall, ToolSpec, call_turn, result_turn

MAX_ITEMS = 256  # conversation items kept for retrieve / delete / truncate (the oldest are forgotten)
# A context rebuilt from the items (after an edit the KV cannot make in place) holds the newest turns up to
# this many characters (~2k tokens: more than the KV window keeps, and a bounded prefill).
MAX_CONTEXT_CHARS = 8000

Item = dict[str, Any]


class Items:
    def __init__(self, max_items: int = MAX_ITEMS) -> None:
        self.max_items = max_items
        self.last: str | None = None  # the item a new one at the end follows (its `previous_item_id`)
        self._items: OrderedDict[str, Item] = OrderedDict()  # id -> the item as last reported
        self._reply: dict[str, int] = {}  # assistant item id -> its reply
        self._audio_ms: dict[str, float] = {}  # assistant item id -> its audio sent

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, item_id: str) -> Item | None:
        return self._items.get(item_id)

    def values(self) -> list[Item]:
        return list(self._items.values())

    def reply_of(self, item_id: str) -> int | None:
        """The reply an assistant item holds (None: not a response of this session)."""
        return self._reply.get(item_id)

    def audio_ms(self, item_id: str) -> float:
        return self._audio_ms.get(item_id, 0.0)

    def keep(self, item: Item, reply: int | None = None, audio_ms: float = 0.0, *, newest: bool = True) -> None:
        """Keep `item` (a copy) as the newest, or update it there (`newest` False: where it is); `reply`: the
        response's reply number."""
        if reply is not None:
            self._reply[item["id"]] = reply
            self._audio_ms[item["id"]] = audio_ms
        self._items[item["id"]] = dict(item)
        if newest:
            self._items.move_to_end(item["id"])
        self._forget_oldest()

    def add(self, item: Item) -> None:
        """A finished item at the end: the next one follows it."""
        self.keep(item)
        self.last = item["id"]

    def insert(self, item: Item, after: str | None) -> None:
        """Keep `item` after item `after` (None: first)."""
        if after == self.last:
            self.add(item)
            return
        items = list(self._items.items())
        at = 0 if after is None else next(i for i, (key, _) in enumerate(items) if key == after) + 1
        items.insert(at, (item["id"], dict(item)))
        self._items = OrderedDict(items)
        self._forget_oldest()

    def delete(self, item_id: str) -> None:
        self._reply.pop(item_id, None)
        self._audio_ms.pop(item_id, None)
        del self._items[item_id]
        if self.last == item_id:
            self.last = next(reversed(self._items), None)

    def set_words(self, item_id: str, text: str) -> None:
        """A message's words are now `text` (a response truncated to what was heard)."""
        item = self._items.get(item_id)
        if item is not None and item.get("content"):
            part = dict(item["content"][0])
            part["transcript" if "transcript" in part else "text"] = text
            item["content"] = [part]

    def _forget_oldest(self) -> None:
        while len(self._items) > self.max_items:
            old, _ = self._items.popitem(last=False)
            self._reply.pop(old, None)
            self._audio_ms.pop(old, None)


def words(item: Item) -> str:
    """A message item's words: its text parts, and its audio parts' transcripts."""
    parts = item.get("content") or []
    texts = (p.get("text") or p.get("transcript") or "" for p in parts if isinstance(p, dict))
    return " ".join(t for t in texts if isinstance(t, str) and t).strip()


def render(items: list[Item], instructions: str) -> tuple[str, list[tuple[str, str]]]:
    """The LLM context the items describe: the system prompt (`instructions`, then any system messages'
    words), the user and assistant turns and the tool exchanges (`function_call` / `mcp_call` items as
    "tool_call" turns, their outputs as "tool" turns: `tools.calls`), the newest up to `MAX_CONTEXT_CHARS`.
    An output whose call is not there (deleted, forgotten) is left out: a chat API refuses it. Other items
    (MCP tool lists) are not part of it."""
    system, turns = [instructions], []
    calls: set[str] = set()
    for item in items:
        kind = item.get("type")
        role = item.get("role") if kind == "message" else None
        text = words(item) if role is not None else ""
        if role == "system" and text:
            system.append(text)
        elif role == "assistant" or (role == "user" and text):
            turns.append((role, text))
        elif kind in ("function_call", "mcp_call") and isinstance(item.get("name"), str):
            call_id = str(item.get("call_id") or item.get("id") or "")
            calls.add(call_id)
            turns.append(call_turn(ToolCall(call_id, item["name"], str(item.get("arguments") or "{}"))))
            if kind == "mcp_call" and (item.get("output") is not None or item.get("error") is not None):
                turns.append(result_turn(call_id, str(item.get("output") or item.get("error"))))
        elif kind == "function_call_output" and item.get("call_id") in calls:
            turns.append(result_turn(item["call_id"], str(item.get("output") or "")))
    kept, size = 0, 0
    for _, text in reversed(turns):
        if kept and size + len(text) > MAX_CONTEXT_CHARS:
            break
        kept, size = kept + 1, size + len(text)
    return "\n\n".join(w for w in system if w), turns[len(turns) - kept :]


def function_specs(tools: tuple[dict[str, Any], ...]) -> tuple[ToolSpec, ...]:
    """A session's `function` tools, which the client runs (its `mcp` tools are the server's)."""
    return tuple(
        ToolSpec(
            t["name"],
            t.get("description") or "",
            t.get("parameters") or {"type": "object", "properties": {}},
        )
        for t in tools
        if t.get("type") == "function"
    )


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """A Realtime `tool_choice` as chat completions takes it."""
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def heard_part(text: str, fraction: float) -> str:
    """The part of a reply heard when its audio stopped at `fraction` of its length (cut at a word)."""
    if fraction >= 1:
        return text
    cut = int(len(text) * max(0.0, fraction))
    space = text.rfind(" ", 0, cut + 1)
    return text[: max(space, 0)].strip()
