"""The same full-precision window for every method, and the line-recall retrieval format."""

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from quantmla.evaluation.configs import named_config
from quantmla.evaluation.harness import RowSpec
from quantmla.evaluation.line_recall import make_line_samples
from quantmla.model.tiny import tiny_model


def _reads(model, cache, ids):
    """(latent, k_rope) [B, T, ·] as the first MLA layer reads them back after a prefill of `ids`."""
    keep = {}
    layer = cache.mla_layers()[0]
    orig = layer.update

    def spy(k, v, *a, **kw):
        keep["raw"] = (k[:, 0].clone(), v[:, 0].clone())
        out = orig(k, v, *a, **kw)
        keep["read"] = (out[0][:, 0], out[1][:, 0])
        return out

    layer.update = spy
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return keep["raw"], keep["read"]


@pytest.mark.parametrize("method", ["rtn", "kivi"])
def test_every_method_gets_the_same_window(method):
    """--fp-window W: the newest W tokens of both paths are read exactly, older ones quantized, for every
    method; with W = 0 (the default) nothing is read at full precision, KIVI's unfinished block included."""
    torch.manual_seed(0)
    model = tiny_model("deepseek_v3")
    ids = torch.randint(3, 128, (1, 12))
    cfg = named_config("INT4/INT4", 16, 8)
    for window in (0, 4):
        row = RowSpec(cfg, method, kivi_block=8, fp_window=window)
        (lat, kr), (lat_r, kr_r) = _reads(model, row.cache_factory()(model), ids)
        if window:
            assert torch.equal(lat_r[:, -window:], lat[:, -window:]) and torch.equal(kr_r[:, -window:], kr[:, -window:])
        older = slice(0, 12 - window)
        assert not torch.equal(lat_r[:, older], lat[:, older]) and not torch.equal(kr_r[:, older], kr[:, older])
        if window == 0:  # the last 4 tokens (KIVI: an unfinished block of 8) are quantized too
            assert not torch.equal(kr_r[:, -4:], kr[:, -4:])
        assert (f"newest {window} tokens unquantized" in row.describe()) == bool(window)


def _docs():
    std = Path(sysconfig.get_paths()["stdlib"])
    return [(std / n).read_text() for n in ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "argparse.py")]


def test_line_recall_samples():
    """A line asked for is unique in the context, its answer appears nowhere else, the control lacks the line."""
    from transformers import AutoTokenizer

    from quantmla.corpus.datasets import model_path

    tok = AutoTokenizer.from_pretrained(model_path())
    samples = make_line_samples(tok, _docs(), 1024, 6, seed=0)
    assert len(samples) == 6
    assert samples == make_line_samples(tok, _docs(), 1024, 6, seed=0)  # deterministic
    for s in samples:
        prompt, answer, control = (tok.decode(s[k]) for k in ("prompt_ids", "answer_ids", "control_prompt_ids"))
        assert len(s["prompt_ids"]) + len(s["answer_ids"]) <= 1024
        head = prompt.rsplit("\n", 1)[1]  # the prompt ends with the line's first half
        assert (head + answer).strip() == s["line"]
        assert prompt.count(s["line"]) == 1 and s["line"] not in control
        assert control.rsplit("\n", 1)[1] == head and answer.strip() not in control
        assert 0.05 <= s["depth"] <= 0.55


def test_eval_line_format(tmp_path):
    """`quantmla eval --retrieval-formats line` writes line-recall accuracy and its control per length."""
    from quantmla.cli import main
    from quantmla.corpus.datasets import model_path, write_jsonl

    write_jsonl(tmp_path / "heldout" / "code.jsonl", [{"text": d} for d in _docs()])
    rc = main(["eval", str(model_path()), "--heldout", str(tmp_path / "heldout"), "--config", "BF16", "--method", "bf16",
               "--seq-len", "128", "--ppl-chunks", "1", "--retrieval-n", "3", "--lengths", "512",
               "--retrieval-formats", "line", "--out", str(tmp_path / "o")])
    assert rc == 0
    row = json.loads((tmp_path / "o" / "accuracy.json").read_text())["rows"][0]
    v = row["retrieval_line"]["512"]
    assert v["n"] == 3 and 0 <= v["accuracy"] <= 1 and 0 <= v["control_accuracy"] <= 1 and row["retrieval"] == {}
    md = (tmp_path / "o" / "accuracy.md").read_text()
    assert "line 512 (ctrl)" in md and "never trained on" in md


def test_one_calibration_serves_every_window():
    """Rows that differ only in their full-precision window reuse the calibrated model (`prepared`)."""
    from quantmla.evaluation.harness import EvalData, evaluate_row

    model = tiny_model("deepseek_v3")
    data = EvalData(ppl=torch.randint(3, 128, (1, 16)), calib_ids=torch.randint(3, 128, (4, 16)), seq_len=16)
    calls, windows = [], []

    def calib_fn(m, ids, quant, *, method, paths, seed):
        calls.append(method)
        m.config.quantization_config = quant.to_dict()

    def ppl_fn(m, tok, chunks, *, seq_len, cache_factory):
        windows.append(cache_factory(m).quant.fp_window)
        return {"bits_per_byte": 1.0, "tokens": 15}

    prepared = {}
    for w in (0, 8):
        evaluate_row(model, None, RowSpec(named_config("INT4/INT4", 16, 8), "quantmla", fp_window=w), data,
                     ppl_fn=ppl_fn, retrieval_fn=lambda *a, **k: None, calibrate_fn=calib_fn, prepared=prepared)
    assert calls == ["quantmla"] and windows == [0, 8]


def test_byte_lengths_are_never_a_collected_tokenizers():
    """A tokenizer that reuses a collected tokenizer's id gets its own byte lengths, not the stale ones (a
    stale entry of another vocabulary once made bits per byte index past its lengths)."""
    import weakref

    from transformers import AutoTokenizer

    from quantmla.evaluation import perplexity
    from quantmla.corpus.datasets import model_path
    from quantmla.evaluation.tokens import token_byte_lengths

    tok = AutoTokenizer.from_pretrained(model_path())

    class Gone:
        pass

    gone = Gone()  # as if a collected tokenizer with a 300-token vocabulary had had this id
    perplexity._BYTE_LENGTHS[id(tok)] = (weakref.ref(gone), torch.zeros(300, dtype=torch.int64))
    del gone
    got = perplexity._byte_lengths(tok)
    assert torch.equal(got, torch.from_numpy(token_byte_lengths(tok))) and len(got) == len(tok)
    assert perplexity._byte_lengths(tok) is got  # kept while the tokenizer lives


@pytest.mark.parametrize("method,window", [("rtn", 4), ("kivi", 4), ("kivi", 0)])
def test_every_query_reads_the_cache_as_decode_steps_do(method, window):
    """With a full-precision window each query reads its own newest W tokens unquantized, and KIVI's blocks are read
    quantized over the tokens a decode has seen: the logits that bits per byte and retrieval score equal a
    token-by-token decode's. One forward over the chunk read otherwise (the last W tokens of the chunk unquantized
    for every query; KIVI's blocks quantized over later tokens too)."""
    from quantmla.evaluation.decode_reads import decode_logits
    from quantmla.evaluation.perplexity import bits_per_byte

    torch.manual_seed(0)
    model = tiny_model("deepseek_v3").eval()
    ids = torch.randint(3, 128, (1, 24))
    factory = RowSpec(named_config("INT2/INT4", 16, 8), method, kivi_block=8, fp_window=window).cache_factory()
    with torch.no_grad():
        cache = factory(model)
        stepped = torch.cat([model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
                             for t in range(24)], 1)
        one_forward = model(ids, past_key_values=factory(model), use_cache=True).logits
    torch.testing.assert_close(decode_logits(model, ids, factory(model)), stepped, atol=2e-5, rtol=1e-5)
    assert (one_forward[:, :20] - stepped[:, :20]).abs().max() > 1e-4  # what one forward read instead (fp32: 1e-7)
    torch.testing.assert_close(decode_logits(model, ids, factory(model), first=17), stepped[:, 17:], atol=2e-5,
                               rtol=1e-5)
    nll = bits_per_byte(model, _OneByteTokens(), ids, seq_len=24, cache_factory=factory)["nll_bits"]
    lp = torch.log_softmax(stepped[0, :-1].double(), -1).gather(-1, ids[0, 1:, None]).sum()
    assert abs(nll + float(lp) / math.log(2)) < 1e-3


class _OneByteTokens:
    """A stand-in tokenizer for bits_per_byte's byte table: 128 tokens, no special ones."""

    all_special_ids: list = []

    def get_vocab(self):
        return {f"t{i}": i for i in range(128)}


def test_retrieval_decodes_samples_of_other_lengths_together_as_each_alone():
    """Where the cache is read a forward a token, retrieval decodes its samples together, right-padded: each sample's
    answer margins equal its own token-by-token decode's."""
    from quantmla.evaluation.retrieval import retrieval_accuracy

    torch.manual_seed(0)
    model = tiny_model("deepseek_v3").eval()
    factory = RowSpec(named_config("INT2/INT4", 16, 8), "kivi", kivi_block=8).cache_factory()
    samples = [{"prompt_ids": torch.randint(3, 128, (n,)).tolist(), "answer_ids": torch.randint(3, 128, (k,)).tolist()}
               for n, k in ((13, 3), (20, 2), (9, 4))]
    got = retrieval_accuracy(model, None, samples, cache_factory=factory)["min_margin"]
    for s, margin in zip(samples, got):
        p, a = s["prompt_ids"], s["answer_ids"]
        ids = torch.tensor([p + a])
        with torch.no_grad():
            cache = factory(model)
            logits = torch.cat([model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
                                for t in range(ids.shape[1])], 1)[0, len(p) - 1 : len(p) - 1 + len(a)]
        target = torch.tensor(a)
        other = logits.scatter(-1, target[:, None], float("-inf")).max(-1).values
        assert abs(float((logits.gather(-1, target[:, None])[:, 0] - other).min()) - margin) < 1e-4
