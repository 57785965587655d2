"""The serving engine: greedy agreement with transformers generate() on QuantMLACache (torch backend and the Triton
kernels under TRITON_INTERPRET=1), preemption by recompute, requests that can never fit, and the CUDA-graph
schedules. The scheduler alone: tests/test_scheduler.py."""

import pytest
import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.errors import QuantMLAError
from quantmla.model.tiny import tiny_model
from quantmla.serving.engine import BF16_CONFIG, Engine, EngineConfig
from quantmla.serving.scheduler import Request, SamplingParams, Scheduler
from quantmla_lab.bench.serving.agreement import compare, engine_agreement, local_reference_models

INT4 = QuantCacheConfig.of_bits(4, 4, 32, 16)
INT2 = QuantCacheConfig.of_bits(2, 4, 32, 16)


def _prompts(n_list, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_list]


# -- the engine against transformers generate() -----------------------------------------------------------------------
def test_engine_from_pretrained_matches_generate(tmp_path):
    """A checkpoint saved with save_pretrained: BF16 token for token, low bits equal to the fake-quant path."""
    model = tiny_model("deepseek_v3")
    model.save_pretrained(tmp_path / "ckpt")
    prompts = _prompts((5, 23, 61, 1))
    for quant in (BF16_CONFIG, INT4, INT2):
        cfg = EngineConfig(quant=quant, num_pages=64, page_size=16, max_num_batched_tokens=24, backend="torch", keep_logits=True)
        eng = Engine.from_pretrained(str(tmp_path / "ckpt"), cfg, dtype=torch.float32, device="cpu")
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
        rep = compare(eng.model, quant, prompts, [o.output_ids for o in outs], 12, tie_tol=1e-4)
        eng.close()
        assert rep.exact == len(prompts), rep.details  # fp32 model: no tie is close enough to flip here


@pytest.mark.parametrize("family", ["deepseek_v2", "minicpm3", "longcat_flash"])
def test_engine_matches_generate_other_families(family):
    model = tiny_model(family)
    prompts = _prompts((9, 30))
    rep, st = engine_agreement(model, INT4, prompts, 8, tie_tol=1e-4, backend="torch", max_num_batched_tokens=16)
    assert rep.exact == len(prompts), rep.details


def test_engine_triton_kernels_interpreted(v3):
    """The Triton append/decode kernels (TRITON_INTERPRET=1) behind the engine, graph-step path emulated."""
    prompts = _prompts((6, 21, 2), seed=3)
    for quant in (BF16_CONFIG, INT4, INT2):
        rep, st = engine_agreement(v3, quant, prompts, 6, tie_tol=2e-2, backend="triton", cuda_graphs="emulate",
                                   num_pages=12, graph_buckets=(1, 2, 4), max_num_batched_tokens=32)
        assert st["backend"] == "triton" and st["graph_steps"] > 0
        assert st["prefill_graph_steps"] > 0  # whole-prompt chunks through the padded prefill step
        assert rep.ok, rep.details
        # the kernels run q and p in bf16: exact agreement here, ties (if any) within bf16 rounding
        assert rep.exact + rep.ties == len(prompts)
    # three sequences in a bucket of 4 rows: its units dealt the same to every row (the schedule measured against)
    rep, st = engine_agreement(v3, INT4, prompts, 6, tie_tol=2e-2, backend="triton", cuda_graphs="emulate",
                               num_pages=12, graph_buckets=(1, 2, 4), max_num_batched_tokens=32, graph_units="rows")
    assert st["graph_steps"] > 0 and rep.exact + rep.ties == len(prompts), rep.details


def test_engine_takes_the_decode_tiling_from_its_config(v3):
    """EngineConfig.decode_config chooses the decode kernel's tiling (here a split floor of 32 tokens) for
    eager steps and graph plans alike; the outputs are those of the default tiling."""
    import dataclasses

    from quantmla.kernels import api

    asked = []

    def floor_32(rows, layout, device):
        asked.append(rows)
        return dataclasses.replace(api.default_config(rows, layout, device), min_chunk=32)

    prompts = _prompts((6, 21), seed=3)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    cfg = {"quant": INT4, "num_pages": 12, "backend": "triton", "cuda_graphs": False, "max_num_batched_tokens": 32}
    with Engine(v3, EngineConfig(**cfg)) as eng:
        ref = [o.output_ids for o in eng.generate(prompts, params)]
    with Engine(v3, EngineConfig(**cfg, decode_config=floor_32)) as eng:
        assert [o.output_ids for o in eng.generate(prompts, params)] == ref
        assert asked and set(asked) == {v3.config.num_attention_heads}  # the job's decode steps asked it
        plan = eng.backend.static_plan(2, 128)
    assert all(md.config.min_chunk == 32 for md in plan.md.values())


def test_engine_fp8_cache_through_interpreted_kernels(v3):
    """The FP8 cache (e4m3 latent with fp32 group scales, bf16 RoPE: fp8_ds_mla's record) behind the engine:
    append, prefill read-back and decode kernels, graph-step path emulated, preemption on the way."""
    from quantmla.cache.config import QuantCacheConfig
    from quantmla.quant import BF16, PathFormat

    fp8 = QuantCacheConfig(content=PathFormat(8, 16, "fp8", "float32"), rope=BF16)
    rep, st = engine_agreement(v3, fp8, _prompts((6, 21, 2), seed=5), 6, tie_tol=2e-2, backend="triton",
                               cuda_graphs="emulate", num_pages=12, graph_buckets=(1, 2, 4), max_num_batched_tokens=32)
    assert st["backend"] == "triton" and st["graph_steps"] > 0
    assert rep.ok, rep.details


def test_preemption_by_recompute_keeps_outputs(v3):
    prompts = _prompts((40, 3, 25, 50, 12), seed=5)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    roomy = Engine(v3, EngineConfig(quant=INT4, num_pages=100, page_size=16, backend="torch"))
    ref = roomy.generate(prompts, params)
    roomy.close()
    tight = Engine(v3, EngineConfig(quant=INT4, num_pages=7, page_size=16, max_num_batched_tokens=20, backend="torch",
                                    cuda_graphs="emulate", graph_buckets=(1, 2, 4)))
    seen = []
    got = tight.generate([Request(f"q{i}", p, params) for i, p in enumerate(prompts)],
                         on_step=lambda done, total: seen.append((done, total)))
    tight.close()
    assert seen[-1] == (len(prompts), len(prompts)) and all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    st = tight.stats.scheduler
    assert st.preemptions > 0 and tight.stats.graph_steps > 0
    assert tight.stats.prefill_graph_steps > 0  # recomputed prompts too go through the padded prefill step
    assert [o.request_id for o in got] == [f"q{i}" for i in range(len(prompts))]
    assert all(o.ok and len(o.output_ids) == 16 for o in got)
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    assert st.output_tokens == 16 * len(prompts)  # no token sampled twice


def test_request_that_never_fits_fails_clearly_others_complete(v3):
    prompts = _prompts((10, 200, 7), seed=2)
    eng = Engine(v3, EngineConfig(num_pages=8, page_size=16, backend="torch"))  # 128 tokens in all
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))
    eng.close()
    assert outs[1].finish_reason == "error" and "can never fit" in outs[1].error and outs[1].output_ids == []
    assert outs[0].ok and outs[2].ok and len(outs[0].output_ids) == len(outs[2].output_ids) == 5
    assert eng.stats.failed == 1 and eng.stats.completed == 2


def test_auto_backend_says_why_it_is_not_the_kernels(v3):
    """backend="auto" on a format the kernels cannot run takes the torch backend and keeps the reason (warned on
    CUDA, printed by quantmla serve); on one they run, no reason."""
    from quantmla.cache.config import QuantCacheConfig

    eng = Engine(v3, EngineConfig(quant=QuantCacheConfig.of_bits(3, 4, 32, 16), num_pages=8, page_size=16,
                                  backend="auto"))
    eng.close()
    assert eng.backend.name == "torch" and "3-bit" in eng.backend.fallback_reason
    with Engine(v3, EngineConfig(num_pages=8, page_size=16, backend="torch")) as chosen:
        assert chosen.backend.fallback_reason is None


def test_requests_that_cannot_run_fail_alone(v3):
    """Empty prompts, token ids outside the vocabulary and max_new_tokens < 1 fail with the reason,
    before reaching the model; the other requests complete."""
    eng = Engine(v3, EngineConfig(num_pages=20, page_size=16, backend="torch"))
    vocab = v3.config.vocab_size
    reqs = [Request("ok", [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True)),
            Request("empty", [], SamplingParams(max_new_tokens=3)),
            Request("oov", [5, vocab], SamplingParams(max_new_tokens=3)),
            Request("neg", [-1, 5], SamplingParams(max_new_tokens=3)),
            Request("none", [5], SamplingParams(max_new_tokens=0)),
            Request("text", "def f(x):", SamplingParams(max_new_tokens=3)),
            Request("half", [5, 6], SamplingParams(max_new_tokens=2.5)),
            Request("long", [5] * 40, SamplingParams(max_new_tokens=v3.config.max_position_embeddings))]
    outs = eng.generate(reqs)
    why = {o.request_id: o.error for o in outs[1:]}
    assert outs[0].ok and len(outs[0].output_ids) == 3
    assert all(o.finish_reason == "error" and o.output_ids == [] for o in outs[1:])
    assert "prompt is empty" in why["empty"] and f"[0, {vocab}); this prompt has {vocab}" in why["oov"]
    assert "has -1" in why["neg"] and "max_new_tokens must be a whole number, at least 1, got 0" in why["none"]
    assert "must be token ids (ints); tokenize text first" in why["text"] and "got 2.5" in why["half"]
    assert f"but the model has max_position_embeddings {v3.config.max_position_embeddings}" in why["long"]
    assert eng.stats.failed == 7 and eng.stats.completed == 1
    # a generator of token-id lists with params is read once, whole; one-element integer tensors are token ids
    outs = eng.generate((p for p in ([5, 6], torch.tensor([7, 8]))), SamplingParams(max_new_tokens=2, ignore_eos=True))
    eng.close()
    assert [len(o.output_ids) for o in outs] == [2, 2] and all(o.ok for o in outs)


def test_cached_prefix_starts_at_its_position_and_reads_the_pages_as_they_are(v3):
    """A request with ``cached_prefix`` computes only from that position on and attends over what its
    pages hold: after a job that wrote the same prompt into the same pages (a fresh job hands out the
    lowest page ids first), it generates that job's tokens, as a decode row or as a later chunk."""
    prompt = _prompts((40,), seed=4)[0]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    eng = Engine(v3, EngineConfig(quant=INT4, num_pages=20, page_size=16, backend="torch", keep_logits=True))
    ref = eng.generate([Request("full", prompt, params)])[0]
    assert eng.stats.scheduler.computed_tokens == 40 + 5
    for cached in (39, 30):
        got = eng.generate([Request("cached", prompt, params, cached_prefix=cached)])[0]
        assert got.ok and got.output_ids == ref.output_ids
        assert torch.allclose(torch.stack(got.logits), torch.stack(ref.logits), atol=1e-4)
        assert eng.stats.scheduler.computed_tokens == 40 - cached + 5
        assert eng.stats.scheduler.recomputed_tokens == 0
    bad = eng.generate([Request("all", prompt, params, cached_prefix=40),
                        Request("neg", prompt, params, cached_prefix=-1)])
    eng.close()
    assert all(o.finish_reason == "error" and "cached_prefix must lie in [0, 40)" in o.error for o in bad)


def test_engine_stops_at_eos_and_restores_the_model(v3):
    prompts = _prompts((8,), seed=9)
    eng = Engine(v3, EngineConfig(num_pages=20, page_size=16, backend="torch"))
    free = eng.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))[0].output_ids
    eos = free[3]
    for e in (eos, [eos], torch.tensor(eos), torch.tensor([eos])):  # an id, a list, tensors (they hash by identity)
        out = eng.generate(prompts, SamplingParams(max_new_tokens=10, eos_token_id=e))[0]
        assert out.finish_reason == "eos" and out.output_ids == free[: free.index(eos) + 1], e
    eng.close()
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        a = v3(ids).logits
    assert torch.isfinite(a).all()  # the model's own attention is back (no engine context needed)


def test_closing_an_engine_frees_its_graphs_at_once(v3):
    """Graph holders point back at their engine; close() must drop them (a CUDA graph left to the cyclic
    garbage collector can be destroyed in the middle of the next engine's capture and spoil it)."""
    import gc
    import weakref

    eng = Engine(v3, EngineConfig(num_pages=20, page_size=16, backend="torch", cuda_graphs="emulate",
                                  graph_buckets=(1, 2), max_num_batched_tokens=32))
    eng.generate(_prompts((8, 5), seed=1), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert eng.stats.graph_steps > 0 and eng.stats.prefill_graph_steps > 0
    holders = [weakref.ref(eng._graphs), weakref.ref(eng._prefill)]
    gc.disable()
    try:
        eng.close()
        assert all(h() is None for h in holders)  # freed by reference counting, no collector needed
    finally:
        gc.enable()


def test_engine_refuses_hybrid_models_and_bad_budgets():
    with pytest.raises(QuantMLAError, match="not MLA"):
        Engine(tiny_model("kimi_linear"), EngineConfig(num_pages=4))
    with pytest.raises(QuantMLAError, match="holds no page"):
        Engine(tiny_model("deepseek_v3"), EngineConfig(kv_budget_bytes=100))
    with pytest.raises(QuantMLAError, match="KV budget"):
        Engine(tiny_model("deepseek_v3"), EngineConfig())
    with pytest.raises(QuantMLAError, match="prefill_graph_max 1: a prefill chunk has 2 tokens or more"):
        Engine(tiny_model("deepseek_v3"), EngineConfig(num_pages=4, prefill_graph_max=1))
    with pytest.raises(QuantMLAError, match="graph_units 'even': use one of length, rows"):
        Engine(tiny_model("deepseek_v3"), EngineConfig(num_pages=4, graph_units="even"))


@pytest.mark.parametrize("field,value,match", [
    ("watermark", -1.0, "watermark = -1.0: the fraction of pages"),
    ("watermark", 1.0, "watermark = 1.0"),
    ("max_num_seqs", 0, "max_num_seqs = 0: it takes a whole number of at least 1"),
    ("max_num_batched_tokens", 1.5, "max_num_batched_tokens = 1.5"),
    ("max_model_len", -5, "max_model_len = -5"),
    ("mixed_decode_graphs", -1, "mixed_decode_graphs = -1"),
    ("graph_buckets", (), r"graph_buckets = \(\): the decode graphs' rows"),
    ("graph_buckets", (0, 2), r"graph_buckets = \(0, 2\)"),
    ("page_size", 0, "page_size = 0"),
    ("cuda_graphs", "emulated", "cuda_graphs = 'emulated': True, False or 'emulate'"),
    ("prefill_graph_max", 2.5, "prefill_graph_max = 2.5: it takes a whole number"),
    ("kv_budget_bytes", 1 << 20, "num_pages 4 and kv_budget_bytes 1048576 both size the pool; give one"),
])
def test_engine_config_out_of_range_is_refused_before_anything_is_built(field, value, match):
    """A setting out of its range: a QuantMLAError naming it when the engine is made (not a traceback from inside a
    later capture or step), and the Scheduler refuses a watermark outside [0, 1) as well."""
    import dataclasses

    with pytest.raises(QuantMLAError, match=match):
        Engine(tiny_model("deepseek_v3"), dataclasses.replace(EngineConfig(num_pages=4), **{field: value}))
    if field == "watermark":
        with pytest.raises(QuantMLAError, match="watermark"):
            Scheduler(4, 16, watermark=value)


def test_engine_config_takes_what_it_took_before():
    """No graph buckets without graphs, buckets and budgets as numpy values, a budget in bytes as a float: accepted."""
    import numpy as np

    for cfg in (EngineConfig(num_pages=4, cuda_graphs=False, graph_buckets=()),
                EngineConfig(num_pages=4, graph_buckets=np.array([1, 2, 4]), max_model_len=np.int64(64)),
                EngineConfig(kv_budget_bytes=4.0 * (1 << 20))):
        cfg.check()


@pytest.mark.parametrize("path", local_reference_models() or [None])
def test_reference_model_matches_generate(path):
    if path is None:
        pytest.skip("no reference model under models/ yet")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = _prompts((40, 7), vocab=model.config.vocab_size, seed=11)
    d_c, d_r = model.config.kv_lora_rank, model.config.qk_rope_head_dim
    for quant in (BF16_CONFIG, QuantCacheConfig.of_bits(4, 4, min(64, d_c), min(32, d_r))):
        rep, st = engine_agreement(model, quant, prompts, 10, tie_tol=1e-4, backend="torch", max_num_batched_tokens=32)
        if quant is BF16_CONFIG:
            assert rep.exact == len(prompts), rep.details
        else:
            assert rep.ok, rep.details


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_gpu_with_graphs_matches_generate():
    """Dense MLPs (capturable): decode and whole-prompt prefill steps replay CUDA graphs, one engine after
    another on the same model (a closed engine's graphs must not be collected during the next capture)."""
    model = tiny_model("deepseek_v3", first_k_dense_replace=2).cuda()
    prompts = _prompts((7, 33, 90, 1), seed=4)
    for quant in (BF16_CONFIG, INT4, INT2):
        rep, st = engine_agreement(model, quant, prompts, 20, tie_tol=2e-2, num_pages=24, graph_buckets=(1, 2, 4))
        assert st["backend"] == "triton" and st["cuda_graphs"] and st["graph_steps"] > 0, st
        assert st["prefill_graph_steps"] > 0, st
        assert rep.ok, rep.details


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_gpu_moe_falls_back_to_eager_steps():
    """MoE routing that reads expert counts on the host cannot be a CUDA graph: the probe says so before
    any capture, the engine runs eager steps, and the outputs still match generate()."""
    model = tiny_model("deepseek_v3").cuda()
    prompts = _prompts((7, 33, 1), seed=4)
    rep, st = engine_agreement(model, INT4, prompts, 8, tie_tol=2e-2, num_pages=24, graph_buckets=(1, 2, 4))
    assert rep.ok, rep.details
    if not st["cuda_graphs"]:
        assert "synchronizes with the host" in st["graph_error"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads", [16, 128])
def test_engine_on_gpu_deepseek_cache_geometry_matches_generate(heads):
    """DeepSeek's cache geometry (d_c 512, d_r 64, 64-token pages) in a 2-layer model, so decode steps run the CUDA
    kernels the serving jobs run inside captured graphs: at 16 heads the tokens-as-M kernel (its warps apart for
    INT4/INT4 and INT2/INT4, groups 128/64), at 128 the heads-as-M kernel, for BF16, FP8, INT4/INT4 and INT2/INT4.
    Contexts of 1 to 1000 tokens (empty splits, partial tiles, several pages a split); greedy outputs as generate()."""
    from quantmla.cache.layout import PageLayout, TokenLayout
    from quantmla.kernels import api
    from quantmla_lab.bench.serving.throughput import method_config

    model = tiny_model("deepseek_v2", kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=heads,
                       num_key_value_heads=heads, qk_nope_head_dim=32, v_head_dim=32, hidden_size=256,
                       intermediate_size=256, vocab_size=512, first_k_dense_replace=2,
                       max_position_embeddings=2048).cuda()
    prompts = _prompts((1000, 130, 64, 1, 257, 700), vocab=512, seed=7)
    for name in ("int4/int4", "int2/int4", "fp8", "bf16"):
        quant = method_config(name, 128, 64)
        lay = PageLayout(TokenLayout(512, 64, quant.format_for(0)), 64)
        kernel = api.default_config(heads, lay, torch.device("cuda")).describe()
        assert kernel.startswith("cuda/wg" if heads == 128 else "cuda/tm/ws" if name.startswith("int") else "cuda"), kernel
        rep, st = engine_agreement(model, quant, prompts, 24, tie_tol=2e-2, page_size=64, num_pages=48,
                                   max_num_batched_tokens=1024, graph_buckets=(1, 2, 4, 8))
        assert st["cuda_graphs"] and st["graph_steps"] > 0, (name, st)
        assert rep.ok, (name, rep.details)


def test_engines_share_a_model(v3):
    """Several engines (one per cache format) on one model, as serve-bench runs them; closing restores it."""
    prompts = _prompts((12, 30), seed=21)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = {}
    for name, q in (("bf16", BF16_CONFIG), ("int2", INT2)):
        with Engine(v3, EngineConfig(quant=q, num_pages=20, page_size=16, backend="torch")) as e:
            alone[name] = [o.output_ids for o in e.generate(prompts, params)]
    a = Engine(v3, EngineConfig(quant=BF16_CONFIG, num_pages=20, page_size=16, backend="torch"))
    b = Engine(v3, EngineConfig(quant=INT2, num_pages=20, page_size=16, backend="torch"))
    assert [o.output_ids for o in a.generate(prompts, params)] == alone["bf16"]
    assert [o.output_ids for o in b.generate(prompts, params)] == alone["int2"]
    a.close()
    assert [o.output_ids for o in b.generate(prompts, params)] == alone["int2"]
    b.close()
    assert all("forward" not in m.__dict__ for m in v3.modules())
    with pytest.raises(QuantMLAError, match="closed"):
        b.generate(prompts, params)


def test_budget_cut_prompt_runs_eagerly_beside_graph_parts(v3):
    """A step holding a prompt's later part (cut by the token budget) beside a new whole prompt and decode
    rows: the later part runs eagerly, the rest replays graphs (emulated), outputs as generate()."""
    prompts = _prompts((10, 15, 20, 12), seed=5)  # step 1: 10 + 15 + 7 of 20; step 2: 13 more of it + 12
    for quant in (BF16_CONFIG, INT4):
        rep, st = engine_agreement(v3, quant, prompts, 5, tie_tol=2e-2, backend="triton", cuda_graphs="emulate",
                                   num_pages=16, graph_buckets=(1, 2, 4), max_num_batched_tokens=32)
        assert st["eager_chunks"] >= 1 and st["prefill_graph_steps"] >= 2, st
        assert rep.exact + rep.ties == len(prompts) and rep.ok, rep.details


def test_prefill_graph_buckets_stop_at_the_cap():
    """No prefill bucket above prefill_graph_max, whether or not the cap is a bucket size; the token budget still
    rounds up to its bucket; a cap under the smallest bucket is one bucket of the cap."""
    from quantmla.serving.graphs import graph_buckets_for_prefill, prefill_buckets

    b, top = graph_buckets_for_prefill(128, 16384, 5000)
    assert b[-1] == 4096 and top == 4096 and b == [x for x in prefill_buckets(128, 16384) if x <= 4096]
    assert graph_buckets_for_prefill(128, 16384, 4096) == (b, 4096)
    assert graph_buckets_for_prefill(128, 2432, 4096) == (prefill_buckets(128, 2432), 2432)  # 2560 covers 2432
    assert graph_buckets_for_prefill(128, 16384, 100) == ([100], 100)
    assert graph_buckets_for_prefill(128, 16384, 1 << 20) == (prefill_buckets(128, 16384), 16384)


def test_whole_prompts_longer_than_the_largest_prefill_graph_run_eagerly(v3):
    """A whole-prompt chunk longer than prefill_graph_max runs eagerly, unpadded, beside a shorter one that replays its
    graph (emulated); outputs as generate(). Without the cap both replay graphs."""
    prompts = _prompts((10, 30), seed=6)
    kw = dict(backend="torch", cuda_graphs="emulate", num_pages=16, graph_buckets=(1, 2), max_num_batched_tokens=64)
    rep, st = engine_agreement(v3, BF16_CONFIG, prompts, 4, tie_tol=2e-2, prefill_graph_max=16, **kw)
    assert st["eager_chunks"] == 1 and st["prefill_graph_steps"] == 1, st
    assert rep.ok, rep.details
    _, st = engine_agreement(v3, BF16_CONFIG, prompts, 4, tie_tol=2e-2, **kw)
    assert st["eager_chunks"] == 0 and st["prefill_graph_steps"] == 1, st


@pytest.mark.parametrize("backend,graphs", [("torch", False), ("triton", "emulate")])
def test_nonfinite_logits_fail_that_request_alone(backend, graphs):
    """A request whose activations turn NaN (here: a prompt token with a NaN embedding) fails alone with
    the reason, its pages go back to the pool; the others complete exactly as without it. Graph steps
    (emulated) and eager steps both report it."""
    import copy

    base = tiny_model("deepseek_v3")
    clean = _prompts((12, 30, 9, 21), seed=4)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    cfg = dict(num_pages=10, page_size=16, backend=backend, cuda_graphs=graphs, graph_buckets=(1, 2, 4),
               max_num_batched_tokens=32)
    with Engine(base, EngineConfig(**cfg)) as eng:
        ref = [o.output_ids for o in eng.generate([clean[0], clean[1], clean[3]], params)]
    used = {t for p in clean for t in p} | {t for o in ref for t in o}
    bad = min(set(range(3, base.config.vocab_size)) - used)  # a token the clean requests never see
    model = copy.deepcopy(base)
    with torch.no_grad():
        model.get_input_embeddings().weight[bad] = float("nan")
    poisoned = clean[2][:5] + [bad] + clean[2][5:]  # a whole first chunk: sampled in a prefill graph step
    with Engine(model, EngineConfig(**cfg)) as eng:
        outs = eng.generate([clean[0], clean[1], poisoned, clean[3]], params)
        st = eng.stats
    assert outs[2].finish_reason == "error" and "NaN or Inf" in outs[2].error and outs[2].output_ids == []
    assert [o.output_ids for o in (outs[0], outs[1], outs[3])] == ref
    if graphs:
        assert st.prefill_graph_steps > 0
    assert st.failed == 1 and st.completed == 3 and st.scheduler.failed == 1


def test_reference_model_through_interpreted_fused_kernels():
    """A shipped reference model (d_c 128: the generated fused decode kernels) through the Triton backend,
    padded graph-step path emulated, against generate() on QuantMLACache."""
    refs = local_reference_models()
    if not refs:
        pytest.skip("no reference model under models/ yet")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(refs[0], dtype=torch.float32, attn_implementation="eager").eval()
    prompts = _prompts((20, 5), vocab=model.config.vocab_size)
    quant = QuantCacheConfig.of_bits(4, 4, min(64, model.config.kv_lora_rank), min(32, model.config.qk_rope_head_dim))
    rep, st = engine_agreement(model, quant, prompts, 5, tie_tol=2e-2, backend="triton", cuda_graphs="emulate",
                               num_pages=8, graph_buckets=(1, 2))
    assert st["backend"] == "triton" and st["graph_steps"] > 0
    assert rep.ok and rep.exact + rep.ties == len(prompts), rep.details


def test_prefill_buckets_cover_every_chunk_with_bounded_padding():
    from quantmla.serving.graphs import prefill_buckets

    for lo, top in ((128, 2432), (128, 8192), (8, 100), (128, 32), (1, 1)):
        b = prefill_buckets(lo, top)
        assert b == sorted(set(b)) and b[-1] >= top and (len(b) == 1 or b[-2] < top)
        for n in range(1, top + 1, 7):
            pad = next(x for x in b if x >= n)
            assert pad < 2 * max(n, b[0]), (n, pad)  # never more than double the chunk
            if 512 <= n <= 4096:
                assert pad - n < 512  # fine steps where prompts usually fall


def _split_oracle(lens: list[int], units: int, min_tiles: int, tile: int) -> list[tuple[int, int, int, int]]:
    """The split cut written out in plain Python, as a check of schedule.fewest_tiles and cut_units: the fewest key
    tiles a split (from the even share, at least min_tiles) for which every sequence's splits, one at least, fit in
    `units`; each sequence's splits evened out to equal whole tiles."""
    tiles = [-(-n // tile) for n in lens]
    chunk = max(min_tiles, -(-sum(max(t, 1) for t in tiles) // units), 1)
    while sum(max(1, -(-t // chunk)) for t in tiles) > units:
        chunk += 1
    rows = []
    for b, (n, t) in enumerate(zip(lens, tiles)):
        k = max(1, -(-t // chunk))
        per = -(-t // k)
        k = -(-t // per) if per else 1
        rows += [(b, min(n, i * per * tile), min(n, (i + 1) * per * tile), k) for i in range(k)]
    return rows


def test_fewest_tiles_against_a_linear_search():
    """schedule.fewest_tiles against the rule written as a linear search: the fewest tiles a split (at least
    min_tiles and the even share) for which every sequence's units fit; where even one unit a sequence is more
    than the units (fewer units than sequences), the longest sequence's tiles. Narrow windows, wide ones (the
    halving) and more sequences than units; and get_mla_metadata with more sequences than programs stays one
    unit a sequence."""
    import numpy as np

    from quantmla.kernels import schedule

    def linear(t, U, m):
        c = max(m, -(-sum(max(x, 1) for x in t) // max(1, U)), 1)
        top = max(c, max(t, default=1))
        while c < top and sum(max(1, -(-x // c)) for x in t) > U:
            c += 1
        return c

    rng = np.random.default_rng(1)
    for _ in range(2000):
        b = int(rng.integers(0, 80))
        t = (-(-rng.integers(0, int(rng.choice([3, 2000, 70000])), b) // 64)).tolist()
        U = int(rng.integers(max(1, b // 2), 300))
        m = int(rng.integers(0, 5))
        assert schedule.fewest_tiles(np.array(t, dtype=np.int64), U, m) == linear(t, U, m), (t, U, m)
    assert schedule.fewest_tiles(np.array([40] * 100 + [1] * 100), 132, 2) == 40
    md = schedule.get_mla_metadata(torch.tensor([2500] * 100 + [60] * 100, dtype=torch.int32), 16, 1, num_sms=132,
                                   config=schedule.DecodeConfig(block_n=64, min_chunk=128, ctas_per_sm=1))
    assert md.num_units == 200 and md.max_splits == 1


def test_bucket_schedule_deals_units_by_length_as_get_mla_metadata():
    """A graph bucket's work (StaticDecodePlan.update's, and the GPU test of empty units'): its units are the cut
    written out in plain Python (_split_oracle), and get_mla_metadata's for the same lengths and as many programs,
    in order, each sequence's spans covering its tokens once in whole key tiles; the units past them are empty and
    write partial rows only; and the longest span is the shortest that fits the bucket's units."""
    import numpy as np

    from quantmla.kernels import schedule
    from quantmla.serving.triton_backend import bucket_schedule

    cfg = schedule.DecodeConfig(block_n=64, min_chunk=128, ctas_per_sm=1)
    for lens, U in (([0, 1, 63, 64, 65, 700, 1024, 4097], 128), ([21000, 16500, 1, 1], 64), ([5000] * 4, 4),
                    ([300, 70000], 16), ([1] * 8, 8), ([24000, 17000, 20500, 16384, 25000], 256),
                    ([24000, 17000, 20500, 16384, 25000], 6)):
        units, info = bucket_schedule(np.array(lens), U, 128, 64)
        want = _split_oracle(lens, U, 2, 64)
        used = len(want)
        assert units.shape == (U, 4) and units[:used].tolist() == [list(r) for r in want], lens
        md = schedule.get_mla_metadata(torch.tensor(lens, dtype=torch.int32), 16, 1, config=cfg, num_sms=U)
        assert md.units.tolist() == units[:used].tolist() and (info == md.seq_info.numpy()).all()
        assert (units[used:, 1] == units[used:, 2]).all() and (units[used:, 3] == 2).all()
        for b, n in enumerate(lens):
            first, k = info[b]
            mine = units[first: first + k]
            assert (mine[:, 0] == b).all() and (mine[:, 3] == k).all() and mine[0, 1] == 0 and mine[-1, 2] == n
            assert (mine[1:, 1] == mine[:-1, 2]).all() and (mine[:, 1] % 64 == 0).all()
            assert (np.diff(mine[:, 1:3], axis=1)[:-1] >= 128).all()
        tiles = -(-np.array(lens) // 64)
        c = max(-(-(units[:used, 2] - units[:used, 1]) // 64))
        assert c <= 2 or np.maximum(1, -(-tiles // (c - 1))).sum() > U  # one tile less would not fit
    rng = np.random.default_rng(0)  # fewest_tiles' window and its halving, against the oracle's linear search
    for _ in range(300):
        b = int(rng.integers(1, 65))
        lens = rng.integers(0, int(rng.choice([3, 2000, 70000])), b).tolist()
        U = int(rng.integers(b, 300))
        assert bucket_schedule(np.array(lens), U, 128, 64)[0][: len(want := _split_oracle(lens, U, 2, 64))].tolist() \
            == [list(r) for r in want], (lens, U)
    assert bucket_schedule(np.array([700, 5]), 2, 128, 64)[0][:, 3].tolist() == [1, 1]  # one unit a row: no partials
    with pytest.raises(ValueError, match="cannot hold"):
        bucket_schedule(np.array([1, 1, 1]), 2, 128, 64)


def test_decode_rows_replay_their_graph_beside_eager_chunks(v3):
    """EngineConfig.mixed_decode_graphs: in a step whose prompt chunks run eagerly (no prefill graphs here) and hold
    at most that many tokens, the decode rows replay their graph (emulated) beside the chunks' forward; outputs as
    generate(). Above the threshold, or with 0, such steps run whole and eagerly."""
    prompts = _prompts((6, 30, 21, 9), seed=7)  # the longer prompts arrive in parts beside the first ones' decode rows
    kw = dict(tie_tol=2e-2, backend="triton", cuda_graphs="emulate", num_pages=16, graph_buckets=(1, 2, 4),
              max_num_batched_tokens=16, prefill_graphs=False)
    split = {}
    for limit in (0, 8, 16):
        rep, st = engine_agreement(v3, INT4, prompts, 5, mixed_decode_graphs=limit, **kw)
        assert rep.exact + rep.ties == len(prompts) and rep.ok, (limit, rep.details)
        split[limit] = st["mixed_graph_steps"]
        # a split step runs its chunks (one or more) in one eager forward; a whole eager step counts none
        assert st["prefill_graph_steps"] == 0
        assert (st["eager_chunks"] >= st["mixed_graph_steps"] > 0) if limit else st["eager_chunks"] == 0
    assert split[0] == 0 and 0 < split[8] < split[16], split
