"""Tokenizers: the built-in byte-level one (no files needed) or one loaded from a local path."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then BOS, EOS and PAD. Needs no file, so nothing is downloaded."""

    def __init__(self) -> None:
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A `tokenizer.json` file, or a directory `AutoTokenizer` can load, from local disk."""

    def __init__(self, path: str) -> None:
        location = Path(path).expanduser()
        if not location.exists():
            raise FileNotFoundError(
                f"data.tokenizer {path!r} does not exist; give a tokenizer.json, a tokenizer directory, or 'byte'"
            )
        if location.is_file():
            from tokenizers import Tokenizer as RawTokenizer

            raw = RawTokenizer.from_file(str(location))
            self._encode = lambda text: raw.encode(text, add_special_tokens=False).ids
            self._decode = raw.decode
            self.vocab_size = raw.get_vocab_size(with_added_tokens=True)
            eos = next((raw.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
                        if raw.token_to_id(t) is not None), None)
        else:
            from transformers import AutoTokenizer

            auto = AutoTokenizer.from_pretrained(str(location))
            self._encode = lambda text: auto.encode(text, add_special_tokens=False)
            self._decode = auto.decode
            self.vocab_size = len(auto)
            eos = auto.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer at {path} has no end-of-sequence token; add one (e.g. '</s>') to it")
        self.eos_id = int(eos)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)


def load_tokenizer(name: str) -> Tokenizer:
    return ByteTokenizer() if name == "byte" else HuggingFaceTokenizer(name)
