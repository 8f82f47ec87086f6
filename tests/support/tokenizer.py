"""A small Hugging Face tokenizer for tests: a byte-level BPE trained here (no
download) with ChatML's special tokens and a Qwen-style chat template, saved by
``transformers`` into a model folder so that both Vertumnus and transformers read
the same files."""

from __future__ import annotations

from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's template without tools: a default system message, ChatML turns.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "The prefill pool computes the key and value cache of every prompt token.",
    "A decode server generates one token at a time for each sequence in its batch.",
    "Context parallelism splits a long prompt over several ranks in zigzag order.",
    "Hello, world! How are you today? I am fine, thank you very much.",
    "Ünïcödé text, numbers 0123456789 and punctuation: ;,.!?()[]{}<>",
] * 20


def make_tokenizer(folder: Path, vocab_size: int, chat_template: str = CHAT_TEMPLATE) -> int:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (and the chat template)
    into ``folder``; the vocabulary fits in ``vocab_size``. Returns the id of
    ``<|im_end|>`` (the end of a turn: the model's end-of-sequence id)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= vocab_size
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = chat_template
    hf.save_pretrained(folder)
    end = tok.token_to_id("<|im_end|>")
    assert end is not None
    return end
