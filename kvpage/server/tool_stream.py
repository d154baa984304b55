"""A chat answer that may hold tool calls, streamed as it grows, as OpenAI streams it: `delta.tool_calls` by index
(the call's id, type and name first, then its arguments piece by piece) and, where calls may come, the content
before them.

- A named function (`tool_choice={"type": "function", ...}`): the whole output is the call's arguments, each
  piece sent as it comes.
- `"required"`: the output is a JSON array of `{"name": ..., "parameters": {...}}` (tool_calls.required_schema);
  a scanner follows the JSON as it grows (strings and escapes included) and sends each call's name once its
  string closes, then the text of its `parameters` object, piece by piece, until that object closes.
- `"auto"` with a parser: content is sent as it comes until a call's marker begins (`<tool_call>` for hermes,
  `[TOOL_CALLS]` for mistral; llama3_json's answer is a call when it starts with `{` or `<|python_tag|>`); the
  text that may be the marker's beginning is held back until it is plainly not. After the marker the rest is held:
  the parser reads the finished answer, and its calls go whole at the end (or the held text as content, if it
  was not a call after all).

Plain functions of the text; serving_chat.py sends what they return.
"""

from __future__ import annotations

from kvpage.server.tool_calls import tool_call_json

MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def new_call(index: int, name: str, arguments: str = "") -> dict:
    """A call's first delta: its index, id, type and name (and the first piece of its arguments)."""
    return {"index": index, **tool_call_json(name, arguments)}


def args_delta(index: int, text: str) -> dict:
    return {"index": index, "function": {"arguments": text}}


class NamedCall:
    """tool_choice a named function: every piece of the output is the call's arguments."""

    def __init__(self, name: str) -> None:
        self.name, self.started = name, False

    def feed(self, delta: str) -> list[dict]:
        if not delta:
            return []
        if not self.started:
            self.started = True
            return [new_call(0, self.name, delta)]
        return [args_delta(0, delta)]


class RequiredCalls:
    """tool_choice "required": the calls of a growing `[{"name": ..., "parameters": ...}, ...]`."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers: "[" or "{"
        self.in_string = self.escaped = False
        self.string = ""  # the string being read, at the call object's level (a key or the name)
        self.key: str | None = None  # the call object's key whose value comes next
        self.expect_value = False  # after a key's ":" in the call object
        self.index = -1  # the call being read
        self.capturing = False  # inside the call's "parameters" value
        self.pending = ""  # arguments read before the name was sent (none under the schema's order)
        self.named = False

    def feed(self, delta: str) -> list[dict]:
        out: list[dict] = []
        args = ""
        for ch in delta:
            depth = len(self.stack)
            if self.capturing:
                args += ch
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if depth == 2:
                        self._string_done(out)
                    continue
                if depth == 2:
                    self.string += ch
                continue
            if ch == '"':
                self.in_string = True
                self.string = ""
            elif ch in "[{":
                if depth == 1 and ch == "{":  # a new call
                    self.index, self.key, self.named, self.pending = self.index + 1, None, False, ""
                if depth == 2 and self.expect_value and self.key == "parameters":  # its arguments begin
                    self.capturing, args = True, args + ch
                self.stack.append(ch)
                self.expect_value = False
            elif ch in "]}":
                if self.stack:
                    self.stack.pop()
                if self.capturing and len(self.stack) <= 2:  # the parameters' object closed: its last piece
                    self.capturing = False
                    self._send_args(args, out)
                    args = ""
            elif ch == ":" and depth == 2:
                self.expect_value = True
            elif ch == "," and depth == 2:
                self.key, self.expect_value = None, False
        if args:
            self._send_args(args, out)
        return out

    def _string_done(self, out: list[dict]) -> None:
        if self.expect_value and self.key == "name" and not self.named:
            out.append(new_call(self.index, self.string))
            self.named, self.expect_value = True, False
            if self.pending:
                out.append(args_delta(self.index, self.pending))
                self.pending = ""
        elif not self.expect_value:
            self.key = self.string
        else:
            self.expect_value = False

    def _send_args(self, args: str, out: list[dict]) -> None:
        if self.named:
            out.append(args_delta(self.index, args))
        else:
            self.pending += args


def required_calls(text: str) -> list[tuple[str, str]]:
    """The calls of a whole "required" answer, (name, arguments) as a stream of it sends them (the same text, cut
    where the answer was)."""
    calls: dict[int, list[str]] = {}
    for d in RequiredCalls().feed(text):
        entry = calls.setdefault(d["index"], ["", ""])
        entry[0] += d["function"].get("name", "")
        entry[1] += d["function"]["arguments"]
    return [(name, args) for name, args in calls.values()]


class AutoContent:
    """tool_choice "auto": the content to send now, holding back what may begin a call."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.sent = 0  # characters of the text sent as content
        self.held = False  # a call began: the rest waits for the end

    def feed(self, text: str) -> str:
        """The content to send now, `text` being the whole answer so far."""
        if self.held:
            return ""
        if self.parser == "llama3_json":
            body = text.lstrip()
            starts = ("{", "<|python_tag|>")
            if any(body.startswith(s) or s.startswith(body) for s in starts):  # a call, or maybe (all held)
                self.held = bool(body) and any(body.startswith(s) for s in starts)
                return ""
            return self._release(text, len(text))
        marker = MARKERS[self.parser]
        at = text.find(marker, self.sent)
        if at != -1:
            self.held = True
            return self._release(text, at)
        keep = next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)
        return self._release(text, len(text) - keep)

    def _release(self, text: str, upto: int) -> str:
        piece = text[self.sent : max(upto, self.sent)]
        self.sent = max(upto, self.sent)
        return piece

    def rest(self, text: str) -> str:
        """The finished answer had no call after all: what is still unsent, as content."""
        piece = text[self.sent :]
        self.sent = len(text)
        return piece
