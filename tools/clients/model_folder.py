"""A small random Qwen3 folder for the client lane: ``config.json`` and seeded
weights written by ``transformers``, a byte-level BPE ``tokenizer.json`` trained here
(no download) with ChatML's special tokens, and a ``tokenizer_config.json`` that
carries Vertumnus's built-in ChatML template, so that ``serve`` and the benchmark
clients (``AutoTokenizer`` on the folder) read the same tokenizer.

    python -m tools.clients.model_folder FOLDER [HEAD_DIM]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 512
MAX_POSITIONS = 4096
# Text for the BPE merges: sentences in the clients' own domain.
TEXT = (
    "A benchmark client sends many requests and measures the time to the first token.",
    "The server streams tokens back as server-sent events until the answer is complete.",
    "Throughput, latency and the inter-token gap are reported for every concurrency.",
    "Prompts are drawn from a corpus of plays, poems and synthetic words of every length.",
)


def write_tokenizer(folder: Path) -> int:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``folder``; returns the id
    of ``<|im_end|>`` (the end of a turn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from vertumnus.protocol.chat import BUILTIN

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        list(TEXT) * 10,
        trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=list(SPECIAL),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    bpe.save(str(folder / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": MAX_POSITIONS,
        "chat_template": BUILTIN,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    end = bpe.token_to_id("<|im_end|>")
    assert end is not None and bpe.get_vocab_size() <= VOCAB_SIZE
    return int(end)


def write_model_folder(
    folder: Path,
    seed: int = 0,
    head_dim: int = 16,
    hidden_size: int = 64,
    layers: int = 2,
    max_positions: int = MAX_POSITIONS,
) -> Path:
    """A Qwen3 (two layers by default) with grouped-query attention and its tokenizer
    in ``folder`` (``head_dim`` 64 for vLLM's CPU attention, which takes 32 and up)."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    end = write_tokenizer(folder)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=end,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(folder)  # fp32, as built
    return folder


if __name__ == "__main__":
    head = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    print(write_model_folder(Path(sys.argv[1]), head_dim=head))
