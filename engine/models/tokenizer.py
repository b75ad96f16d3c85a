"""tokenizer.json through the `tokenizers` library; checkpoints without one work on token ids."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, inner: _HFTokenizer, bos_token_id: int | None, add_bos: bool):
        self.inner = inner
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos and bos_token_id is not None

    @classmethod
    def from_dir(cls, model_dir: str | Path, bos_token_id: int | None = None) -> Tokenizer | None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            inner = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception on malformed files
            raise ValueError(f"tokenizer.json: unreadable ({exc})") from None
        add_bos = False
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                add_bos = bool(json.loads(cfg_path.read_text()).get("add_bos_token", False))
            except ValueError:
                raise ValueError("tokenizer_config.json: not valid JSON") from None
        return cls(inner, bos_token_id, add_bos)

    def encode(self, text: str) -> list[int]:
        ids = self.inner.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size()
