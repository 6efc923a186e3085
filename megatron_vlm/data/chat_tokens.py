"""Conversation -> token ids with the model's chat template, and which tokens are assistant content.

The assistant spans are found on the rendered text, not guessed from role strings: for assistant
message ``i`` the template renders ``messages[:i]`` with the generation prompt (where the answer starts)
and ``messages[:i+1]`` (where the turn ends, minus the whitespace the template adds after it). Both must
be prefixes of the full rendering, which holds for append-only templates (checked; a template that
rewrites earlier turns raises). Tokens are then mapped to characters with the fast tokenizer's offsets,
so the mask is exact for any tokenizer: a token is assistant content when it overlaps a span. The
token that carries the first answer character may also carry the separator space before it (BPE merges
" red"); the eos (or end-of-turn token) that closes the answer is included.

Text is tokenized with ``add_special_tokens=False``: the template writes BOS itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenizedConversation:
    ids: list[int]  # the whole conversation x[0..n], one image token per image
    assistant: list[bool]  # per id: part of an assistant answer (answer text + closing eos)
    text: str  # the rendered template text


class ChatTokenizer:
    """Render + tokenize conversations for one HF tokenizer and chat template."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast (Rust) tokenizer is required for offset mapping; save the model with tokenizer.json")
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ValueError(
                "the model directory has no chat template; build it with convert/build_llava.py (it installs one)"
            )

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def assistant_spans(self, messages: list[dict], text: str | None = None) -> list[tuple[int, int]]:
        """Character spans ``[start, end)`` of the assistant answers in ``render(messages)``."""
        text = self.render(messages) if text is None else text
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start_text = self.render(messages[:i], add_generation_prompt=True) if i else ""
            end_text = self.render(messages[: i + 1])
            if not text.startswith(start_text) or not text.startswith(end_text):
                raise ValueError(
                    "the chat template does not render conversations append-only (a prefix of the conversation "
                    "does not render to a prefix of the text), so assistant turns cannot be located for the loss mask"
                )
            start, end = len(start_text), len(end_text.rstrip())
            if end > start:
                spans.append((start, end))
        return spans

    def __call__(self, messages: list[dict]) -> TokenizedConversation:
        text = self.render(messages)
        spans = self.assistant_spans(messages, text)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        assistant = [False] * len(ids)
        j = 0
        for t, (s, e) in enumerate(enc["offset_mapping"]):
            while j < len(spans) and spans[j][1] <= s:
                j += 1
            if j < len(spans) and e > spans[j][0] and s < spans[j][1]:
                assistant[t] = True
        return TokenizedConversation(ids, assistant, text)
