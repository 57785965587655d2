"""CPU tests of the reference-model pipeline: corpus split, tokenizer, retrieval tasks,
evaluators, and a few training steps of every family through the CLI entry point."""

from __future__ import annotations

import argparse
import json
import random
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from quantmla_lab.training import data as D
from quantmla_lab.training.families import FAMILIES, make_config, model_name
from quantmla_lab.training.tokenizer import (
    load_tokenizer,
    save_tokenizer,
    token_byte_lengths,
    train_tokenizer,
)

STDLIB = [("stdlib", sysconfig.get_paths()["stdlib"])]
PACKAGES = ["json", "email", "logging", "http", "asyncio", "unittest", "xml", "importlib", "concurrent",
            "collections", "urllib", "ctypes", "dataclasses", "argparse", "tarfile", "zipfile", "csv", "ast"]


@pytest.fixture(scope="module")
def corpus():
    files = D.discover(STDLIB, PACKAGES)
    split = D.split_corpus(files, heldout_fraction=0.3, min_package_bytes=1)
    texts = [t for t in (D.read_text(f) for f in split.train[:120]) if t]
    return files, split, texts


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    _, _, texts = corpus
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(texts, 600), d)
    return load_tokenizer(d)


def test_discovery_and_split_are_deterministic(corpus):
    files, split, _ = corpus
    assert files == D.discover(STDLIB, PACKAGES)
    again = D.split_corpus(files, heldout_fraction=0.3, min_package_bytes=1)
    assert again.heldout_packages == split.heldout_packages
    assert [f.name for f in again.train] == [f.name for f in split.train]
    held = set(split.heldout_packages)
    assert held, "some package must be held out"
    assert not any(f"{f.group}/{f.package}" in held for f in split.train)
    assert all(f"{f.group}/{f.package}" in held for f in split.heldout_code)


def test_tokenizer_is_byte_level_and_loads_as_fast(tokenizer):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    blen = token_byte_lengths(tokenizer)
    assert int(blen[ids].sum()) == len(text.encode("utf-8"))
    assert blen[tokenizer.eos_token_id] == 0
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert AutoTokenizer.from_pretrained(tokenizer.name_or_path).get_vocab() == tokenizer.get_vocab()


def test_training_rows_tokenize_like_text(corpus, tokenizer):
    """A token-level retrieval row decodes to text that tokenizes back to the same ids."""
    from quantmla_lab.training.tasks import RowMaker

    _, _, texts = corpus
    eos = tokenizer.eos_token_id
    stream = np.concatenate([np.array(tokenizer(t, add_special_tokens=False)["input_ids"] + [eos], dtype=np.uint16)
                             for t in texts[:40]])
    maker = RowMaker(tokenizer, stream, answer_weight=2.0)
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(20):
        ids, w = maker.retrieval_row(rng, 512, 400)
        assert ids.shape == w.shape == (512,)
        assert (w == 2.0).any() and (w == 0).any()
        if eos in ids:
            continue  # a document boundary inside the window: text round trip is not defined
        text = tokenizer.decode(ids.tolist())
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids.tolist()
        # every answer digit string appears earlier in the row as a key line
        answer = tokenizer.decode(ids[w == 2.0].tolist())
        assert answer.strip()[:5] in text[: len(text) - len(answer)]
        checked += 1
    assert checked >= 5
    ids, w = maker.batch(rng, 4, 256, 0.5, (64, 256))
    assert ids.shape == (4, 256) and w.dtype == np.float32


def test_eval_samples(corpus, tokenizer):
    from quantmla_lab.training.tasks import make_eval_samples

    _, split, _ = corpus
    pool = [t for t in (D.read_text(f) for f in split.heldout_code[:30]) if t]
    samples = make_eval_samples(tokenizer, pool, 512, 3, seed=1)
    assert samples == make_eval_samples(tokenizer, pool, 512, 3, seed=1)
    for s in samples:
        assert 400 <= s["n_tokens"] <= 512
        value = s["answer"].strip()
        assert len(value) == 5 and value.isdigit()
        assert f"\n{s['key']} = {value}\n" in s["prompt"] and s["prompt"].endswith(f"{s['key']} =")
        keys = re.findall(r"^[a-z]+_[a-z]+ = \d{5}$", s["prompt"], flags=re.M)
        assert len(keys) >= 4
        p = tokenizer(s["prompt"], add_special_tokens=False)["input_ids"]
        a = tokenizer(s["answer"], add_special_tokens=False)["input_ids"]
        assert tokenizer(s["prompt"] + s["answer"], add_special_tokens=False)["input_ids"] == p + a


def _tiny_model(family="deepseek_v3", vocab=600):
    import transformers

    torch.manual_seed(0)
    cfg = make_config(family, vocab, size="tiny")
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


class CountingCache:
    """A cache factory whose caches count their updates (proves reads go through the cache)."""

    def __init__(self):
        self.made, self.updates = 0, 0

    def __call__(self, model):
        from transformers import DynamicCache

        outer = self

        class _C(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                outer.updates += 1
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)

        self.made += 1
        return _C(config=model.config)


def test_bits_per_byte_matches_manual(tokenizer):
    from quantmla.corpus.chunks import token_chunks
    from quantmla.evaluation.perplexity import bits_per_byte

    model = _tiny_model(vocab=len(tokenizer))
    texts = ["import os\nprint(os.getcwd())\n" * 20, "def g(a, b):\n    return a + b\n" * 20]
    chunks = token_chunks(tokenizer, texts, 64)
    cf = CountingCache()
    r = bits_per_byte(model, tokenizer, texts, seq_len=64, cache_factory=cf, batch_size=2)
    assert cf.made == (len(chunks) + 1) // 2 and cf.updates == cf.made * model.config.num_hidden_layers
    with torch.no_grad():
        logits = model(chunks).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, chunks[:, 1:, None]).squeeze(-1)
    keep = chunks[:, 1:] != tokenizer.eos_token_id
    blen = torch.from_numpy(token_byte_lengths(tokenizer))
    bits = -(lp * keep).sum().item() / np.log(2)
    nbytes = int((blen[chunks[:, 1:]] * keep).sum())
    assert r["bytes"] == nbytes and r["tokens"] == int(keep.sum())
    assert r["bits_per_byte"] == pytest.approx(bits / nbytes, rel=1e-4)
    # token chunks as input give the same figure
    r2 = bits_per_byte(model, tokenizer, chunks, seq_len=64)
    assert r2["bits_per_byte"] == pytest.approx(r["bits_per_byte"], rel=1e-5)
    # nothing to predict is an error, not a perfect 0 bits a byte
    from quantmla.errors import QuantMLAError

    for got, n in (([], 64), (["x"], 64), (texts, 1)):
        with pytest.raises(QuantMLAError, match="no token was predicted|seq_len 1"):
            bits_per_byte(model, tokenizer, got, seq_len=n)


def test_retrieval_accuracy_equals_greedy_decoding(tokenizer):
    from quantmla.evaluation.retrieval import retrieval_accuracy

    model = _tiny_model("minicpm3", vocab=len(tokenizer))
    prompt = "x = 1\nblue_owl = 12345\ny = 2\nblue_owl ="
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a = tokenizer(" 12345", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        gen = model.generate(torch.tensor([p]), max_new_tokens=len(a), do_sample=False, pad_token_id=0)[0, len(p):]
    greedy = {"prompt_ids": p, "answer_ids": gen.tolist()}
    text = {"prompt": prompt, "answer": " 12345"}
    cf = CountingCache()
    r = retrieval_accuracy(model, tokenizer, [greedy, text], cache_factory=cf)
    assert cf.made == 2 and cf.updates == 2 * model.config.num_hidden_layers
    assert r["per_sample"] == [True, gen.tolist() == a]
    assert r["min_margin"][0] > 0
    assert r["n"] == 2 and r["accuracy"] == sum(r["per_sample"]) / 2


@pytest.mark.slow
def test_cli_trains_every_family_on_cpu(tmp_path):
    """`quantmla train-reference` end to end at tiny scale: a few steps of each family."""
    from quantmla_lab.training import command

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    out = tmp_path / "models"
    args = p.parse_args([
        "--size", "tiny", "--device", "cpu", "--jobs", "0", "--max-steps", "3", "--stdlib-only",
        "--packages", ",".join(PACKAGES), "--heldout-fraction", "0.3", "--vocab-size", "400",
        "--work", str(tmp_path / "work"), "--out", str(out), "--results", str(tmp_path / "res.json"),
        "--short-len", "64", "--long-len", "256", "--batch-tokens", "512", "--n-retrieval", "2",
        "--retrieval-lengths", "256,512", "--eval-retrieval-n", "2", "--eval-seq-len", "128",
        "--max-train-bytes", "3e6", "--tokenizer-bytes", "1e6", "--log-every", "1",
    ])
    assert command.run(args) == 0
    import transformers

    res = json.loads((tmp_path / "res.json").read_text())
    assert [m["family"] for m in res["models"]] == list(FAMILIES)
    for fam in FAMILIES:
        d = out / model_name(fam, "tiny")  # sizes other than "ref" are written under their own names
        card = json.loads((d / "card.json").read_text())
        assert card["training"]["steps"] == 3 and card["params"] > 0
        assert np.isfinite(card["eval"]["bpb_code"]) and set(card["eval"]["retrieval"]) == {"256", "512"}
        assert (d / "README.md").exists() and (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists()
        m = transformers.AutoModelForCausalLM.from_pretrained(d)
        assert m.config.model_type == fam and m.dtype == torch.bfloat16
        tok = transformers.AutoTokenizer.from_pretrained(d)
        assert len(tok) == m.config.vocab_size
        assert [h["step"] for h in card["history"]] == [1, 2, 3]
    assert (out / "heldout" / "code.jsonl").exists() and (out / "heldout" / "retrieval_512.jsonl.xz").exists()


def test_yarn_switch_restores_final_config():
    import transformers

    from quantmla_lab.training.families import set_rope, short_context_rope

    cfg = make_config("deepseek_v3", 500, size="tiny")
    final = dict(cfg.rope_parameters)
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    scale_final = m.model.layers[0].self_attn.scaling
    set_rope(m, short_context_rope(cfg))
    assert m.model.layers[0].self_attn.scaling == pytest.approx(cfg.qk_head_dim**-0.5)
    set_rope(m, final)
    assert m.model.layers[0].self_attn.scaling == pytest.approx(scale_final)
    fresh = transformers.AutoModelForCausalLM.from_config(m.config)
    assert torch.allclose(fresh.model.rotary_emb.inv_freq, m.model.rotary_emb.inv_freq)


def test_reference_shapes_fit_budget():
    """Shipped shapes: d_c >= 128, d_r >= 32, >= 8 heads, at most 6 MiB in bf16."""
    import transformers

    for fam in FAMILIES:
        cfg = make_config(fam, 3072)
        assert cfg.kv_lora_rank >= 128 and cfg.qk_rope_head_dim >= 32 and cfg.num_attention_heads >= 8
        with torch.device("meta"):
            m = transformers.AutoModelForCausalLM.from_config(cfg)
        n = sum(p.numel() for p in m.parameters())  # tied embedding counted once
        assert 2 * n < 6 * 2**20 - 64 * 1024, (fam, n)
    random.seed(0)


def test_deepseek_geometry_size_has_deepseeks_cache_and_its_own_name(tmp_path, capsys):
    """The fifth reference model's size: DeepSeek-V2-Lite's cache geometry (d_c 512, d_r 64, 16 heads, no
    query LoRA), deepseek_v2 only, written under its own directory name (never over the shipped model)."""
    from quantmla.cli import main
    from quantmla_lab.training.families import make_config, model_name

    c = make_config("deepseek_v2", 3072, size="deepseek-geometry")
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.num_attention_heads, c.q_lora_rank) == (512, 64, 16, None)
    assert model_name("deepseek_v2", "deepseek-geometry") == "qmla-ref-deepseek-v2-deepseek-geometry"
    assert model_name("deepseek_v2") == "qmla-ref-deepseek-v2"
    with pytest.raises(ValueError, match="deepseek_v2"):
        make_config("deepseek_v3", 3072, size="deepseek-geometry")
    rc = main(["train-reference", "--size", "deepseek-geometry", "--families", "deepseek_v3",
               "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "--families deepseek_v2" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_prepare_reuses_a_shipped_tokenizer_and_heldout_set(tmp_path):
    """prepare(tokenizer_from=, heldout_from=) keeps the given tokenizer and held-out set byte for byte,
    holds out the set's packages (not the hash choice of this corpus), and says whether the training
    files are the set's run's: the same corpus gives the same list, another corpus another."""
    from quantmla_lab.training.tokenizer import file_sha256
    from quantmla_lab.training.train import PrepareOptions, prepare

    small = dict(vocab_size=400, max_train_bytes=2_000_000, tokenizer_bytes=500_000, heldout_fraction=0.3,
                 heldout_code_bytes=6_000, heldout_prose_bytes=4_000, retrieval_pool_bytes=60_000, n_retrieval=2,
                 retrieval_lengths=(256,), workers=2)
    first = prepare(tmp_path / "a", PrepareOptions(**small), roots=STDLIB, packages=PACKAGES)
    shipped = tmp_path / "a" / "heldout"
    (tmp_path / "tok").mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tok" / f).write_bytes((tmp_path / "a" / "tokenizer" / f).read_bytes())
    opts = PrepareOptions(**dict(small, tokenizer_bytes=1, heldout_fraction=0.0), tokenizer_from=str(tmp_path / "tok"),
                          heldout_from=str(shipped))
    again = prepare(tmp_path / "b", opts, roots=STDLIB, packages=PACKAGES)
    assert again["same_train_files"] and again["same_tokenizer"]
    assert again["heldout_packages"] == first["heldout_packages"]  # heldout_fraction 0 would hold out none
    assert again["train_tokens"] == first["train_tokens"]
    assert file_sha256(tmp_path / "b" / "tokenizer" / "tokenizer.json") == first["tokenizer_sha256"]
    for f in shipped.iterdir():
        assert (tmp_path / "b" / "heldout" / f.name).read_bytes() == f.read_bytes(), f.name
    assert np.array_equal(np.load(tmp_path / "a" / "train_tokens.npy"), np.load(tmp_path / "b" / "train_tokens.npy"))
    trained = next(p for p in PACKAGES if f"stdlib/{p}" not in first["heldout_packages"])
    other = prepare(tmp_path / "c", opts, roots=STDLIB, packages=[p for p in PACKAGES if p != trained])
    assert not other["same_train_files"] and other["heldout_packages"] == first["heldout_packages"]


def test_split_corpus_takes_a_fixed_heldout_list(corpus):
    files, split, _ = corpus
    held = ["stdlib/json", "stdlib/csv"]
    fixed = D.split_corpus(files, heldout_fraction=0.3, min_package_bytes=1, heldout_packages=held)
    assert fixed.heldout_packages == sorted(held)
    assert {f"{f.group}/{f.package}" for f in fixed.heldout_code} == set(held)
    assert not any(f"{f.group}/{f.package}" in held for f in fixed.train)
    assert len(fixed.train) + len(fixed.heldout_code) >= len(split.train)


def test_card_is_written_again_from_its_json(tmp_path):
    """python -m quantmla_lab.training.card DIR: README.md from card.json alone; a model of another size
    names its own script, and a model on reused data says whether its training files are the shipped ones'."""
    from quantmla_lab.training.card import main

    card = json.loads((Path(__file__).parents[1] / "models" / "qmla-ref-deepseek-v2" / "card.json").read_text())
    (tmp_path / "card.json").write_text(json.dumps(card))
    assert main([str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert text == (Path(__file__).parents[1] / "models" / "qmla-ref-deepseek-v2" / "README.md").read_text()
    card["training"]["options"]["size"] = "deepseek-geometry"
    card["data"].update(heldout_from="models/heldout", same_train_files=False)
    (tmp_path / "card.json").write_text(json.dumps(card))
    main([str(tmp_path)])
    text = (tmp_path / "README.md").read_text()
    assert "`lab/scripts/train_deepseek_geometry.sh` on one GPU" in text and "train_reference.sh" not in text
    assert "(`models/heldout`)" in text and "another list than theirs" in text


def test_deepseek_geometry_script_evaluates_the_table_rows_most_important_first():
    """lab/scripts/train_deepseek_geometry.sh's eval rows: BF16, FP8, and RTN, KIVI-style, Hadamard, QuantMLA,
    its two single-path ablations and quantmla-rope-channel at INT4/INT4 and INT2/INT4 in groups 128/32 and 64/32;
    BF16, FP8 and the 128/32 rows of RTN, KIVI-style, QuantMLA and quantmla-rope-channel first (a call stopped at
    its deadline keeps those), each quantmla-rope-channel row after the QuantMLA row whose calibration it reads."""
    import subprocess

    from quantmla.evaluation.command import add_arguments, rows_for

    script = Path(__file__).parents[1] / "lab" / "scripts" / "train_deepseek_geometry.sh"
    specs = subprocess.run(["bash", str(script), "rows"], capture_output=True, text=True, check=True).stdout.split()
    p = argparse.ArgumentParser()
    add_arguments(p)
    rows = rows_for(p.parse_args(["--rows", *specs]))
    key = lambda r: (r.config.name, r.method, r.config.content.group_size, r.config.rope.group_size)  # noqa: E731
    methods = ("rtn", "kivi", "hadamard", "quantmla", "quantmla-content", "quantmla-rope", "quantmla-rope-channel")
    grid = {(c, m, *g) for g in ((128, 32), (64, 32)) for c in ("INT4/INT4", "INT2/INT4") for m in methods}
    assert [key(r)[:2] for r in rows[:2]] == [("BF16", "bf16"), ("FP8", "rtn")]
    assert len(rows) == len(specs) == 2 + len(grid) and {key(r) for r in rows[2:]} == grid
    first = {key(r) for r in rows[2:10]}
    assert first == {k for k in grid if k[2] == 128 and k[1] in ("rtn", "kivi", "quantmla", "quantmla-rope-channel")}
    order = [key(r) for r in rows]
    for i, k in enumerate(order):
        if k[1] == "quantmla-rope-channel":
            assert (k[0], "quantmla", *k[2:]) in order[:i]


def test_extend_retrieval_keeps_the_first_samples(tmp_path):
    """The held-out set's retrieval files grow to N: existing samples first and unchanged, new ids after them,
    the manifest says what was added, and a second run adds nothing."""
    from transformers import AutoTokenizer

    from quantmla.corpus.datasets import load_retrieval, load_texts, write_jsonl
    from quantmla_lab.training.extend_retrieval import extend
    from quantmla_lab.training.tasks import make_eval_samples

    tok = AutoTokenizer.from_pretrained("models/qmla-ref-deepseek-v2")
    docs = [{"text": t, "source": "x"} for t in load_texts("code")[:12]]
    write_jsonl(tmp_path / "code.jsonl", docs)
    old = {}
    for kind, keys in (("retrieval", 4), ("passkey", 1)):
        old[kind] = make_eval_samples(tok, [d["text"] for d in docs], 256, 2, seed=0, n_keys=keys, tag=kind)
        write_jsonl(tmp_path / f"{kind}_256.jsonl.xz", old[kind])
    (tmp_path / "manifest.json").write_text(json.dumps({"retrieval": {"n": 2, "lengths": [256]}}))
    added = extend(tmp_path, tok, 5, log=lambda *_: None)
    assert added == {"retrieval_256": 3, "passkey_256": 3}
    for kind in ("retrieval", "passkey"):
        got = load_retrieval(256, tmp_path, kind=kind)
        assert got[:2] == old[kind] and len(got) == 5
        assert [s["id"] for s in got[2:]] == [f"{kind[0]}256-{i:04d}" for i in (2, 3, 4)]
        assert len({s["prompt"] for s in got}) == 5
    m = json.loads((tmp_path / "manifest.json").read_text())["retrieval"]
    assert m["n"] == 5 and m["extended"][0]["from"] == 2
    assert extend(tmp_path, tok, 5, log=lambda *_: None) == {}
