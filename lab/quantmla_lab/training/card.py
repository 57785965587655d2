"""A reference model's card: its held-out figures (BF16 weights and cache), the small fp32 slice the CPU
test recomputes, ``card.json`` and the ``README.md`` rendered from it.

The training run writes both files (:func:`evaluate_and_card`); :func:`write_card` renders the README
again from the JSON alone, on any machine, e.g. after a model trained on a GPU comes back as files::

    python -m quantmla_lab.training.card models/qmla-ref-deepseek-v2-deepseek-geometry
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from quantmla.corpus.datasets import RETRIEVAL_LENGTHS
from quantmla_lab.training.families import describe
from quantmla_lab.training.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from quantmla_lab.training.options import TrainOptions



def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def slice_figures(model_dir: str | Path, heldout: str | Path, *, seq_len: int = 512, n_chunks: int = 2,
                  n_retrieval: int = 2, device: str = "cpu", length: int = 1024) -> dict:
    """The small fp32 check the CPU test recomputes: ``n_chunks`` code chunks of ``seq_len``
    tokens and ``n_retrieval`` retrieval samples at 1K, bf16 weights computed in float32."""
    import torch
    import transformers

    from quantmla.corpus.datasets import load_retrieval, load_texts
    from quantmla.corpus.chunks import token_chunks
    from quantmla.evaluation.perplexity import bits_per_byte
    from quantmla.evaluation.retrieval import retrieval_accuracy

    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        tok = load_tokenizer(model_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
        chunks = token_chunks(tok, load_texts("code", heldout, limit=20), seq_len, max_chunks=n_chunks)
        bpb = bits_per_byte(model, tok, chunks, seq_len=seq_len, device=device)
        samples = load_retrieval(length, heldout, limit=n_retrieval)
        ret = retrieval_accuracy(model, tok, samples, device=device)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return {
        "dtype": "float32 compute of the shipped bf16 weights, DynamicCache",
        "seq_len": seq_len,
        "code_chunks": n_chunks,
        "bpb_code": bpb["bits_per_byte"],
        "tokens": bpb["tokens"],
        "bytes": bpb["bytes"],
        "retrieval_length": length,
        "retrieval_ids": [s["id"] for s in samples],
        "retrieval_correct": ret["per_sample"],
        "retrieval_min_margin": ret["min_margin"],
        "retrieval_answer_logprob": ret["answer_logprob"],
    }


def evaluate_model(model_dir: str | Path, heldout: str | Path, *, device: str, seq_len: int = 2048,
                   retrieval_n: int = 100, batch_size: int = 8, lengths=RETRIEVAL_LENGTHS) -> dict:
    """Held-out figures of the saved model: BF16 weights, plain (BF16) DynamicCache."""
    import torch
    import transformers

    from quantmla.corpus.datasets import load_retrieval, load_texts
    from quantmla.evaluation.perplexity import bits_per_byte
    from quantmla.evaluation.retrieval import retrieval_accuracy

    tok = load_tokenizer(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device)
    res = {"dtype": "bfloat16 weights and activations", "cache": "transformers DynamicCache (BF16)", "seq_len": seq_len}
    for kind in ("code", "prose"):
        r = bits_per_byte(model, tok, load_texts(kind, heldout), seq_len=seq_len, device=device, batch_size=batch_size)
        res[f"bpb_{kind}"] = round(r["bits_per_byte"], 4)
        res[f"{kind}_tokens"] = r["tokens"]
        res[f"{kind}_bytes"] = r["bytes"]
    for kind in ("retrieval", "passkey"):
        res[kind] = {}
        for L in lengths:
            samples = load_retrieval(L, heldout, limit=retrieval_n, kind=kind)
            r = retrieval_accuracy(model, tok, samples, device=device)
            res[kind][str(L)] = {"accuracy": r["accuracy"], "n": r["n"], "answer_logprob": round(r["answer_logprob"], 4),
                                 "mean_tokens": round(r["mean_tokens"], 1)}
    return res


REPRODUCE = {"deepseek-geometry": "`lab/scripts/train_deepseek_geometry.sh` on one GPU (trains and evaluates it in "
                                   "one call; the weights are not in git)"}
"""How to reproduce a model of a size other than "ref" (``lab/scripts/train_reference.sh`` on one GPU)."""

TARGETS = {"bpb_code_max": 1.5, "retrieval_2048_min": 0.9, "retrieval_4096_min": 0.8}


def evaluate_and_card(out_dir: Path, work: Path, family: str, training: dict, opts: TrainOptions,
                      n_params: int, n_nonemb: int) -> dict:
    import transformers

    t0 = time.time()
    heldout = work / "heldout"
    manifest = json.loads((work / "manifest.json").read_text())
    lengths = tuple(manifest["retrieval"]["lengths"])
    ev = evaluate_model(out_dir, heldout, device=opts.device, seq_len=opts.eval_seq_len,
                        retrieval_n=opts.eval_retrieval_n, lengths=lengths)
    sl = slice_figures(out_dir, heldout, seq_len=opts.slice_seq_len, n_chunks=opts.slice_chunks,
                       n_retrieval=opts.slice_retrieval, device=opts.device, length=lengths[0])
    config = transformers.AutoConfig.from_pretrained(str(out_dir))
    size = (out_dir / "model.safetensors").stat().st_size
    ret = ev["retrieval"]
    passed = {"bpb_code<=1.5": ev["bpb_code"] <= TARGETS["bpb_code_max"]}
    if "2048" in ret:
        passed["retrieval_2048>=0.9"] = ret["2048"]["accuracy"] >= TARGETS["retrieval_2048_min"]
    if "4096" in ret:
        passed["retrieval_4096>=0.8"] = ret["4096"]["accuracy"] >= TARGETS["retrieval_4096_min"]
    card = {
        "name": out_dir.name,
        "family": family,
        "params": n_params,
        "params_non_embedding": n_nonemb,
        "safetensors_bytes": size,
        "architecture": describe(config),
        "training": {k: v for k, v in training.items() if k != "history"},
        "data": {
            "corpus": "Python standard library + site-packages of the training machine (.py, .md/.rst/.txt)",
            "train_files": manifest["train_files"],
            "train_bytes": manifest["train_bytes"],
            "train_stream_tokens": manifest["train_tokens"],
            "train_file_list_sha256": manifest["train_file_list_sha256"],
            "heldout_packages": manifest["heldout_packages"],
            "tokenizer_sha256": manifest["tokenizer_sha256"],
            **({"heldout_from": manifest["options"]["heldout_from"], "same_train_files": manifest["same_train_files"]}
               if "same_train_files" in manifest else {}),
            "retrieval_format": "eval.retrieval: 4 key lines `<adj>_<animal> = <5 digits>` at random line starts "
            "of held-out code (3 distractors), prompt ends with `<key> =`, answer ` <digits>`; eval.passkey: the same "
            "with a single key line; correct = every answer token is the argmax (= greedy decoding)",
        },
        "eval": ev,
        "slice": sl,
        "targets": passed,
        "eval_seconds": round(time.time() - t0, 1),
        "history": training.get("history", []),
    }
    (out_dir / "card.json").write_text(json.dumps(card, indent=1))
    (out_dir / "README.md").write_text(render_readme(card))
    log(f"{family}: bpb code {ev['bpb_code']:.3f} prose {ev['bpb_prose']:.3f} retrieval "
         + " ".join(f"{k}:{v['accuracy']:.2f}" for k, v in ret.items()) + " passkey "
         + " ".join(f"{k}:{v['accuracy']:.2f}" for k, v in ev["passkey"].items()) + f" (eval {card['eval_seconds']}s)")
    return card


def render_readme(card: dict) -> str:
    a, t, e = card["architecture"], card["training"], card["eval"]
    ret = e["retrieval"]
    reproduce = REPRODUCE.get(t.get("options", {}).get("size"), "`lab/scripts/train_reference.sh` on one GPU")
    data = card.get("data", {})
    same = ""
    if "same_train_files" in data:
        same = (f" Tokenizer and held-out set: those of the shipped models (`{data['heldout_from']}`); training files "
                + ("the same as theirs." if data["same_train_files"] else
                   "another list than theirs (the training machine's packages differ; `card.json` gives this "
                   "list's hash, the held-out manifest theirs)."))
    lines = [
        f"# {card['name']}",
        "",
        f"A small `{a['model_type']}` causal LM (Multi-Head Latent Attention) trained by QuantMLA on Python sources "
        "and docs (standard library + installed packages) with synthetic key-value retrieval, as a reference "
        "model for low-bit MLA KV caching. Not a general-purpose model.",
        "",
        f"- parameters: {card['params']:,} ({card['params_non_embedding']:,} without the tied embedding); "
        f"`model.safetensors` {card['safetensors_bytes'] / 2**20:.2f} MiB (bf16)",
        f"- MLA: hidden {a['hidden_size']}, {a['num_hidden_layers']} layers, {a['num_attention_heads']} heads, "
        f"d_c {a['kv_lora_rank (d_c)']}, d_r {a['qk_rope_head_dim (d_r)']}, nope {a['qk_nope_head_dim']}, "
        f"v {a['v_head_dim']}, q_lora {a['q_lora_rank']}, vocab {a['vocab_size']}",
        f"- RoPE: {a['rope_layout']}; parameters {json.dumps(a['rope_parameters'])}",
        f"- trained: {t['tokens']:,} tokens, {t['steps']} steps, {t['wall_time_s']} s on {t['device']} "
        f"(torch {t['torch']}, transformers {t['transformers']})",
        "",
        f"Held-out (packages never trained on; bf16 weights, plain BF16 `DynamicCache`, {e['seq_len']}-token chunks):",
        "",
        "| bits/byte code | bits/byte prose | " + " | ".join(f"retrieval {k}" for k in ret) + " |",
        "| --- | --- | " + " | ".join("---" for _ in ret) + " |",
        f"| {e['bpb_code']:.3f} | {e['bpb_prose']:.3f} | " + " | ".join(f"{v['accuracy']:.2f}" for v in ret.values()) + " |",
        "",
        "Retrieval: 4 key lines `<adj>_<animal> = <5 digits>` (one asked for, three distractors) at random line "
        "starts of held-out code, the prompt ends with `<key> =`; correct when every answer token is the argmax. "
        "With a single key line (passkey): " + ", ".join(f"{k}: {v['accuracy']:.2f}" for k, v in e["passkey"].items()) + ".",
        "",
        "Load: `AutoModelForCausalLM.from_pretrained(dir)`, `AutoTokenizer.from_pretrained(dir)`. "
        f"Figures and provenance: `card.json`. Reproduce: {reproduce}.{same}",
        "",
    ]
    return "\n".join(lines)


def write_card(model_dir: str | Path) -> Path:
    """Write ``model_dir/README.md`` from ``model_dir/card.json``; returns the README's path."""
    d = Path(model_dir)
    card = json.loads((d / "card.json").read_text())
    path = d / "README.md"
    path.write_text(render_readme(card))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dirs", nargs="+", help="model directories holding card.json")
    args = p.parse_args(argv)
    for d in args.model_dirs:
        print(f"wrote {write_card(d)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
