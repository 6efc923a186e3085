"""Conversation -> token ids with the model's chat template, and which tokens are trained (the loss mask).

**The loss rule.** For each assistant turn the trained tokens are exactly what the model must generate at that
point. The conversation up to that turn, rendered with ``add_generation_prompt=True``, is the prompt; everything
the full rendering adds after it, up to and including the token that closes the turn, is in the loss. Nothing is
decided per template: ChatML trains ``answer<|im_end|>`` after ``<|im_start|>assistant\\n``; Qwen3, whose
generation prompt ends in ``<think>\\n``, trains ``\\n</think>\\n\\nanswer<|im_end|>`` on its final turn.

**Templates that break the prefix property.** A template may render an earlier assistant turn differently
inside the conversation than after its own generation prompt: Qwen3 writes ``<think>`` blocks only into the
turns after the last user query, so an earlier turn renders as ``<|im_start|>assistant\\nanswer<|im_end|>``
while its generation prompt ends in ``<think>\\n``. The prompt is then no prefix of the rendering. Such a turn is
trained as the conversation renders it, from the point where the two renderings part (``answer<|im_end|>``)
to the token closing the turn; that is logged once per template. The tokens stay those of the one rendering
of the whole conversation, so nothing else changes.

The spans are found on the rendered text, not guessed from role strings; tokens are mapped to characters with
the fast tokenizer's offsets, so the mask is exact for any tokenizer: a token is trained when it overlaps a
span. The token that carries the first answer character may also carry the separator space before it (BPE
merges " red").

**The mask ends where the answer ends.** Whitespace the template writes after an answer is not the
answer's: at inference the prompt ends with the generation prompt (``ASSISTANT:``, ``<|im_start|>assistant\\n``)
and the model must produce the answer and then stop. HF's ``return_assistant_tokens_mask`` marks every token
that overlaps a ``{% generation %}`` block, so where a template puts a trailing space inside the block
(llava-1.5-7b-hf: ``{% generation %}{{ text + ' ' }}{% endgeneration %}``) it also marks the token carrying
that space: the next turn's ``▁US`` of ``USER:``, or a lone ``▁`` at the end. Training on those teaches the
model to start the user's next turn instead of stopping; this mask leaves them out (tests compare both
masks on the real templates).

**The eos rule: every assistant turn is closed by an end token, in the tokens and in the loss.** A template
that closes assistant turns with a special token (ChatML's ``<|im_end|>``, ``</s>`` after ``[/INST]`` answers,
LLaVA-1.5's template of :mod:`megatron_vlm.data.chat_template`) is used as it renders. A template that closes
none (llava-1.5-7b-hf's: ``ASSISTANT: The circle is red. USER: ...``) would never put a stop token in the loss,
and the model would never learn to end its answer; there the tokenizer's eos is inserted after the last token
of each answer and trained on, as LLaVA's own training does with ``</s>``. Which case applies is decided once
per template (on a probe conversation) and logged once per process.

**BOS as at inference.** Text is tokenized with ``add_special_tokens=False``: most templates write BOS
themselves. Where a template writes none but the tokenizer adds one (llava-1.5-7b-hf: ``add_bos_token``, a
template starting at ``USER:``), BOS is prepended, as HF's processor does to such a prompt at inference
(``processor.apply_chat_template(..., tokenize=True)`` tokenizes with special tokens unless the text starts
with BOS).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
_LOGGED: set = set()  # (template, eos) pairs whose eos rule was logged in this process

# the conversation a template's eos rule is decided on (as content lists, or as strings for string-only templates)
_PROBE = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
          {"role": "assistant", "content": [{"type": "text", "text": "a short answer"}]}]
_PROBE_STR = [{"role": m["role"], "content": m["content"][0]["text"]} for m in _PROBE]


@dataclass
class TokenizedConversation:
    ids: list[int]  # the whole conversation x[0..n], one image token per image
    assistant: list[bool]  # per id: part of an assistant answer (answer text + the token that closes it)
    text: str  # the rendered template text
    inserted_eos: list[int]  # positions in ``ids`` of eos tokens inserted by the eos rule (not in ``text``)
    prepended_bos: bool = False  # ids[0] is a BOS that is not in ``text`` (module docstring)
    cuts: list[int] = field(default_factory=list)  # characters of ``text`` where it was tokenized apart (_encode)


class ChatTokenizer:
    """Render + tokenize conversations for one HF tokenizer and chat template."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "a fast (Rust) tokenizer is required for offset mapping; save the model with tokenizer.json"
            )
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ValueError(
                "the model directory has no chat template; build it with convert/build_llava.py (it installs one)"
            )
        special = set(tokenizer.all_special_ids)
        special.update(int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                       if getattr(t, "special", False))
        self._special = special
        #: the tokenizer puts BOS in front of text (then so do we where the template does not write it)
        bos = tokenizer.bos_token_id
        self.adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos] and \
            tokenizer("a", add_special_tokens=False)["input_ids"][:1] != [bos]
        #: the token that closes assistant turns in the template, or None: the eos is inserted (module docstring)
        self.closing_token = self._closing_token()
        self.append_eos = self.closing_token is None
        if self.append_eos:
            if tokenizer.eos_token_id is None:
                raise ValueError(
                    "the chat template closes no assistant turn with an end token and the tokenizer has no eos "
                    "token to close them with, so a trained model would never stop; set eos_token in "
                    "tokenizer_config.json or use a template that ends answers with one")
            self._log_once(f"the chat template closes no assistant turn with an end token: appending the eos "
                           f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) after every answer, in the "
                           "tokens and in the loss, so that the model learns to stop")
        else:
            self._log_once(f"the chat template closes assistant turns with {self.closing_token!r}: "
                           "trained on as the end of each answer")

    def _log_once(self, msg: str, what: str = "eos rule") -> None:
        """Log ``msg`` once per process, template and ``what`` (in a distributed run: on global rank 0 only)."""
        key = (self.chat_template, self.tokenizer.eos_token_id, what)
        if key in _LOGGED:
            return
        _LOGGED.add(key)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            log.info(msg)

    def _closing_token(self) -> str | None:
        """The special token that ends the probe answer's span, if the template writes one."""
        try:
            conv = self._tokenize(_PROBE, append_eos=False)
        except Exception:  # jinja raises anything; a string-only template (only strings will then render)
            try:
                conv = self._tokenize(_PROBE_STR, append_eos=False)
            except Exception as e:  # a template that cannot render a user/assistant exchange
                raise ValueError(f"the chat template cannot render a user/assistant conversation: "
                                 f"{type(e).__name__}: {e}") from None
        last = [i for i, a in enumerate(conv.assistant) if a]
        if last and conv.ids[last[-1]] in self._special:
            return self.tokenizer.convert_ids_to_tokens(conv.ids[last[-1]])
        return None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def assistant_spans(self, messages: list[dict], text: str | None = None) -> list[tuple[int, int]]:
        """Character spans ``[start, end)`` of ``render(messages)`` that are trained (the module's loss rule)."""
        return [(a, b) for a, b, _ in self._spans(messages, self.render(messages) if text is None else text)]

    def _spans(self, messages: list[dict], text: str) -> list[tuple[int, int, bool]]:
        """(start, end, whether the start is the end of the turn's rendered prompt) of each trained span."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True) if i else ""
            start, exact = len(prompt), text.startswith(prompt)
            if not exact:  # the token where the renderings part is trained whole (never tokenized apart)
                start = _common_prefix(prompt, text)
                self._log_once(
                    f"the chat template renders an assistant turn differently in the conversation than after its "
                    f"generation prompt (e.g. turn {i}: the prompt ends in {prompt[start:][:40]!r}, the conversation "
                    f"goes on with {text[start:][:40]!r}; Qwen3 writes <think> blocks only after the last user "
                    "query): such turns are trained as the conversation renders them, from where the two renderings "
                    "part to the token that closes the turn", "prefix")
            end = self._turn_end(messages, i, text, start)
            if end > start:
                spans.append((start, end, exact))
        return spans

    def _turn_end(self, messages: list[dict], i: int, text: str, start: int) -> int:
        """Where assistant turn ``i`` ends in ``text``: after the token that closes it (or, for a template that
        closes none, after its answer; the eos rule adds the end token)."""
        turn = self.render(messages[: i + 1])
        if text.startswith(turn):
            return len(turn.rstrip())  # whitespace after the closing token belongs to what follows
        closing = getattr(self, "closing_token", None)
        k = text.find(closing, start) if closing else -1
        if k < 0:
            raise ValueError(
                "the chat template does not render conversations append-only (a prefix of the conversation does "
                "not render to a prefix of the text) and closes no assistant turn with an end token, so the end "
                f"of assistant turn {i} cannot be located for the loss mask; use a template that ends answers with "
                "one (--chat-template)")
        return k + len(closing)

    def _tokenize(self, messages: list[dict], append_eos: bool) -> TokenizedConversation:
        text = self.render(messages)
        spans = self._spans(messages, text)
        ids, offsets, cuts = self._encode(text, [a for a, _, exact in spans if exact])
        spans = [(a, b) for a, b, _ in spans]
        assistant = [False] * len(ids)
        last_of_span: set[int] = set()  # the last token of each span
        j = 0
        for t, (s, e) in enumerate(offsets):
            while j < len(spans) and spans[j][1] <= s:
                j += 1
            if j < len(spans) and e > spans[j][0] and s < spans[j][1]:
                assistant[t] = True
                nxt = offsets[t + 1] if t + 1 < len(offsets) else None  # byte tokens of one char share offsets
                if nxt is None or not (nxt[1] > spans[j][0] and nxt[0] < spans[j][1]):
                    last_of_span.add(t)
        bos = self.adds_bos and not text.startswith(self.tokenizer.bos_token)
        out_ids, out_mask, inserted = ([self.tokenizer.bos_token_id], [False], []) if bos else ([], [], [])
        eos = self.tokenizer.eos_token_id
        for t, (i, a) in enumerate(zip(ids, assistant)):
            out_ids.append(i)
            out_mask.append(a)
            if append_eos and t in last_of_span:
                inserted.append(len(out_ids))
                out_ids.append(int(eos))
                out_mask.append(True)
        return TokenizedConversation(out_ids, out_mask, text, inserted, bos, cuts)

    def _encode(self, text: str, starts: list[int]) -> tuple[list[int], list[tuple[int, int]], list[int]]:
        """Token ids and character offsets of ``text``, and where it was tokenized apart: at a prompt's end
        (``starts``) that falls inside a token of the whole text (Qwen3: ``<think>\n`` + ``\n</think>`` merge into one
        ``\n\n``), the prompt and the answer are tokenized separately, as at inference, where the prompt ends
        there."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        cuts = sorted({a for a in starts if any(s < a < e for s, e in offsets)})
        if not cuts:
            return ids, offsets, []
        self._log_once(f"the chat template's generation prompt ends inside a token of the conversation's text "
                       f"({text[cuts[0] - 8:cuts[0]]!r} + {text[cuts[0]:cuts[0] + 8]!r}): the prompt and the answer "
                       "are tokenized apart there, as at inference", "cut")
        ids, offsets = [], []
        bounds = [0, *cuts, len(text)]
        for a, b in zip(bounds, bounds[1:]):
            enc = self.tokenizer(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
            ids += enc["input_ids"]
            offsets += [(s + a, e + a) for s, e in enc["offset_mapping"]]
        return ids, offsets, cuts

    def __call__(self, messages: list[dict]) -> TokenizedConversation:
        return self._tokenize(messages, self.append_eos)


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = next((k for k in range(n) if a[k] != b[k]), n)
    return i
