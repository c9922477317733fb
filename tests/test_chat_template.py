"""SFT with a tokenizer's own chat template (Llama 3- and Qwen-style templates written into test
tokenizers): the text and token ids are transformers' `apply_chat_template`, and the loss mask
is exactly transformers' assistant mask (`{% generation %}` spans), multi-turn included."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lmforge.data.chat import load_chat_template
from lmforge.data.rows.sft import read_examples, tokenize_example
from lmforge.data.text.tokenizer import load_tokenizer
from lmforge.errors import UserError

import transformers  # a required dependency: a broken install fails here, it is not skipped

# Two template styles, each written twice: as shipped (what lmforge reads) and with
# {% generation %} around what should be trained (transformers' oracle for the mask; the tags
# render nothing, so the text is the same).
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
          "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "{% endif %}{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
        "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
        "<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STYLES = {
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen": (QWEN, ["<|im_start|>", "<|im_end|>"], {"eos_token": "<|im_end|>"}),
}
SHIPPED = {k: v[0].replace("{% generation %}", "").replace("{% endgeneration %}", "") for k, v in STYLES.items()}

CHAT = [{"role": "system", "content": "Answer in Python."},
        {"role": "user", "content": "Sum of a and b?"},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "And the product?"},
        {"role": "assistant", "content": "def mul(a, b):\n    return a * b\n"}]


def write_tokenizer(base_dir, out, style: str, *, oracle: bool = False):
    """The tiny BPE plus the style's special tokens and its chat template (a tokenizer folder)."""
    from tokenizers import Tokenizer

    template, specials, names = STYLES[style]
    backend = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    backend.add_special_tokens(specials)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|pad|>", **names,
              "chat_template": template if oracle else SHIPPED[style], "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def rows_file(tmp_path, rows):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("style", list(STYLES))
def test_ids_and_mask_match_transformers(tmp_path, tiny_data, style):
    tok_dir = write_tokenizer(tiny_data.tokenizer, tmp_path / "tok", style)
    tok, template = load_tokenizer(tok_dir), load_chat_template(str(tok_dir))
    assert template is not None
    examples = read_examples([rows_file(tmp_path, [{"messages": CHAT}, {"messages": CHAT[1:3]}])],
                             "chat_completion", template)
    oracle = transformers.AutoTokenizer.from_pretrained(write_tokenizer(tiny_data.tokenizer, tmp_path / "o", style,
                                                                        oracle=True))
    for messages, segments in zip((CHAT, CHAT[1:3]), examples):
        ids, trained = tokenize_example(segments, tok)
        want = oracle.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == want["input_ids"]
        assert trained == [bool(m) for m in want["assistant_masks"]]
        end = "<|eot_id|>" if style == "llama3" else "<|im_end|>"
        answers = [m["content"].strip() if style == "llama3" else m["content"]
                   for m in messages if m["role"] == "assistant"]
        assert tok.decode([i for i, t in zip(ids, trained) if t]) == "".join(a + end for a in answers)


def test_roles_the_template_does_not_know(tmp_path, tiny_data):
    robot = [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"},
             {"role": "assistant", "content": "hello"}]
    qwen = load_chat_template(str(write_tokenizer(tiny_data.tokenizer, tmp_path / "q", "qwen")))
    with pytest.raises(UserError, match=r"chat.jsonl:1: messages\[1\].role 'robot' is not rendered"):
        read_examples([rows_file(tmp_path, [{"messages": robot}])], "chat_completion", qwen)
    llama = load_chat_template(str(write_tokenizer(tiny_data.tokenizer, tmp_path / "l", "llama3")))
    assert read_examples([rows_file(tmp_path, [{"messages": robot}])], "chat_completion", llama)  # any role renders
    strict = tmp_path / "strict"
    write_tokenizer(tiny_data.tokenizer, strict, "qwen")
    config = json.loads((strict / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                               "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    (strict / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="refuses this conversation .Only user and assistant roles"):
        read_examples([rows_file(tmp_path, [{"messages": CHAT}])], "chat_completion",
                      load_chat_template(str(strict)))


@pytest.mark.integration
def test_sft_run_keeps_the_tokenizers_template(tmp_path, tiny_data):
    """A chat SFT run (in-process) on a model whose tokenizer has a Qwen-style template: rows and
    eval prompts use it, and the final model keeps it."""
    from lmforge.config.model import ModelConfig
    from lmforge.models import build_model, save_pretrained
    from train_helpers import train_in_process

    tok_dir = write_tokenizer(tiny_data.tokenizer, tmp_path / "tok", "qwen")
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, max_seq_len=128, vocab_size=576)
    torch.manual_seed(0)
    save_pretrained(build_model(cfg), cfg, tmp_path / "base", tokenizer_dir=tok_dir)
    lines = []
    raw = {"name": f"chat-{time.time_ns()}", "custom_weights_path": str(tmp_path / "base"),
           "task_type": "chat_completion", "train_data": rows_file(tmp_path, [{"messages": CHAT}] * 8),
           "training_duration": "2ba", "save_folder": str(tmp_path / "run"),
           "parameters": {"global_batch_size": 2, "micro_batch_size": 2, "context_length": 128},
           "eval": {"prompts": ["Sum?"], "max_new_tokens": 2}, "experiment_tracker": {"mlflow": None}}
    result = train_in_process(raw, log=lines.append)
    assert "chat template: the tokenizer’s own" in lines
    assert result.generations[0].startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                                            "<|im_start|>user\nSum?<|im_end|>\n<|im_start|>assistant\n")
    final = json.loads((tmp_path / "run" / "final" / "tokenizer_config.json").read_text())
    assert final["chat_template"] == SHIPPED["qwen"]
