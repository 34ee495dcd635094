"""Fidelity by position: bucket edges, per-record sums and pooled summaries on constructed arrays, the
long-text builder (token length within 1% under two tokenizers, both sources), and the suite end to end
on the fake client."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvbench.suites.base import SuiteError, SuiteOptions
from kvbench.suites.fake import FakeClient, tokenize
from kvbench.suites.fidelity.suite import FidelitySuite, Reference
from kvbench.suites.fidelity.metrics import bucket_edges, by_position_sums, pooled_by_position
from kvbench.suites.fidelity.texts import LongTextSpec, build_long_texts, fit_to_tokens, long_text_spec

QUESTIONS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
             "clips did Natalia sell altogether in April and May?",
             "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did "
             "she earn?",
             "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
             "How much more money does Betty need?"]
ANSWERS = ["Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
           "in April and May.\n#### 72",
           "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
           "$<<0.2*50=10>>10.\n#### 10",
           "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty still needs 100 - 50 = "
           "$<<100-50=50>>50.\n#### 50"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rows = [{"question": f"{QUESTIONS[i % 3]} (case {i})", "answer": ANSWERS[i % 3].replace("####", f"({i}) ####")}
            for i in range(60)]
    (d / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _char_count(s: str) -> int:
    return len(tokenize(s))


@pytest.fixture(scope="module")
def bpe_count(data_dir):
    """A small byte-level BPE tokenizer trained here on the data (merges make tokens per word vary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = (data_dir / "gsm8k_test.jsonl").read_text()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return lambda s: len(tok.encode(s, add_special_tokens=False).ids)


# ------------------------------------------------------------------------------ buckets


def test_bucket_edges():
    assert bucket_edges(100) == [0, 512]
    assert bucket_edges(512) == [0, 512, 1024]  # position 512 opens the second bucket
    assert bucket_edges(5000) == [0, 512, 1024, 2048, 4096, 8192]
    assert bucket_edges(700, 256) == [0, 256, 512, 1024]
    assert bucket_edges(3000, [100, 1000]) == [0, 100, 1000, 2000, 4000]
    for bad in (0, -4, [512, 256], [0, 10], "x", True, [1.5]):
        with pytest.raises(ValueError, match="position_buckets"):
            bucket_edges(10, bad)


def test_record_sums_and_pooled_summary_match_direct_computation():
    rng = np.random.default_rng(0)
    texts = [(rng.exponential(0.01, n), (rng.random(n) < 0.9).astype(float), off)
             for n, off in ((1500, 40), (300, 700), (3000, 12))]
    edges = bucket_edges(max(off + len(kl) for kl, _, off in texts))
    for kl, top1, off in texts:
        sums = by_position_sums(kl, top1, off, edges)
        assert sum(b["n_tokens"] for b in sums) == len(kl)
        assert sum(b["kl_sum"] for b in sums) == pytest.approx(kl.sum())
        for b in sums:
            pos = off + np.arange(len(kl))
            m = (pos >= b["lo"]) & (pos < b["hi"])
            assert b["n_tokens"] == m.sum() > 0
            assert b["kl_sum"] == pytest.approx(kl[m].sum()) and b["top1_sum"] == pytest.approx(top1[m].sum())
    pooled = pooled_by_position([t[0] for t in texts], [t[1] for t in texts], [t[2] for t in texts], edges)
    assert [(b["lo"], b["hi"]) for b in pooled] == [(0, 512), (512, 1024), (1024, 2048), (2048, 4096)]
    assert sum(b["n_tokens"] for b in pooled) == sum(len(t[0]) for t in texts)
    for b in pooled:
        kl_all = np.concatenate([kl[(off + np.arange(len(kl)) >= b["lo"]) & (off + np.arange(len(kl)) < b["hi"])]
                                 for kl, _, off in texts])
        t1_all = np.concatenate([t1[(off + np.arange(len(t1)) >= b["lo"]) & (off + np.arange(len(t1)) < b["hi"])]
                                 for _, t1, off in texts])
        assert b["n_tokens"] == kl_all.size
        assert b["kl_mean"] == pytest.approx(kl_all.mean())
        assert b["kl_p99"] == pytest.approx(np.percentile(kl_all, 99))
        assert b["top1_agree"] == pytest.approx(t1_all.mean())
    # re-pooling the records' sums gives the summary's means (what the report does)
    for b in pooled:
        recs = [s for kl, t1, off in texts for s in by_position_sums(kl, t1, off, edges) if s["lo"] == b["lo"]]
        assert sum(s["kl_sum"] for s in recs) / sum(s["n_tokens"] for s in recs) == pytest.approx(b["kl_mean"])


# ------------------------------------------------------------------------------ long texts


@pytest.mark.parametrize("target", [300, 2048])
@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_long_texts_hit_the_token_length(data_dir, bpe_count, target, tokenizer):
    count = _char_count if tokenizer == "char" else bpe_count
    opts = SuiteOptions(data_dir=str(data_dir), limit=3, progress=False)
    texts, label = build_long_texts(opts, LongTextSpec(target), count)
    assert label == f"gsm8k-concat-{target}" and len(texts) == 3
    for t in texts:
        n = count(t.continuation)
        assert 0.99 * target <= n <= target, (n, target)
        assert t.context.startswith("Question: ") and t.context.endswith("\nAnswer:")
        assert t.context.count("Question:") == 1 and count(t.context) < 250  # a short context: one question
    assert len({t.continuation for t in texts}) == 3  # the texts differ
    again, _ = build_long_texts(opts, LongTextSpec(target), count)
    assert [(t.item_id, t.context, t.continuation) for t in again] == [(t.item_id, t.context, t.continuation) for t in texts]


def test_haystack_texts_and_bad_input(tmp_path, bpe_count):
    hay = tmp_path / "essay.txt"
    hay.write_text("The river ran past the old mill, and the miller counted the sacks twice.\n\n" * 30)
    opts = SuiteOptions(limit=2, progress=False, extra={"text_tokens": 1500, "haystack_file": str(hay)})
    spec = long_text_spec(opts)
    texts, label = build_long_texts(opts, spec, bpe_count)
    assert label.startswith("haystack-") and label.endswith("-1500")
    for t in texts:
        assert 0.99 * 1500 <= bpe_count(t.continuation) <= 1500
        assert "miller" in t.continuation and len(t.context.split()) == 32
    for extra, msg in (({"text_tokens": 1000, "haystack_file": str(tmp_path / "missing.txt")}, "not found"),
                       ({"text_tokens": "many"}, "positive integer"), ({"text_tokens": 0}, "positive integer"),
                       ({"text_tokens": 4}, "at least")):
        with pytest.raises(SuiteError, match=msg):
            long_text_spec(SuiteOptions(progress=False, extra=extra))
    assert long_text_spec(SuiteOptions(progress=False, extra={"haystack_file": str(hay)})) is None  # short texts
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(SuiteError, match="needs more than"):
        build_long_texts(opts, LongTextSpec(100, tmp_path / "short.txt"), bpe_count)


def test_fit_to_tokens_cuts_at_a_word_boundary():
    text = "alpha beta gamma delta epsilon"
    assert fit_to_tokens(text, 10, _char_count) == "alpha beta"
    assert fit_to_tokens(text, 12, _char_count) == "alpha beta g"  # a word boundary would be 17% short
    assert fit_to_tokens(text, 100, _char_count) == text


# ------------------------------------------------------------------------------ the suite


def test_suite_reports_by_position_on_long_texts(tmp_path, data_dir):
    suite = FidelitySuite(Reference("fake-ref", lambda: FakeClient(seed=0)), tmp_path / "cache", top_k=32,
                          greedy_tokens=8, count_tokens=_char_count)
    opts = SuiteOptions(data_dir=str(data_dir), limit=2, progress=False, concurrency=1,
                        extra={"text_tokens": 1200, "position_buckets": 256})
    res = suite.run(FakeClient(seed=0, noise=0.5), opts)
    assert "texts=gsm8k-concat-1200" in res.records[0]["protocol"] and "gsm8k-concat-1200" in res.source
    total = 0
    for r in res.records:
        n = int(r["scores"]["n_tokens"])
        assert 0.99 * 1200 <= n <= 1200
        by = r["by_position"]
        assert sum(b["n_tokens"] for b in by) == n
        assert by[0]["lo"] <= r["prompt_tokens"] < by[0]["hi"]  # the first scored token sits after the context
        assert sum(b["kl_sum"] for b in by) / n == pytest.approx(r["scores"]["kl_mean"])
        assert sum(b["top1_sum"] for b in by) / n == pytest.approx(r["scores"]["top1_agree"])
        total += n
    pooled = res.summary["by_position"]
    assert [(b["lo"], b["hi"]) for b in pooled] == [(0, 256), (256, 512), (512, 1024), (1024, 2048)]
    assert sum(b["n_tokens"] for b in pooled) == total == res.summary["n_tokens"]
    assert all(b["kl_mean"] > 0 and b["kl_p99"] >= b["kl_mean"] and 0 < b["top1_agree"] <= 1 for b in pooled)
    # the pooled mean over buckets is the overall token-weighted mean
    assert sum(b["kl_mean"] * b["n_tokens"] for b in pooled) / total == pytest.approx(res.summary["kl_mean"])
    with pytest.raises(SuiteError, match="position_buckets"):
        suite.run(FakeClient(seed=0), SuiteOptions(data_dir=str(data_dir), limit=1, progress=False,
                                                   extra={"position_buckets": [512, 100]}))


def test_long_texts_need_a_tokenizer(data_dir):
    suite = FidelitySuite(Reference("fake-ref", lambda: FakeClient(seed=0)), None)
    with pytest.raises(SuiteError, match="tokenizer"):
        suite.run(FakeClient(seed=0), SuiteOptions(data_dir=str(data_dir), limit=1, progress=False,
                                                   extra={"text_tokens": 100}))


def test_long_texts_must_fit_the_target_context(data_dir):
    opts = SuiteOptions(data_dir=str(data_dir), limit=1, progress=False)
    with pytest.raises(SuiteError, match="more than the target's context of 1000; use text_tokens up to"):
        build_long_texts(opts, LongTextSpec(1000), _char_count, max_model_len=1000)
    texts, _ = build_long_texts(opts, LongTextSpec(700), _char_count, max_model_len=1000)
    assert _char_count(texts[0].context) + _char_count(texts[0].continuation) + 1 <= 1000
