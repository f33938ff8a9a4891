"""Byte-level BPE tokenizer trained with the ``tokenizers`` library and saved for transformers.

Saved files: tokenizer.json, tokenizer_config.json (tokenizer_class PreTrainedTokenizerFast) and
special_tokens_map.json, so ``AutoTokenizer`` / ``PreTrainedTokenizerFast.from_pretrained`` load it.
One special token, ``<|endoftext|>`` (id 0), separates documents and serves as bos/eos/pad.
"""
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.token_to_id(EOS) != 0:
        raise RuntimeError(f"expected {EOS} to get id 0, got {tok.token_to_id(EOS)}")
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write the files by hand: ``save_pretrained`` of transformers 5 names a class that transformers 4 lacks."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def load_for_transformers(out_dir: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(out_dir))


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[int]:
    """Concatenate the documents' token ids, each document followed by EOS."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return ids
