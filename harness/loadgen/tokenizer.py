"""Tokenizers for the load generator: a local one (tokenizer.json / HF directory) or the server's own.

The server's tokenizer is reached through the ``/tokenizer_info``, ``/tokenize`` and ``/detokenize``
routes (kvbench's server and vLLM have them); it is used only while preparing prompts, never inside
the timed run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence


class RemoteTokenizer:
    def __init__(self, base_url: str, info: dict, api_key: Optional[str] = None, timeout: float = 30.0):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.vocab_size = int(info.get("vocab_size") or 32000)
        self.info = info

    @classmethod
    def probe(cls, base_url: str, api_key: Optional[str] = None) -> Optional["RemoteTokenizer"]:
        """The server's tokenizer when it offers /tokenizer_info, else None."""
        import httpx

        try:
            r = httpx.get(base_url.rstrip("/") + "/tokenizer_info", timeout=10.0)
            if r.status_code != 200 or not isinstance(r.json(), dict):
                return None
            return cls(base_url, r.json(), api_key)
        except (httpx.HTTPError, ValueError):
            return None

    def encode(self, text: str) -> list[int]:
        r = self._http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def decode(self, ids: Sequence[int]) -> str:
        r = self._http.post("/detokenize", json={"tokens": list(ids)})
        r.raise_for_status()
        return str(r.json()["prompt"])

    def close(self) -> None:
        self._http.close()


class LocalTokenizer:
    """A ``tokenizer.json`` file, or a directory holding one (fast tokenizers; no model code is run)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        self._tok = Tokenizer.from_file(str(p))
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def close(self) -> None:
        pass


def resolve_tokenizer(spec: Optional[str], base_url: str, api_key: Optional[str] = None):
    """``spec``: a path, ``"server"`` (required remote), ``"none"``, or None (the server's when offered)."""
    if spec == "none":
        return None
    if spec in (None, "server"):
        tok = RemoteTokenizer.probe(base_url, api_key)
        if tok is None and spec == "server":
            raise ValueError(f"{base_url} offers no /tokenizer_info; pass --tokenizer PATH")
        return tok
    return LocalTokenizer(spec)
