"""One choice's output parsed into reasoning, answer text and tool calls: piece by piece as it
streams (``feed`` / ``finish``: only what each piece adds) and whole (``result``). Both read the
same text the same way, so the joined deltas of a stream equal the whole message (the arguments
as written, where the whole message re-encodes them)."""
from __future__ import annotations

import random
import string
import uuid

from .json_calls import PartialCall, normalized
from .reasoning import ReasoningFormat
from .tool_formats import ToolFormat
from .types import MessageDelta, ParsedMessage, ToolCall, ToolCallDelta


def new_call_id(style: str = "openai") -> str:
    if style == "mistral":  # Mistral's templates check for exactly 9 alphanumerics
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputParser:
    """Parses one output. ``tools``: the tool-call format (None: the answer is plain text);
    ``reasoning``: the reasoning format (None: no reasoning span); ``named``: a forced call of this
    tool, whose arguments are the whole answer (the grammar allows nothing else)."""

    def __init__(self, tools: ToolFormat | None = None, reasoning: ReasoningFormat | None = None,
                 named: str | None = None) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.named = named
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0
        self._ids: list[str] = []
        self._sent_args: list[int] = []
        self._finished = False

    # ------------------------------------------------------------ reading

    def _read(self, final: bool) -> tuple[str, str, list[PartialCall], bool]:
        """(reasoning, content, calls, calls well formed) of the text so far."""
        reasoning, answer = "", self.text
        if self.reasoning is not None:
            split = self.reasoning.split(self.text, final)
            reasoning = split.reasoning
            answer = self.text[split.content_start:] if split.content_start is not None else ""
        if self.named is not None:
            if not answer.strip():
                return reasoning, "", [], not final
            return reasoning, "", [PartialCall(name=self.named, args=answer, args_done=final, done=final)], True
        if self.tools is None:
            return reasoning, answer, [], True
        scan = self.tools.scan(answer, final)
        if final and (not scan.ok or not scan.calls):
            return reasoning, answer, [], scan.ok
        return reasoning, answer[:scan.content_end], scan.calls, scan.ok

    def _id(self, i: int) -> str:
        while len(self._ids) <= i:
            self._ids.append(new_call_id(getattr(self.tools, "call_id_style", "openai")))
            self._sent_args.append(-1)  # -1: the name is not sent yet
        return self._ids[i]

    def _delta(self, final: bool) -> MessageDelta:
        reasoning, content, calls, _ = self._read(final)
        out = MessageDelta()
        if len(reasoning) > self._sent_reasoning:
            out.reasoning = reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(reasoning)
        if len(content) > self._sent_content:
            out.content = content[self._sent_content:]
            self._sent_content = len(content)
        for i, c in enumerate(calls):
            if c.name is None:
                break  # later calls wait for this one's name: indexes arrive in order
            cid = self._id(i)
            piece = ToolCallDelta(index=i)
            if self._sent_args[i] < 0:
                piece.id, piece.name = cid, c.name
                self._sent_args[i] = 0
            if len(c.args) > self._sent_args[i]:
                piece.arguments = c.args[self._sent_args[i]:]
                self._sent_args[i] = len(c.args)
            if piece.name is not None or piece.arguments:
                out.tool_calls.append(piece)
        return out

    # ------------------------------------------------------------ the interface

    def feed(self, text: str) -> MessageDelta:
        """Add the next piece of output text; returns what can be sent now."""
        self.text += text
        if self.tools is None and self.reasoning is None and self.named is None:  # plain text: as it comes
            self._sent_content += len(text)
            return MessageDelta(content=text)
        return self._delta(False)

    def finish(self) -> MessageDelta:
        """The output has ended: what was held back (a marker's possible start, a call that
        turned out not to be one)."""
        self._finished = True
        return self._delta(True)

    def result(self) -> ParsedMessage:
        """The whole output (so far) as one message, as vLLM's parsers answer a whole one: calls
        with their arguments re-encoded; text that is not well-formed calls is content."""
        reasoning, content, calls, _ = self._read(True)
        parsed = []
        for i, c in enumerate(calls):
            args = normalized(c.args)
            if c.name is None or args is None:
                reasoning, content, parsed = reasoning, self._answer(), []
                break
            parsed.append(ToolCall(id=self._id(i), name=c.name, arguments=args))
        return ParsedMessage(content=content or None, reasoning=reasoning or None, tool_calls=parsed)

    def _answer(self) -> str:
        if self.reasoning is None:
            return self.text
        split = self.reasoning.split(self.text, True)
        return self.text[split.content_start:] if split.content_start is not None else ""


def parse_output(text: str, tools: ToolFormat | None = None, reasoning: ReasoningFormat | None = None,
                 named: str | None = None) -> ParsedMessage:
    """A whole output, parsed at once."""
    p = OutputParser(tools, reasoning, named)
    p.text = text
    return p.result()
