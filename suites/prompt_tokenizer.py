"""Prompt tokenizers: what a suite needs to build prompts of an exact token length for a target.

A ``PromptTokenizer`` has ``encode(text)`` / ``decode(ids)`` (plain text, no special tokens),
``prompt_ids(request)`` (every token id the target sees for a ``GenRequest``: a completion prompt with the
tokenizer's special tokens such as BOS, chat messages through the chat template), ``has_chat_template``
and ``name`` (for provenance).

- ``HFPromptTokenizer``: a kvbench ``core.tokenizer.Tokenizer`` (the embedded engine's own, an HF
  directory, a GGUF file or a hub name); ``EngineClient.tokenizer()`` passes its own ``prompt_ids`` so the
  count is exactly what ``generate`` sends.
- ``JsonPromptTokenizer``: a bare ``tokenizer.json`` (no chat template: completion prompts only).
- ``RemotePromptTokenizer``: a server's ``/tokenize`` and ``/detokenize`` routes (kvbench, vLLM); chat
  prompts through ``/tokenize`` with ``messages`` when the server takes them, else the chat template from
  ``/tokenizer_info`` rendered here (jinja sandbox) and tokenized without special tokens, as the kvbench
  server does.

``load_prompt_tokenizer(spec)`` resolves ``--tokenizer``: an existing path (directory, tokenizer.json,
.gguf) or a hub name (loaded only when the hub or its cache can serve it; never runs checkpoint code).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

from kvbench.core import GenRequest


class PromptTokenizerError(ValueError):
    """A tokenizer cannot be loaded or reached; the message says what to pass instead."""


class PromptTokenizer(Protocol):
    name: str
    has_chat_template: bool

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def prompt_ids(self, request: GenRequest) -> list[int]: ...


class HFPromptTokenizer:
    def __init__(self, tok, name: str, prompt_ids: Optional[Callable[[GenRequest], list[int]]] = None):
        self._tok = tok
        self.name = name
        self.has_chat_template = bool(getattr(tok, "chat_template", None))
        self._ids = prompt_ids

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, request: GenRequest) -> list[int]:
        if self._ids is not None:
            return list(self._ids(request))
        if request.messages is not None:
            # a template holds the special tokens it wants; a templateless transcript gets the tokenizer's own
            # (its BOS), as the embedded engine encodes it (``Tokenizer.encode_chat``)
            return list(self._tok.encode(self._tok.apply_chat_template(request.messages, add_generation_prompt=True),
                                         add_special_tokens=not self.has_chat_template))
        return list(self._tok.encode(request.prompt, add_special_tokens=True))


class JsonPromptTokenizer:
    def __init__(self, tok, name: str):
        self._tok = tok  # tokenizers.Tokenizer
        self.name = name
        self.has_chat_template = False

    @classmethod
    def from_file(cls, path: str) -> "JsonPromptTokenizer":
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)), f"tokenizer.json:{path}")
        except Exception as e:
            raise PromptTokenizerError(f"cannot load tokenizer file {path}: {e}") from None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, request: GenRequest) -> list[int]:
        if request.messages is not None:
            raise PromptTokenizerError(f"{self.name} has no chat template; use completion prompts")
        return list(self._tok.encode(request.prompt, add_special_tokens=True).ids)


def render_chat_template(template: str, messages: list[dict], info: dict) -> str:
    """A HF-style chat template rendered in jinja's sandbox (trim_blocks, lstrip_blocks, ``raise_exception``)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=info.get("bos_token") or "", eos_token=info.get("eos_token") or "")


class RemotePromptTokenizer:
    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 120.0, transport=None):
        import httpx

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self.name = f"server:{self.base_url}/tokenize"
        self._chat_route: Optional[bool] = None  # whether /tokenize takes messages (unknown until tried)
        try:
            self.encode("probe")
        except Exception as e:
            raise PromptTokenizerError(f"{self.base_url} offers no usable /tokenize route ({e}); pass --tokenizer "
                                       "(a tokenizer.json, an HF directory or a hub name)") from None
        try:
            r = self._http.get("/tokenizer_info")
            self.info = r.json() if r.status_code == 200 and isinstance(r.json(), dict) else {}
        except (httpx.HTTPError, ValueError):
            self.info = {}
        self.has_chat_template = bool(self.info.get("chat_template")) or self._try_chat_route()

    def _post(self, path: str, body: dict) -> dict:
        r = self._http.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:200]}")
        return r.json()

    def _try_chat_route(self) -> bool:
        try:
            self._post("/tokenize", {"messages": [{"role": "user", "content": "probe"}], "add_generation_prompt": True})
            self._chat_route = True
        except Exception:
            self._chat_route = False
        return self._chat_route

    def encode(self, text: str) -> list[int]:
        return list(self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._post("/detokenize", {"tokens": list(ids)})["prompt"])

    def prompt_ids(self, request: GenRequest) -> list[int]:
        if request.messages is None:
            return list(self._post("/tokenize", {"prompt": request.prompt, "add_special_tokens": True})["tokens"])
        if self._chat_route is None:
            self._try_chat_route()
        if self._chat_route:
            return list(self._post("/tokenize", {"messages": request.messages, "add_generation_prompt": True})["tokens"])
        template = self.info.get("chat_template")
        if not template:
            raise PromptTokenizerError(f"{self.base_url} gives no chat template; use completion prompts or --tokenizer")
        text = render_chat_template(template, request.messages, self.info)
        return list(self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"])

    def close(self) -> None:
        self._http.close()


def load_prompt_tokenizer(spec: str) -> PromptTokenizer:
    """``--tokenizer``: a directory (HF files or one .gguf), a tokenizer.json, a .gguf file, or a hub name."""
    from kvbench.core import load_tokenizer

    p = Path(spec).expanduser()
    try:
        if p.is_dir():
            if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
                ggufs = sorted(p.glob("*.gguf"))
                if len(ggufs) == 1:
                    return HFPromptTokenizer(load_tokenizer(p, ggufs[0].name), f"gguf:{ggufs[0]}")
                raise PromptTokenizerError(f"--tokenizer {spec}: the directory holds no tokenizer.json, "
                                           "tokenizer_config.json or single .gguf file")
            return HFPromptTokenizer(load_tokenizer(p), f"hf:{p}")
        if p.is_file():
            if p.suffix == ".gguf":
                return HFPromptTokenizer(load_tokenizer(p.parent, p.name), f"gguf:{p}")
            return JsonPromptTokenizer.from_file(str(p))
    except PromptTokenizerError:
        raise
    except Exception as e:
        raise PromptTokenizerError(f"--tokenizer {spec}: cannot load it: {type(e).__name__}: {e}") from None
    if spec.startswith((".", "/", "~")) or spec.endswith((".json", ".gguf")):
        raise PromptTokenizerError(f"--tokenizer {spec}: no such file or directory")
    return _hub_tokenizer(spec)


def _hub_tokenizer(name: str) -> PromptTokenizer:
    """A hub tokenizer: from the local cache, else from the hub when it answers (checked first, so an
    unreachable hub is one quick error instead of minutes of retries)."""
    import os

    import httpx

    from kvbench.core import Tokenizer

    def load(local_only: bool):
        from transformers import AutoTokenizer

        return HFPromptTokenizer(Tokenizer(AutoTokenizer.from_pretrained(name, local_files_only=local_only,
                                                                         trust_remote_code=False)), f"hub:{name}")

    hint = "pass a local tokenizer.json, HF directory or .gguf file"
    try:
        return load(True)
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise PromptTokenizerError(f"--tokenizer {name}: not a local path, not in the hub cache, and HF_HUB_OFFLINE is "
                                   f"set; {hint}")
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        httpx.head(endpoint, timeout=5.0)
    except httpx.HTTPError as e:
        raise PromptTokenizerError(f"--tokenizer {name}: not a local path or cached, and the hub ({endpoint}) cannot "
                                   f"be reached ({type(e).__name__}); {hint}") from None
    try:
        return load(False)
    except Exception as e:
        raise PromptTokenizerError(f"--tokenizer {name}: not a local path, and loading it from the hub failed "
                                   f"({type(e).__name__}: {str(e)[:300]}); {hint}") from None
