"""Tiny random Hugging Face models of each supported family, built from the config classes
(no download), with every norm and bias randomized so a wrong mapping shows in the logits."""

from __future__ import annotations

import torch

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)

# family → (transformers config class, extra config fields). Each case turns on what makes the
# family differ: llama3 RoPE scaling, a sliding window shorter than the test sequence, q/k/v
# biases, per-head q/k norms with YaRN scaling, OLMo 2's post-norms and full q/k norms, Gemma's
# GeGLU, scaled embeddings, offset norm weights and head size apart from the hidden size; Gemma 2's
# soft-caps small enough to bend these scores and logits, its query scale and its alternating
# windowed and global layers; Gemma 3's four norms per block and windowed layers around a global
# one, each kind with its own RoPE.
CASES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "mistral": ("MistralConfig", dict(sliding_window=8, head_dim=24)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16})),
    "olmo2": ("Olmo2Config", dict(rope_theta=5e5)),
    "gemma": ("GemmaConfig", dict(head_dim=24, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=20, tie_word_embeddings=True, sliding_window=8,
        attn_logit_softcapping=0.5, final_logit_softcapping=0.2)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=True, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
}


def hf_config(family: str, vocab_size: int = 101):
    import transformers

    name, extra = CASES[family]
    return getattr(transformers, name)(vocab_size=vocab_size, **(SHAPE | extra))


def hf_model(family: str, vocab_size: int = 101, seed: int = 0):
    import transformers

    config = hf_config(family, vocab_size)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


# Tiny byte-level BPE tokenizers with the pre-tokenizer, special tokens and BOS habit of the
# families' own (trained here on a few kilobytes: no download), for the GGUF export's checks.
# "gpt-2" is lmforge's own kind (`train_tokenizer`).
TOKENIZERS = {
    # Llama 3: its regex, a BOS on every text, BPE that takes a whole word found in the vocabulary
    "llama-bpe": dict(bos="<|begin_of_text|>", eos="<|end_of_text|>", specials=["<|eot_id|>"],
                      ignore_merges=True, nfc=False),
    # Qwen 2/3: its regex, NFC, no BOS, ChatML's turn tokens
    "qwen2": dict(bos=None, eos="<|endoftext|>", specials=["<|im_start|>", "<|im_end|>"], ignore_merges=False,
                  nfc=True),
}


def family_tokenizer(kind: str, texts: list[str], out, vocab_size: int = 400):
    """A `lmforge.data.text.tokenizer.Tokenizer` saved to ``out``, with ``kind``'s pre-tokenizer."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as Backend

    from lmforge.models.gguf_vocab import LLAMA3_REGEX, QWEN2_REGEX
    from lmforge.data.text.tokenizer import Tokenizer

    spec = TOKENIZERS[kind]
    backend = Backend(models.BPE(ignore_merges=spec["ignore_merges"]))
    regex = LLAMA3_REGEX if kind == "llama-bpe" else QWEN2_REGEX
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if spec["nfc"]:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    specials = [t for t in (spec["bos"], spec["eos"], *spec["specials"]) if t]
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if spec["bos"]:
        bos_id = backend.token_to_id(spec["bos"])
        backend.post_processor = processors.TemplateProcessing(single=f"{spec['bos']} $A",
                                                               special_tokens=[(spec["bos"], bos_id)])
    tok = Tokenizer(backend, eos_token=spec["eos"], bos_token=spec["bos"])
    tok.save(str(out))
    return tok
