"""Prepare the data, train one reference model, then evaluate it and write its card (card.py).

Stages (each one a function; :mod:`quantmla_lab.training.command` wires them to the CLI):

- :func:`prepare` (once, shared by all families): discover the corpus, split it by package,
  train the tokenizer, tokenize the training files into one ``uint16`` stream, and write the
  held-out sets (code, prose, retrieval samples at 1K/2K/4K) with a manifest. Given a shipped
  tokenizer and held-out set (``PrepareOptions.tokenizer_from`` / ``heldout_from``), it uses them as
  they are and builds only the training stream, so a new model trains on the shipped models' data.
- :func:`train_model` (one process per family): build the transformers model from
  :func:`quantmla_lab.training.families.make_config`, train it (AdamW, bf16 autocast on CUDA,
  1024-token rows first, then 4096-token rows; half of the rows carry a retrieval
  task), save a bf16 ``from_pretrained`` directory with the tokenizer, then evaluate the
  *saved* model (BF16 weights, BF16 ``DynamicCache``) and write ``card.json`` and
  ``README.md``, including the small fp32 "slice" figures the CPU test recomputes.
"""

from __future__ import annotations

import json
import math
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np

from quantmla_lab.training import data as D
from quantmla_lab.training.card import evaluate_and_card
from quantmla_lab.training.card import log as _log
from quantmla_lab.training.families import MODEL_NAMES, make_config, set_rope, short_context_rope
from quantmla_lab.training.options import PrepareOptions, TrainOptions
from quantmla_lab.training.tokenizer import (
    file_sha256,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)


# ----------------------------------------------------------------------------- prepare


def _read_many(files: list[D.SourceFile], workers: int) -> list[str | None]:
    with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
        return list(ex.map(D.read_text, files))


def _build_heldout(split: D.Split, seen: set[str], opts: PrepareOptions):
    """The held-out code and prose documents and the retrieval pool, from held-out packages only and
    never a training file's content (``seen``: content hashes of the training files)."""
    # held-out code: round-robin over held-out packages, never a training file's content
    hcode, hnames, pool = [], [], []
    code_bytes = pool_bytes = 0
    rr = D.round_robin(split.heldout_code)
    for f, text in zip(rr, _read_many(rr, opts.workers)):
        if text is None or D.content_hash(text) in seen or len(text) < 500:
            continue
        if pool_bytes < opts.retrieval_pool_bytes:
            pool.append(text)
            pool_bytes += len(text)
        if code_bytes < opts.heldout_code_bytes:
            doc = D.truncate_at_line(text, 8000)
            hcode.append({"text": doc, "source": f.name})
            hnames.append(f.name)
            code_bytes += len(doc.encode("utf-8"))
        if code_bytes >= opts.heldout_code_bytes and pool_bytes >= opts.retrieval_pool_bytes:
            break
    # held-out prose: docstrings of held-out code, docs, package descriptions
    hprose = []
    prose_bytes = 0
    rr = D.round_robin(split.heldout_prose)
    for f, text in zip(rr, _read_many(rr, opts.workers)):
        if text is None:
            continue
        if f.kind == "code":
            doc = "\n\n".join(D.extract_docstrings(text))
        elif f.kind == "metadata":
            doc = D.metadata_description(text)
        else:
            doc = text
        doc = D.truncate_at_line(doc.strip(), 4000)
        if len(doc) < 300 or D.content_hash(doc) in seen:
            continue
        hprose.append({"text": doc, "source": f.name, "kind": "docstrings" if f.kind == "code" else f.kind})
        prose_bytes += len(doc.encode("utf-8"))
        if prose_bytes >= opts.heldout_prose_bytes:
            break
    _log(f"held-out: code {len(hcode)} docs {code_bytes / 1e3:.0f} KB, prose {len(hprose)} docs "
         f"{prose_bytes / 1e3:.0f} KB, retrieval pool {pool_bytes / 1e3:.0f} KB")
    if not hcode or not hprose or not pool:
        raise RuntimeError("empty held-out set: raise --heldout-fraction or widen the corpus")
    return hcode, hprose, pool, code_bytes, prose_bytes, pool_bytes


def prepare(
    work: str | Path,
    opts: PrepareOptions | None = None,
    roots: list[tuple[str, str]] | None = None,
    packages: list[str] | None = None,
) -> dict:
    """Build everything the training processes share under ``work``; returns the manifest.

    With ``opts.heldout_from`` the held-out set is that directory's (copied to ``work/heldout``, its
    manifest's packages held out of training, training files whose content is a held-out document
    dropped); with ``opts.tokenizer_from`` the tokenizer is that directory's ``tokenizer.json``.
    The manifest then says whether the training file list equals the one the held-out set's
    manifest records (``same_train_files``)."""
    opts = opts or PrepareOptions()
    work = Path(work)
    (work / "heldout").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    files = D.discover(roots, packages)
    ref = None  # the manifest of the reused held-out set
    held_docs: set[str] = set()
    if opts.heldout_from:
        import shutil

        src = Path(opts.heldout_from)
        ref = json.loads((src / "manifest.json").read_text())
        shutil.rmtree(work / "heldout")
        shutil.copytree(src, work / "heldout")
        from quantmla.corpus.datasets import load_texts

        held_docs = {D.content_hash(t) for kind in ("code", "prose") for t in load_texts(kind, work / "heldout")}
    split = D.split_corpus(files, heldout_fraction=opts.heldout_fraction,
                           heldout_packages=ref["heldout_packages"] if ref else None)
    _log(f"discovered {len(files)} files in {split.stats['packages']} packages; held out {split.heldout_packages}")

    # training texts, in hash order, exact duplicates removed, up to max_train_bytes
    train_texts: list[str] = []
    train_names: list[str] = []
    seen: set[str] = set()
    total = 0
    step = 2000
    for i in range(0, len(split.train), step):
        batch = split.train[i : i + step]
        for f, text in zip(batch, _read_many(batch, opts.workers)):
            if text is None:
                continue
            h = D.content_hash(text)
            if h in seen:
                continue
            if held_docs and (h in held_docs or D.content_hash(D.truncate_at_line(text, 8000)) in held_docs):
                continue  # a held-out document's content (held-out code is cut at 8000 characters)
            seen.add(h)
            train_texts.append(text)
            train_names.append(f.name)
            total += len(text.encode("utf-8"))
        if total >= opts.max_train_bytes:
            break
    _log(f"training text: {len(train_texts)} files, {total / 1e6:.1f} MB ({time.time() - t0:.1f}s)")

    if ref is None:
        hcode, hprose, pool, code_bytes, prose_bytes, pool_bytes = _build_heldout(split, seen, opts)

    # tokenizer: trained on the first tokenizer_bytes of training text (hash order), or the given one
    t1 = time.time()
    if opts.tokenizer_from:
        from tokenizers import Tokenizer

        (work / "tokenizer").mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (work / "tokenizer" / name).write_bytes((Path(opts.tokenizer_from) / name).read_bytes())
        tok_raw = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
        tok = load_tokenizer(work / "tokenizer")
        _log(f"tokenizer: vocab {tok_raw.get_vocab_size()} from {opts.tokenizer_from}")
    else:
        sample, nb = [], 0
        for t in train_texts:
            sample.append(t)
            nb += len(t)
            if nb >= opts.tokenizer_bytes:
                break
        tok_raw = train_tokenizer(sample, opts.vocab_size, length=len(sample))
        save_tokenizer(tok_raw, work / "tokenizer")
        tok = load_tokenizer(work / "tokenizer")
        _log(f"tokenizer: vocab {tok_raw.get_vocab_size()} trained on {nb / 1e6:.1f} MB ({time.time() - t1:.1f}s)")

    # tokenize the training stream (EOS between documents)
    t1 = time.time()
    eos = tok.eos_token_id
    parts = []
    encode = getattr(tok_raw, "encode_batch_fast", tok_raw.encode_batch)
    for i in range(0, len(train_texts), 4000):
        for e in encode(train_texts[i : i + 4000], add_special_tokens=False):
            parts.append(np.asarray(e.ids, dtype=np.uint16))
            parts.append(np.asarray([eos], dtype=np.uint16))
    stream = np.concatenate(parts)
    np.save(work / "train_tokens.npy", stream)
    _log(f"training stream: {len(stream) / 1e6:.1f} M tokens, {total / len(stream):.2f} bytes/token ({time.time() - t1:.1f}s)")

    corpus_id = D.content_hash("\n".join(train_names))
    tok_sha = file_sha256(work / "tokenizer" / "tokenizer.json")
    manifest = {
        "options": asdict(opts),
        "python": platform.python_version(),
        "roots": [[g, p] for g, p in (roots or D.default_roots())],
        "files_discovered": len(files),
        "packages": split.stats["packages"],
        "heldout_packages": split.heldout_packages,
        "train_files": len(train_texts),
        "train_bytes": total,
        "train_tokens": int(len(stream)),
        "train_file_list_sha256": corpus_id,
    }
    if ref is not None:  # the reused held-out set: its figures, and whether the training data are its run's
        manifest.update({
            "same_train_files": corpus_id == ref.get("train_file_list_sha256"),
            "heldout_code": ref["heldout_code"],
            "heldout_prose": ref["heldout_prose"],
            "retrieval": ref["retrieval"],
            "tokenizer_sha256": tok_sha,
            "same_tokenizer": tok_sha == ref.get("tokenizer_sha256"),
            "seconds": round(time.time() - t0, 1),
        })
        (work / "manifest.json").write_text(json.dumps(manifest, indent=1))  # work/heldout keeps its own
        _log(f"prepare done in {manifest['seconds']}s; the training files "
             + ("equal" if manifest["same_train_files"] else "differ from") + f" those of {opts.heldout_from}")
        return manifest

    # held-out files and retrieval samples
    from quantmla.corpus.datasets import write_jsonl
    from quantmla_lab.training.tasks import make_eval_samples

    write_jsonl(work / "heldout" / "code.jsonl", hcode)
    write_jsonl(work / "heldout" / "prose.jsonl", hprose)
    t1 = time.time()
    for L in opts.retrieval_lengths:
        for kind, n_keys in (("retrieval", 4), ("passkey", 1)):
            samples = make_eval_samples(tok, pool, L, opts.n_retrieval, seed=opts.seed, n_keys=n_keys, tag=kind)
            write_jsonl(work / "heldout" / f"{kind}_{L}.jsonl.xz", samples)
    _log(f"retrieval samples: {opts.n_retrieval} x {list(opts.retrieval_lengths)} x (4 keys, 1 key) ({time.time() - t1:.1f}s)")
    manifest.update({
        "heldout_code": {"docs": len(hcode), "bytes": code_bytes, "sources": sorted({h["source"].split("/")[1] for h in hcode})},
        "heldout_prose": {"docs": len(hprose), "bytes": prose_bytes},
        "retrieval": {"n": opts.n_retrieval, "lengths": list(opts.retrieval_lengths), "pool_bytes": pool_bytes,
                      "n_keys": {"retrieval": 4, "passkey": 1}},
        "tokenizer_sha256": tok_sha,
        "seconds": round(time.time() - t0, 1),
    })
    (work / "heldout" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _log(f"prepare done in {manifest['seconds']}s")
    return manifest


# ----------------------------------------------------------------------------- train


def _lr_at(opts: TrainOptions, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / max(1, opts.warmup_steps))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return opts.lr * warm * (opts.min_lr_frac + (1 - opts.min_lr_frac) * cos)


def _count_params(model) -> tuple[int, int]:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    emb = model.get_input_embeddings().weight.numel()
    return total, total - emb


def train_model(family: str, work: str | Path, out_dir: str | Path, opts: TrainOptions | None = None) -> dict:
    """Train ``family`` on the data under ``work``; write a model directory with its card."""
    import torch
    import transformers

    opts = opts or TrainOptions()
    transformers.utils.logging.disable_progress_bar()
    work, out_dir = Path(work), Path(out_dir)
    dev = torch.device(opts.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(opts.seed)
    fam_idx = sorted(MODEL_NAMES).index(family)
    rng = np.random.default_rng([opts.seed, fam_idx])

    tok = load_tokenizer(work / "tokenizer")
    stream = np.load(work / "train_tokens.npy", mmap_mode="r")
    stream = np.ascontiguousarray(stream)
    from quantmla_lab.training.tasks import RowMaker

    maker = RowMaker(tok, stream, answer_weight=opts.answer_weight)

    config = make_config(family, vocab_size=len(tok), size=opts.size)
    final_rope = dict(config.rope_parameters)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dev)
    n_params, n_nonemb = _count_params(model)
    short_rope = short_context_rope(config)
    phase = "short"
    if short_rope is not None:
        set_rope(model, short_rope)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opts.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opts.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=cuda,
    )
    _log(f"{family}: {n_params / 1e6:.3f} M params ({n_nonemb / 1e6:.3f} M non-embedding), device {dev}")

    model.train()
    t0 = time.time()
    step, tokens, progress = 0, 0, 0.0
    loss_acc = torch.zeros((), device=dev)
    n_acc = 0
    history = []
    short_steps = 0
    while True:
        elapsed = time.time() - t0
        progress = max(step / opts.max_steps, elapsed / opts.time_budget_s)
        if progress >= 1.0:
            break
        if phase == "short" and progress >= opts.short_frac:
            phase = "long"
            short_steps = step
            if short_rope is not None:
                set_rope(model, final_rope)
        T = opts.short_len if phase == "short" else opts.long_len
        B = max(1, opts.batch_tokens // T)
        span = (64, T) if phase == "short" else (256, T)
        ids_np, w_np = maker.batch(rng, B, T, opts.p_retrieval, span)
        ids = torch.from_numpy(ids_np)
        w = torch.from_numpy(w_np)
        if cuda:
            ids = ids.pin_memory().to(dev, non_blocking=True)
            w = w.pin_memory().to(dev, non_blocking=True)
        lr = _lr_at(opts, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=ids, use_cache=False).logits
        ce = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        wt = w[:, 1:].reshape(-1)
        loss = (ce * wt).sum() / wt.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_acc += loss.detach()
        n_acc += 1
        step += 1
        tokens += B * T
        if step % opts.log_every == 0:
            avg = float(loss_acc) / n_acc  # one host sync per log interval
            loss_acc.zero_()
            n_acc = 0
            el = time.time() - t0
            history.append({"step": step, "loss": round(avg, 4), "tokens": tokens, "seconds": round(el, 1), "lr": lr, "T": T})
            _log(f"{family} step {step} T={T} loss {avg:.4f} lr {lr:.2e} {tokens / el / 1e3:.0f}k tok/s")
        del logits, ce, loss
    if phase == "short" and short_rope is not None:
        set_rope(model, final_rope)  # (only when training never reached the long phase)
    if cuda:
        torch.cuda.synchronize()
    train_seconds = time.time() - t0
    _log(f"{family}: trained {step} steps, {tokens / 1e6:.1f} M tokens in {train_seconds:.0f}s")

    # save: bf16 weights + tokenizer
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    del model, opt
    if cuda:
        torch.cuda.empty_cache()

    training = {
        "steps": step,
        "short_phase_steps": short_steps,
        "tokens": tokens,
        "wall_time_s": round(train_seconds, 1),
        "tokens_per_s": round(tokens / max(train_seconds, 1e-9)),
        "max_memory_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if cuda else None,
        "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "options": asdict(opts),
        "history": history,
    }
    card = evaluate_and_card(out_dir, work, family, training, opts, n_params, n_nonemb)
    return card
