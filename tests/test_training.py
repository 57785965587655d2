"""CPU tests of the reference-model pipeline: corpus split, tokenizer, retrieval tasks,
evaluators, and a few training steps of every family through the CLI entry point."""

from __future__ import annotations

import argparse
import json
import random
import re
import sysconfig

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
    from quantmla.evaluation.perplexity import bits_per_byte, token_chunks

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
