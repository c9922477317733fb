"""An Ollama `Modelfile` for an exported GGUF: FROM the file, the chat format as Ollama's TEMPLATE
(a Go template, not Jinja), and the tokens that end a turn as PARAMETER stop.

A Jinja chat template cannot be translated into a Go template in general, so the formats
Ollama users meet are recognised by what the template *renders* (a sample conversation, with
and without a system turn, through the tokenizer's own template via transformers), not by its
text: lmforge's plain template, ChatML (Qwen and many fine-tunes) and Llama 3's headers. A
template that renders as none of them gets no TEMPLATE line — Ollama then reads the chat
template inside the GGUF and matches it against its own list — and the Modelfile says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lmforge.data.chat import ASSISTANT_HEADER

Messages = list[dict]


@dataclass(frozen=True)
class ChatFormat:
    name: str
    render: Callable[[Messages, str], str]  # (messages, eos text) → the prompt, generation prompt included
    go: str  # Ollama's TEMPLATE, with {eos} for the end-of-text token
    stops: tuple[str, ...]  # the end-of-turn tokens besides the end-of-text one


def _plain(messages: Messages, eos: str) -> str:
    out = "".join(f"{ASSISTANT_HEADER}{m['content']}{eos}" if m["role"] == "assistant"
                  else f"### {m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages)
    return out + ASSISTANT_HEADER


def _chatml(messages: Messages, eos: str) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
        "<|im_start|>assistant\n"


def _llama3(messages: Messages, eos: str) -> str:
    return "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
                   for m in messages) + "<|start_header_id|>assistant<|end_header_id|>\n\n"


FORMATS = (
    ChatFormat("lmforge", _plain,
               '{{- range .Messages }}{{ if eq .Role "assistant" }}### Assistant:\n{{ .Content }}{eos}'
               '{{ else if eq .Role "system" }}### System:\n{{ .Content }}\n\n'
               '{{ else }}### User:\n{{ .Content }}\n\n{{ end }}{{ end }}### Assistant:\n', ()),
    ChatFormat("chatml", _chatml,
               "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
               "{{ end }}<|im_start|>assistant\n", ("<|im_end|>",)),
    ChatFormat("llama3", _llama3,
               "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
               "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n", ("<|eot_id|>",)),
)

SAMPLES: tuple[Messages, ...] = (
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}],
)


def chat_format(render: Callable[[Messages], str], eos: str, bos: str | None) -> ChatFormat | None:
    """The known format whose rendering of every sample equals ``render``'s (a tokenizer's chat
    template with the generation prompt; a leading BOS is left out, as llama.cpp adds its own)."""
    try:
        rendered = [render(m) for m in SAMPLES]
    except Exception:  # a template that refuses the samples (its own raise_exception) is no known format
        return None
    if bos:
        rendered = [r.removeprefix(bos) for r in rendered]
    return next((f for f in FORMATS if all(f.render(m, eos) == r for m, r in zip(SAMPLES, rendered))), None)


def modelfile(gguf_name: str, fmt: ChatFormat | None, eos: str, has_template: bool) -> str:
    lines = [f"FROM ./{gguf_name}", ""]
    if fmt is not None:
        lines += [f"# chat format: {fmt.name} (rendered like the tokenizer's chat template)",
                  f'TEMPLATE """{fmt.go.replace("{eos}", eos)}"""', ""]
    elif has_template:
        lines += ["# The chat template is none Ollama's TEMPLATE is written for here: Ollama reads it from the",
                  "# GGUF (tokenizer.chat_template) and uses its own equivalent when it knows one.", ""]
    for stop in dict.fromkeys((eos, *(fmt.stops if fmt else ()))):
        lines.append(f'PARAMETER stop "{stop}"')
    return "\n".join(lines) + "\n"
