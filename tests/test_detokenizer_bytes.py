"""The byte-level fast path of incremental detokenization (core/tokenizer.py ``Tokenizer.byte_pieces``): the same
stream deltas and final text as decoding the window twice per token, on the default model's tokenizer, and no
fast path where joining bytes is not what ``decode`` does."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvbench.core import IncrementalDetokenizer
from kvbench.core.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def smol():
    from kvbench.runtime.default_model import default_model_path

    path = Path(default_model_path(quiet=True))
    return load_tokenizer(path.parent, gguf_file=path.name)


def _deltas(tok, ids, fast: bool):
    d = IncrementalDetokenizer(tok, [1, 2])
    if not fast:
        d._pieces = None  # the window decode (what every tokenizer without byte pieces uses)
    return [d.add(i) for i in ids] + [d.flush()], d.text


def test_byte_pieces_give_the_window_decodes_deltas(smol):
    assert smol.byte_pieces is not None and len(smol.byte_pieces) == smol.vocab_size
    rng = random.Random(5)
    specials = [i for i, p in enumerate(smol.byte_pieces) if p is None]
    assert specials  # <|im_end|> and friends: skipped by decode, and by the fast path
    # multi-byte characters cut between tokens: single-byte tokens of a UTF-8 sequence, one at a time
    byte_ids = [smol.encode(ch, add_special_tokens=False) for ch in ("é", "漢", "🙂")]
    cases = [[rng.randrange(smol.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(150)]
    cases += [sum(byte_ids, []) + specials[:3] + sum(byte_ids, [])]
    cases += [[rng.choice(specials + [rng.randrange(smol.vocab_size)]) for _ in range(20)] for _ in range(20)]
    cases += [smol.encode("Héllo wörld, 漢字 and 🙂 emoji.", add_special_tokens=False)]
    for ids in cases:
        assert _deltas(smol, ids, True) == _deltas(smol, ids, False), ids
    text = "Héllo wörld, 漢字 and 🙂 emoji."
    assert _deltas(smol, smol.encode(text, add_special_tokens=False), True)[1] == text


def test_no_fast_path_where_joining_bytes_is_not_decode():
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def build(decoder):
        t = RustTokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoder
        t.train_from_iterator(["the grass is green, what colour is the grass?"] * 4,
                              trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>"))

    plain = build(decoders.ByteLevel())
    assert plain.byte_pieces is not None
    ids = plain.encode("the green grass", add_special_tokens=False)
    assert _deltas(plain, ids, True) == _deltas(plain, ids, False)
    # a decoder that does more than join bytes (strip a leading space): the window decode stays
    assert build(decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])).byte_pieces is None
    wordlevel = RustTokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    assert Tokenizer(PreTrainedTokenizerFast(tokenizer_object=wordlevel)).byte_pieces is None


def test_tokenizer_definition_is_parsed_once_for_both_byte_tables(smol, monkeypatch):
    """The byte bound and the byte pieces (both built as an engine starts) read the tokenizer.json definition:
    parsed once for the two, then let go."""
    tok = Tokenizer(smol._tok)
    calls = []
    real = Tokenizer._parse_definition
    monkeypatch.setattr(Tokenizer, "_parse_definition", lambda self: calls.append(1) or real(self))
    assert tok.byte_pieces is not None and tok._byte_bound is not None
    assert calls == [1] and "_definition_kept" not in tok.__dict__
    assert tok.byte_pieces == smol.byte_pieces
