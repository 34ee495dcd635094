"""The server stays up under huge prompts: an oversized body gets a 413 within a second without being held in
memory, a large-but-legal prompt is tokenized off the event loop and turned away with a 400, and meanwhile
``/health`` and other streams keep answering.  Also the tokenizer's ``min_token_count`` lower bound, which
lets the server turn away a prompt that cannot fit before tokenizing it, is checked to be a true bound."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_fakes import FakeEngine, FakeTokenizer, serve  # noqa: E402

from kvbench.runtime.server import create_app, default_max_body_bytes  # noqa: E402

MIB = 2**20
CAP = 8 * MIB  # the fake engine's context is 256 tokens: the default cap is the 8 MiB floor
HEALTH_BOUND_S = 1.0  # each /health reply while a huge request is in flight (they take ~ms when the loop is free)


def _body(prompt_chars: int, chat: bool = False) -> bytes:
    text = "x" * prompt_chars
    if chat:
        return json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()
    return json.dumps({"model": "fake-model", "prompt": text, "max_tokens": 1}).encode()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Watch:
    """Polls ``/health`` every 20 ms and samples this process's RSS while running."""

    def __init__(self, url: str):
        self.url, self.stop = url, threading.Event()
        self.health: list[tuple[float, float, int]] = []  # (sent, answered, status)
        self.rss0 = _rss_mb()
        self.rss_peak = self.rss0
        self.threads = [threading.Thread(target=self._health, daemon=True), threading.Thread(target=self._rss, daemon=True)]

    def _health(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                status = c.get(self.url + "/health").status_code
                self.health.append((t, time.perf_counter(), status))
                time.sleep(0.02)

    def _rss(self) -> None:
        while not self.stop.is_set():
            self.rss_peak = max(self.rss_peak, _rss_mb())
            time.sleep(0.005)

    def __enter__(self):
        for t in self.threads:
            t.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        time.sleep(0.1)
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def during(self, t0: float, t1: float) -> list[float]:
        """Latencies of the /health requests that overlapped [t0, t1] (all must have been 200s)."""
        hits = [(b - a, s) for a, b, s in self.health if b >= t0 and a <= t1]
        assert all(s == 200 for _, s in hits)
        return [d for d, _ in hits]


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(step_s=0.01)
    with serve(create_app(engine)) as url:
        yield url, engine
    engine.shutdown()


def test_default_cap_follows_the_context():
    assert default_max_body_bytes(256) == CAP
    assert default_max_body_bytes(131072) == CAP
    assert default_max_body_bytes(1 << 20) == 64 * MIB


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_64mb_body_gets_413_fast_without_buffering_while_health_answers(server, chunked):
    url, _ = server
    body = _body(64 * MIB)
    # chunked: no Content-Length, so the cap must be enforced while reading the stream
    content = (body[i:i + 256 * 1024] for i in range(0, len(body), 256 * 1024)) if chunked else body
    with Watch(url) as w:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", content=content, headers={"Content-Type": "application/json"}, timeout=120)
        t1 = time.perf_counter()
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert "larger than this server's limit of 8388608 bytes" in err["message"] and err["type"] == "invalid_request_error"
    assert t1 - t0 < 5.0, f"413 took {t1 - t0:.2f} s"
    lat = w.during(t0, t1)
    assert lat and max(lat) < HEALTH_BOUND_S, lat
    # the server read at most ~the cap of the 64 MiB body: the old path held the body, its text and its tokens (> 600 MB)
    assert w.rss_peak - w.rss0 < 200, f"RSS grew {w.rss_peak - w.rss0:.0f} MB"
    ok = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_body_at_the_cap_is_read_and_one_byte_more_is_not():
    engine = FakeEngine()
    with serve(create_app(engine, max_body_bytes=300)) as url:
        fits = json.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": 2}).encode()
        fits = fits[:-1] + b" " * (300 - len(fits)) + b"}"  # exactly 300 bytes of valid JSON
        assert len(fits) == 300
        r = httpx.post(url + "/v1/completions", content=fits, headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        r = httpx.post(url + "/v1/completions", content=fits[:-1] + b" }", headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "limit of 300 bytes" in r.json()["error"]["message"]
        r = httpx.post(url + "/tokenize", content=fits[:-1] + b" }", headers={"Content-Type": "application/json"})
        assert r.status_code == 413
    engine.shutdown()
    with pytest.raises(ValueError):
        create_app(FakeEngine(), max_body_bytes=0)


class GilFreeTokenizer(FakeTokenizer):
    """The fake tokenizer, made as slow as a real one on long texts (~0.2 us per character, spent in a call
    that releases the GIL, as the Rust tokenizer does); counts the characters it encodes."""

    def __init__(self):
        self.encoded_chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        time.sleep(len(text) * 2e-7)
        self.encoded_chars += len(text)
        return super().encode(text, add_special_tokens)


class BoundedTokenizer(GilFreeTokenizer):
    """One token per character (plus BOS): the count of characters is a true lower bound."""

    def min_token_count(self, text: str) -> int:
        return len(text)


def _stream_chunks(url: str, out: list, started: threading.Event) -> None:
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        for _ in r.iter_lines():
            out.append(time.perf_counter())
            started.set()


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_large_legal_prompt_is_tokenized_off_the_loop_and_gets_400(chat):
    tok = GilFreeTokenizer()
    engine = FakeEngine(step_s=0.01)
    engine.tokenizer = tok
    with serve(create_app(engine)) as url:
        body = _body(CAP - 500, chat)  # under the cap: it must be parsed and tokenized (~2.5 s of work)
        assert len(body) <= CAP
        chunks: list[float] = []
        started = threading.Event()
        streamer = threading.Thread(target=_stream_chunks, args=(url, chunks, started), daemon=True)
        with Watch(url) as w:
            streamer.start()
            assert started.wait(30)
            t0 = time.perf_counter()
            r = httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), content=body,
                           headers={"Content-Type": "application/json"}, timeout=120)
            t1 = time.perf_counter()
            streamer.join(60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == ("messages" if chat else "prompt")
        assert f"prompt has {CAP - 500 + (len('<|user|>') + 1 + len('<|assistant|>') if chat else 1)} tokens" in err["message"]
        assert "context is 256 tokens" in err["message"]
        assert tok.encoded_chars >= CAP - 500  # it was tokenized, then turned away
        assert t1 - t0 < 30.0
        lat = w.during(t0, t1)
        assert len(lat) >= 3 and max(lat) < HEALTH_BOUND_S, lat
        gaps = [b - a for a, b in zip(chunks, chunks[1:]) if b >= t0 and a <= t1]
        assert gaps and max(gaps) < HEALTH_BOUND_S, max(gaps, default=None)  # the other stream kept flowing
        assert len(chunks) >= 200  # and finished
    engine.shutdown()


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_prompt_that_cannot_fit_is_refused_before_tokenizing(chat):
    tok = BoundedTokenizer()
    engine = FakeEngine()
    engine.tokenizer = tok
    with serve(create_app(engine)) as url:
        t0 = time.perf_counter()
        r = httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), content=_body(CAP - 500, chat),
                       headers={"Content-Type": "application/json"}, timeout=60)
        elapsed = time.perf_counter() - t0
        assert r.status_code == 400, r.text
        assert "prompt has at least" in r.json()["error"]["message"] and r.json()["error"]["code"] == "context_length_exceeded"
        assert tok.encoded_chars == 0 and elapsed < 1.5  # never tokenized (that alone would take ~1.7 s)
        # a prompt the bound lets through is tokenized and served as before
        r = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "x" * 200, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": 201, "completion_tokens": 3, "total_tokens": 204}
        r = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "x" * 255, "max_tokens": 1})
        assert r.status_code == 400 and "prompt has 256 tokens" in r.json()["error"]["message"]
    engine.shutdown()


def test_long_token_id_prompt_is_refused_on_its_length(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": [5] * 300_000, "max_tokens": 1})
    assert r.status_code == 400 and "prompt has 300000 tokens; this model's context is 256 tokens" in r.json()["error"]["message"]


def test_openai_client_normal_oversize_and_over_context(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = client.completions.create(model="fake-model", prompt="hello", max_tokens=4)
    assert out.usage.completion_tokens == 4 and len(out.choices[0].text) == 4
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="fake-model", prompt="x" * (64 * MIB), max_tokens=1)
    assert e.value.status_code == 413 and "larger than this server's limit" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x" * 100_000}], max_tokens=1)
    assert e.value.status_code == 400 and "this model's context is 256 tokens" in e.value.message


def test_serve_cli_passes_max_body_mb(monkeypatch):
    from typer.testing import CliRunner

    import kvbench.runtime.server as srv
    from kvbench.harness.cli import app

    seen = {}
    monkeypatch.setattr(srv, "run_server", lambda engine, **kw: seen.update(kw))
    r = CliRunner().invoke(app, ["serve", "--model", "synthetic:llama-3-8b", "--max-body-mb", "2.5", "--port", "8123"])
    assert r.exit_code == 0, r.output
    assert seen["max_body_bytes"] == int(2.5 * MIB) and seen["port"] == 8123
    r = CliRunner().invoke(app, ["serve", "--model", "synthetic:llama-3-8b"])
    assert r.exit_code == 0 and seen["max_body_bytes"] is None
    r = CliRunner().invoke(app, ["serve", "--max-body-mb", "0"])
    assert r.exit_code != 0


# -- the tokenizer's lower bound --------------------------------------------------------------------------

def _byte_level_bpe(corpus: list[str]):
    """A small byte-level BPE (the family of GPT-2, Llama 3, SmolLM2) trained here, with long tokens."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvbench.core.tokenizer import Tokenizer

    rt = RustTokenizer(models.BPE())
    rt.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rt.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>"], max_token_length=64)
    rt.train_from_iterator(corpus, trainer)
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rt, eos_token="<|endoftext|>"))


def _adversarial_texts(rng: random.Random) -> list[str]:
    texts = ["#" * 5000, "=" * 777, " " * 3000, "\n" + " " * 63, "<|im_start|>" * 200, "hello world " * 300,
             "\U00050000" * 300, "é" * 1000, "ab" * 2000]
    pools = [" #=-\n\t", "abc def\n", "<|im_start|>### ", "héllo wörld ", "\U0001F600\U00050000a "]
    for _ in range(60):
        pool = rng.choice(pools + ["".join(chr(rng.randint(32, 0x10FFFF)) for _ in range(30))])
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 2000)))
        texts.append(text.encode("utf-8", "ignore").decode("utf-8", "ignore"))
    return texts


def test_min_token_count_is_a_true_lower_bound_for_byte_level_bpe():
    rng = random.Random(7)
    tok = _byte_level_bpe(["#" * 64, "=" * 64, " " * 64, "hello world " * 20, "the quick brown fox " * 20] * 50)
    longest, _ = tok._token_bound
    assert longest >= 32  # the long runs were learned as long tokens, so the bound is not trivially ch/1
    tight = 0
    for text in _adversarial_texts(rng):
        n = len(tok.encode(text, add_special_tokens=False))
        assert tok.min_token_count(text) <= n, (text[:40], tok.min_token_count(text), n)
        tight += tok.min_token_count(text) * 2 >= n
    assert tight >= 3  # the bound is close on the long runs (not a vacuous 0)


def test_byte_level_bound_refuses_tokenizers_it_cannot_bound():
    from kvbench.core.tokenizer import _BYTE_CHARS, byte_level_token_bound

    vocab = {c: i for i, c in enumerate(_BYTE_CHARS.values())} | {"Ġthe": 300, "################": 301}
    base = {"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": vocab},
            "added_tokens": [{"content": "<|endoftext|>", "lstrip": False, "rstrip": False}]}
    assert byte_level_token_bound(base) == (16, "")
    seq = {"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Isolated"}, {"type": "ByteLevel"}]}
    assert byte_level_token_bound(base | {"pre_tokenizer": seq}) == (16, "")
    no_ctrl = {c: i for c, i in vocab.items() if c != _BYTE_CHARS[4]}
    assert byte_level_token_bound(base | {"model": {"type": "BPE", "vocab": no_ctrl}}) == (16, "\x04")
    removed = {"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Removed"}, {"type": "ByteLevel"}]}
    no_cont = {c: i for c, i in vocab.items() if c != _BYTE_CHARS[0x85]}
    for bad in ({"normalizer": {"type": "NFC"}}, {"pre_tokenizer": removed}, {"pre_tokenizer": {"type": "Whitespace"}},
                {"model": {"type": "BPE", "vocab": no_cont}}, {"model": {"type": "BPE", "vocab": vocab, "unk_token": "<unk>"}},
                {"model": {"type": "WordPiece", "vocab": vocab}},
                {"added_tokens": [{"content": "<mask>", "lstrip": True, "rstrip": False}]}):
        assert byte_level_token_bound(base | bad) is None, bad


@pytest.mark.slow
def test_min_token_count_on_the_default_model_tokenizer():
    from kvbench.runtime.default_model import default_model_path
    from kvbench.core.tokenizer import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path.parent, gguf_file=path.name)
    assert tok._token_bound is not None  # SmolLM2's byte-level BPE is bounded (it drops a few control bytes)
    for text in _adversarial_texts(random.Random(3)) + ["\x04\x06" * 500 + "a", "\x13" * 100]:
        assert tok.min_token_count(text) <= len(tok.encode(text, add_special_tokens=False)), text[:40]
    prose = "The quick brown fox jumps over the lazy dog near the river bank. " * 10_000  # 650k characters
    assert tok.min_token_count(prose * 2) >= 8192  # 1.3 M characters cannot fit an 8k context: refused untokenized
