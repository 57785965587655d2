"""Products that read one input as one GEMM (serving/merged.py), the gated MLP's activation in one kernel
(kernels/activation.py, TRITON_INTERPRET=1 on CPU) and the engine's use of both (serving/mlp.py, the dispatch
forward): the same products, weights as views of the stacked tensor and no memory added, a stale stack never used,
the modules' own weights and forwards back after close()."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantmla.model.tiny import FAMILIES, tiny_model
from quantmla.serving import mlp
from quantmla.serving.engine import BF16_CONFIG, Engine, EngineConfig
from quantmla.serving.merged import MergedLinears, merge_reason

TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _linears(sizes, k=48, bias=False, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(k, n, bias=bias).to(DEV, dtype) for n in sizes]


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_product_equals_each_product_and_adds_no_memory(bias):
    lins = _linears([40, 24], bias=bias)
    x = torch.randn(3, 5, 48, device=DEV)
    refs = [lin(x) for lin in lins]
    params = [lin.weight for lin in lins]
    m = MergedLinears(lins)
    assert [lin.weight for lin in lins] == params  # the same Parameter objects
    assert all(lin.weight.untyped_storage().data_ptr() == m.weight.untyped_storage().data_ptr() for lin in lins)
    assert m.weight.shape == (64, 48) and m.current()
    for got, ref, lin in zip(m(x), refs, lins):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lin(x), ref, rtol=0, atol=0)  # the module's own product reads the same values
    with torch.no_grad():  # an in-place update reaches the stack
        lins[1].weight.mul_(2)
    torch.testing.assert_close(m(x)[1], 2 * refs[1] - (lins[1].bias if bias else 0), rtol=1e-5, atol=1e-5)


def test_a_replaced_weight_makes_the_stack_stale_and_release_restores_storage():
    lins = _linears([16, 8])
    m = MergedLinears(lins)
    lins[0].weight.data = torch.zeros_like(lins[0].weight)
    assert not m.current()
    values = lins[1].weight.detach().clone()
    m.release()
    assert lins[1].weight.untyped_storage().data_ptr() != lins[0].weight.untyped_storage().data_ptr()
    assert lins[1].weight.untyped_storage().nbytes() == values.numel() * 4
    torch.testing.assert_close(lins[1].weight.detach(), values, rtol=0, atol=0)
    assert not m.current()


def test_a_module_replaced_at_its_owner_makes_the_stack_stale():
    """A whole module swapped at its owner (attn.q_proj = nn.Linear(...)) leaves the old module's weight a view of
    the stack, so only the owners' lookup can tell: current() is False and callers run the new module."""
    owner, blind_owner = nn.Module(), nn.Module()
    owner.a, owner.b = _linears([16, 8])
    blind_owner.a, blind_owner.b = _linears([16, 8])
    m = MergedLinears([owner.a, owner.b], lambda: [owner.a, owner.b])
    blind = MergedLinears([blind_owner.a, blind_owner.b])
    assert m.current() and blind.current()
    owner.b = nn.Linear(owner.b.in_features, owner.b.out_features).to(DEV)
    blind_owner.b = nn.Linear(blind_owner.b.in_features, blind_owner.b.out_features).to(DEV)
    assert not m.current()
    assert blind.current()  # without owners the swap goes unseen: the lookup is what sees it


class _HookedLinear(nn.Linear):
    pass


def test_merge_refuses_what_one_product_cannot_compute():
    a, b = _linears([8, 8])
    assert merge_reason([a, b]) is None
    assert "plain nn.Linear" in merge_reason([a, _HookedLinear(48, 8).to(DEV)])
    assert "input widths" in merge_reason([a, nn.Linear(32, 8).to(DEV)])
    assert "biases" in merge_reason([a, nn.Linear(48, 8, bias=True).to(DEV)])
    assert "dtypes" in merge_reason([a, nn.Linear(48, 8, bias=False).to(DEV, torch.bfloat16)])
    h = b.register_forward_hook(lambda *args: None)
    assert "hooks" in merge_reason([a, b])
    h.remove()
    b.forward = lambda x: x  # as accelerate's offloading wraps a module's forward
    assert "replaced forward" in merge_reason([a, b])
    del b.forward
    assert merge_reason([a, b]) is None
    assert "meta" in merge_reason([a, nn.Linear(48, 8, bias=False, device="meta")])
    with pytest.raises(ValueError, match="cannot merge"):
        MergedLinears([a, nn.Linear(32, 8).to(DEV)])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 1500])
def test_silu_mul_matches_the_modules_arithmetic(dtype, width):
    """Rows of [2, 5, 2I], strided rows (a slice of a wider tensor) and no rows: SiLU rounded to the dtype, then
    the product, as act_fn(gate) * up computes it."""
    from quantmla.kernels.activation import silu_mul

    g = torch.Generator().manual_seed(3)
    wide = (torch.randn(2, 5, 2 * width + 32, generator=g) * 4).to(DEV, dtype)
    for x in (wide[..., : 2 * width].contiguous(), wide[..., : 2 * width], wide[:, :0, : 2 * width]):
        ref = F.silu(x[..., :width]) * x[..., width:]
        got = silu_mul(x)
        assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        elif x.numel():  # one rounding of the SiLU apart at most, and the same almost everywhere
            step = ref.float().abs().clamp_min(1e-3) * 2.0**-7
            assert bool(((got.float() - ref.float()).abs() <= 2 * step).all())
            assert (got == ref).float().mean() > 0.99


@needs_triton
def test_silu_mul_refuses_an_odd_width():
    from quantmla.kernels.activation import silu_mul

    with pytest.raises(ValueError, match="halves"):
        silu_mul(torch.randn(2, 7, device=DEV))


class _Engine:
    pass


@needs_triton
def test_mlp_attach_fuses_inside_steps_only_and_detach_restores():
    """A SiLU MLP is fused (its gate and up weights views of one stack) and gives its own answer inside a step of
    its engine only; a GELU MLP keeps its forward and says why; detach gives the forwards and the weights'
    own storage back."""
    silu = tiny_model("deepseek_v2").model.layers[0].mlp
    gelu = tiny_model("deepseek_v2", hidden_act="gelu").model.layers[0].mlp
    model = nn.ModuleDict({"silu": silu, "gelu": gelu}).to(DEV)
    eng, stranger, active = _Engine(), _Engine(), [None]
    report = mlp.attach(model, eng, lambda: active[0], cpu=True)
    assert report["silu"] == "fused" and "another activation" in report["gelu"], report
    assert silu.gate_proj.weight.untyped_storage().data_ptr() == silu.up_proj.weight.untyped_storage().data_ptr()
    assert "forward" not in gelu.__dict__ and gelu.gate_proj.weight.untyped_storage().data_ptr() != \
        gelu.up_proj.weight.untyped_storage().data_ptr()

    calls = []
    import quantmla.kernels.activation as ka
    real = ka.silu_mul
    ka.silu_mul = lambda *a: calls.append(1) or real(*a)
    try:
        x = torch.randn(1, 6, silu.gate_proj.in_features, device=DEV)
        ref = silu.__dict__[mlp._KEY]["orig"](x)
        for who, fused in ((None, False), (stranger, False), (eng, True)):
            active[0] = who
            n = len(calls)
            torch.testing.assert_close(silu(x), ref, rtol=1e-5, atol=1e-6)
            assert (len(calls) > n) == fused
        silu.up_proj.weight.data = silu.up_proj.weight.data.clone()  # replaced: the stack is stale, not used
        n = len(calls)
        torch.testing.assert_close(silu(x), ref, rtol=1e-5, atol=1e-6)
        assert len(calls) == n
        stack = silu.__dict__[mlp._KEY]["merged"].weight
        silu.up_proj.weight.data = stack[silu.gate_proj.out_features:]  # a view of the stack again
        n = len(calls)
        silu(x)
        assert len(calls) > n
        old = silu.up_proj
        silu.up_proj = nn.Linear(old.in_features, old.out_features, bias=False).to(DEV)
        n = len(calls)
        torch.testing.assert_close(silu(x), silu.__dict__[mlp._KEY]["orig"](x), rtol=0, atol=0)  # the new module
        assert len(calls) == n
        silu.up_proj = old
        silu.up_proj.weight.data = silu.up_proj.weight.data.clone()  # stale again
        late = _Engine()  # an engine attaching now is told so
        assert "replaced" in mlp.attach(model, late, lambda: active[0], cpu=True)["silu"]
        mlp.detach(model, late)
    finally:
        ka.silu_mul = real
    mlp.detach(model, eng)
    assert "forward" not in silu.__dict__ and mlp._KEY not in silu.__dict__
    assert silu.gate_proj.weight.untyped_storage().nbytes() == silu.gate_proj.weight.numel() * 4


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_engine_merges_the_query_and_kv_projections_and_falls_back_when_a_weight_changes(family, tmp_path):
    """q_proj (or q_a_proj) and kv_a_proj_with_mqa become one product while an engine is attached; its logits
    equal the unmerged engine's; after a weight is replaced the engine computes with the new weight (never the
    stale stack), and close() gives each module its own storage back."""
    from quantmla.serving.scheduler import SamplingParams

    model = tiny_model(family)
    attn = model.model.layers[0].self_attn
    first = attn.q_proj if family == "deepseek_v2" else attn.q_a_proj
    prompts = [[5, 9, 2, 77, 13], [4, 4, 8]]
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)

    def run(**kw):
        with Engine(model, EngineConfig(quant=BF16_CONFIG, num_pages=16, page_size=16, backend="torch",
                                        keep_logits=True, **kw)) as eng:
            outs = eng.generate(prompts, sp)
            return eng.projections, [o.output_ids for o in outs], [o.logits for o in outs], eng

    off, ids_off, logits_off, _ = run(merged_projections=False)
    assert off.startswith("off")
    from safetensors.torch import load_file, save_file

    with Engine(model, EngineConfig(quant=BF16_CONFIG, num_pages=16, page_size=16, backend="torch")) as eng:
        assert eng.projections == "merged"
        assert first.weight.untyped_storage().data_ptr() == attn.kv_a_proj_with_mqa.weight.untyped_storage().data_ptr()
        save_file(model.state_dict(), str(tmp_path / "model.safetensors"))  # each module's own rows, while attached
    assert first.weight.untyped_storage().data_ptr() != attn.kv_a_proj_with_mqa.weight.untyped_storage().data_ptr()
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    on, ids_on, logits_on, _ = run()
    assert on == "merged" and ids_on == ids_off
    for a, b in zip(logits_on, logits_off):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    def changed_while_attached(change):
        """Logits of an engine attached while `change()` runs, and of an unmerged engine after it."""
        with Engine(model, EngineConfig(quant=BF16_CONFIG, num_pages=16, page_size=16, backend="torch",
                                        keep_logits=True)) as eng:
            change()
            got = [o.logits for o in eng.generate(prompts, sp)]
        _, _, want, _ = run(merged_projections=False)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        return want

    def flip_weight():  # new values, no longer held by the stack
        first.weight.data = first.weight.data.flip(0)

    want = changed_while_attached(flip_weight)
    assert not torch.allclose(want[0][0], logits_off[0][0], rtol=1e-3, atol=1e-3)  # the replaced weight mattered

    kv_a = attn.kv_a_proj_with_mqa  # the whole module swapped at its owner while the engine is attached
    new = nn.Linear(kv_a.in_features, kv_a.out_features, bias=kv_a.bias is not None)
    with torch.no_grad():
        new.weight.copy_(kv_a.weight.flip(0))
    want_new = changed_while_attached(lambda: setattr(attn, "kv_a_proj_with_mqa", new))
    assert not torch.allclose(want_new[0][0], want[0][0], rtol=1e-3, atol=1e-3)  # the new module mattered


def test_engine_keeps_the_mlps_on_the_cpu_and_says_why():
    model = tiny_model("deepseek_v3", first_k_dense_replace=1)
    with Engine(model, EngineConfig(quant=BF16_CONFIG, num_pages=8, page_size=16, backend="torch")) as eng:
        assert eng.mlps and set(eng.mlps) == set(mlp.gated_mlps(model))
        assert all(v == "not on a CUDA device" for v in eng.mlps.values())
    with Engine(model, EngineConfig(quant=BF16_CONFIG, num_pages=8, page_size=16, backend="torch",
                                    merged_projections=False)) as eng:
        assert eng.mlps == {} and eng.projections.startswith("off")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_engine_on_gpu_merges_projections_and_mlps_and_matches_generate(family):
    """On CUDA the query/kv projections are one product and every gated MLP is fused (bf16), and greedy outputs
    with graph steps still equal generate()'s."""
    from quantmla_lab.bench.serving.agreement import engine_agreement

    model = tiny_model(family, first_k_dense_replace=2, dtype=torch.bfloat16).cuda()
    eng = Engine(model, EngineConfig(quant=BF16_CONFIG, num_pages=8, page_size=16))
    assert eng.projections == "merged" and eng.mlps and all(v == "fused" for v in eng.mlps.values()), eng.mlps
    eng.close()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 40, 1)]
    rep, st = engine_agreement(model, BF16_CONFIG, prompts, 16, tie_tol=2e-2, num_pages=24, graph_buckets=(1, 2, 4))
    assert st["graph_steps"] > 0 and rep.ok, rep.details


def test_patching_keeps_the_modules_own_forward_until_the_last_engine_leaves():
    from quantmla.serving.patching import patch, unpatch

    lin = nn.Linear(4, 4)
    own = lin.forward
    e1, e2, released = object(), object(), []
    reg = patch(lin, "_k", lambda self, x: reg["orig"](x) * 0, e1, entry="one", state=1)
    assert patch(lin, "_k", lambda self, x: x, e2, entry="two", state=2) is reg  # the first engine's forward and state
    assert reg["state"] == 1 and reg["engines"] == {id(e1): "one", id(e2): "two"}
    x = torch.randn(2, 4)
    assert (lin(x) == 0).all()
    unpatch(lin, "_k", e1, on_last=released.append)
    assert "_k" in lin.__dict__ and not released
    unpatch(lin, "_k", e2, on_last=released.append)
    assert released == [reg] and "_k" not in lin.__dict__ and "forward" not in lin.__dict__
    assert lin.forward == own
    unpatch(lin, "_k", e2)  # nothing left to undo


@needs_triton
@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_gated_mlps_fuse_and_give_the_models_logits(family):
    """Each tiny family's gated MLPs (dense layers, shared experts) fuse, and the model's logits with them fused
    inside a step equal its own; detach leaves the weights as they were."""
    model = tiny_model(family).to(DEV)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0)).to(DEV)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(ids).logits
        eng, active = _Engine(), [None]
        report = mlp.attach(model, eng, lambda: active[0], cpu=True)
        assert report and all(v == "fused" for v in report.values()), report
        active[0] = eng
        got = model(ids).logits
        active[0] = None
        mlp.detach(model, eng)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)
