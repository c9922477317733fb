"""A tokenizer's own chat template for fine-tuning on `messages` rows.

Instruct models (Llama 3, Qwen, Mistral, …) ship a Jinja `chat_template` with their tokenizer
(`tokenizer_config.json`, or `chat_template.jinja` next to it). Fine-tuning such a model in any
other format breaks it, so SFT renders each conversation with that template — through
transformers' own `apply_chat_template`, so the text is exactly what transformers, vLLM and
the model's users will produce — and falls back to lmforge's plain template
(`CHAT_TEMPLATE`, below) only for tokenizers without one.

The loss mask: a template is opaque text, so the assistant parts are found by rendering
prefixes. For the i-th message, an assistant turn, ``render(messages[:i], generation prompt)``
ends where the answer starts and ``render(messages[:i+1])`` where the turn ends; the text in
between, without the whitespace the template puts after its end-of-turn token, is trained on
(e.g. ``answer<|eot_id|>`` for Llama 3, ``answer<|im_end|>`` for Qwen — the model learns to end
its turn). Everything else, headers and the generation prompt included, is context. The whole
conversation is tokenized once, as transformers tokenizes it (no added special tokens), and a
token is trained on when it starts inside a trained span.

A conversation the template cannot render (its own `raise_exception`), or a message it leaves
out (a role it does not know: the content does not appear), or a template that renders earlier
turns differently once later ones follow, is one line naming the row and the message.
"""

from __future__ import annotations

import os

from lmforge.errors import UserError

# lmforge's plain chat template, for tokenizers without their own. Keep `render_chat` and this
# Jinja text in step (a test checks they agree).
ASSISTANT_HEADER = "### Assistant:\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}### Assistant:\n{{ m['content'] }}{{ eos_token }}"
    "{% else %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)


def render_chat(messages: list[dict]) -> list[tuple[str, bool]]:
    """The template as (text, trained) segments; the eos token after each answer is added by the caller."""
    out: list[tuple[str, bool]] = []
    for m in messages:
        if m["role"] == "assistant":
            out.append((ASSISTANT_HEADER, False))
            out.append((m["content"], True))
        else:
            out.append((f"### {m['role'].capitalize()}:\n{m['content']}\n\n", False))
    return out


def chat_prompt(user_text: str) -> str:
    """A single user turn, ready for the model to answer (add_generation_prompt=True)."""
    return f"### User:\n{user_text}\n\n{ASSISTANT_HEADER}"


class Rendered(list):
    """(text, trained) segments rendered by a tokenizer's chat template: tokenized as one text,
    with no special tokens added (the template writes its own)."""


class TokenizerChatTemplate:
    def __init__(self, hf_tokenizer, source: str):
        self.hf = hf_tokenizer
        self.source = source

    @property
    def text(self):
        """The Jinja template itself (a str, or a name → template dict), as the export writes it back."""
        return self.hf.chat_template

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False, where: str = "") -> str:
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{where}: the tokenizer's chat template refuses this conversation ({msg})") from None

    def segments(self, messages: list[dict], where: str) -> Rendered:
        full = self.render(messages, where=where)
        pos = 0
        for j, m in enumerate(messages):
            text = m["content"].strip()
            k = full.find(text, pos)
            if k < 0:
                raise UserError(f"{where}: messages[{j}].role {m['role']!r} is not rendered by the tokenizer's chat "
                                f"template ({self.source}); use the roles it knows")
            pos = k + len(text)
        out, done = Rendered(), 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prefix = self.render(messages[:i], add_generation_prompt=True, where=where) if i else ""
            turn = self.render(messages[:i + 1], where=where)
            start = len(prefix)
            answer = turn[start:].rstrip()
            if start < done or not turn.startswith(prefix) or not full.startswith(turn) or not answer:
                raise UserError(f"{where}: the tokenizer's chat template renders earlier turns differently once "
                                f"later ones follow (at messages[{i}]), so the assistant tokens cannot be located")
            out.append((full[done:start], False))
            out.append((answer, True))
            done = start + len(answer)
        out.append((full[done:], False))
        return Rendered((t, trained) for t, trained in out if t)

    def generation_prompt(self, user_text: str, tokenizer) -> str:
        """One user turn ready for the model to answer, as text for `tokenizer.encode` (which
        may add the bos token itself: then the template's own is left out)."""
        text = self.render([{"role": "user", "content": user_text}], add_generation_prompt=True, where="eval.prompts")
        bos = self.hf.bos_token
        if bos and text.startswith(bos) and tokenizer.encode("")[:1] == [tokenizer.backend.token_to_id(bos)]:
            text = text[len(bos):]
        return text


def load_chat_template(tokenizer_path: str | None) -> TokenizerChatTemplate | None:
    """The tokenizer folder's own chat template, or None when it has none."""
    if not tokenizer_path or not os.path.isdir(tokenizer_path):
        return None
    config = os.path.join(tokenizer_path, "tokenizer_config.json")
    has = os.path.isfile(os.path.join(tokenizer_path, "chat_template.jinja"))
    if not has and os.path.isfile(config):
        import json

        try:
            with open(config) as f:
                has = bool(json.load(f).get("chat_template"))
        except (OSError, ValueError):
            has = False
    if not has:
        return None
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(tokenizer_path)
    except Exception as e:
        raise UserError(f"tokenizer {tokenizer_path}: has a chat template but transformers cannot load it "
                        f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
    if not getattr(hf, "chat_template", None):
        return None
    return TokenizerChatTemplate(hf, source=tokenizer_path)


def tokenize_rendered(segments: Rendered, tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of the whole rendered text and, per token, whether it starts in a trained span."""
    text = "".join(t for t, _ in segments)
    spans, pos = [], 0
    for t, trained in segments:
        if trained:
            spans.append((pos, pos + len(t)))
        pos += len(t)
    enc = tokenizer.backend.encode(text, add_special_tokens=False)
    trained = [any(a <= start < b for a, b in spans) for start, _ in enc.offsets]
    if trained:
        trained[0] = False  # nothing predicts the first token
    return list(enc.ids), trained
