"""Conversation -> token ids with the model's chat template, and which tokens are assistant content.

The assistant spans are found on the rendered text, not guessed from role strings: for assistant
message ``i`` the template renders ``messages[:i]`` with the generation prompt (where the answer starts)
and ``messages[:i+1]`` (where the turn ends, minus the whitespace the template adds after it). Both must
be prefixes of the full rendering, which holds for append-only templates (checked; a template that
rewrites earlier turns raises). Tokens are then mapped to characters with the fast tokenizer's offsets,
so the mask is exact for any tokenizer: a token is assistant content when it overlaps a span. The
token that carries the first answer character may also carry the separator space before it (BPE merges
" red"); the end-of-turn token that closes the answer is included.

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
LLaVA-1.5's template of :mod:`megatron_vlm.chat_template`) is used as it renders. A template that closes
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
from dataclasses import dataclass

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

    def _log_once(self, msg: str) -> None:
        """Log ``msg`` once per process and template (in a distributed run: on global rank 0 only)."""
        key = (self.chat_template, self.tokenizer.eos_token_id)
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

    def _tokenize(self, messages: list[dict], append_eos: bool) -> TokenizedConversation:
        text = self.render(messages)
        spans = self.assistant_spans(messages, text)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        assistant = [False] * len(ids)
        last_of_span: set[int] = set()  # the last token of each span
        offsets = enc["offset_mapping"]
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
        return TokenizedConversation(out_ids, out_mask, text, inserted, bos)

    def __call__(self, messages: list[dict]) -> TokenizedConversation:
        return self._tokenize(messages, self.append_eos)
