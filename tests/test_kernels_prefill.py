"""The prefill kernel (non-absorbed, causal, a chunk at the end of its context) under TRITON_INTERPRET=1 on
CPU or on the GPU: against the fp64 oracle into NaN-poisoned outputs, its tilings and key reads, and clear errors
for shapes that do not fit together."""

import dataclasses
import os
from unittest import mock

import pytest
import torch
from helpers.cpu_decode import DEV

from quantmla.errors import QuantMLAError
from quantmla.kernels import api, mla_prefill_attention
from quantmla.kernels.api import PrefillConfig, default_prefill_config
from quantmla.reference.prefill import prefill_attention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)


def _prefill_inputs(n, T, H, d_n, d_r, d_v, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q_nope, q_rope = torch.randn(n, H, d_n, generator=g), torch.randn(n, H, d_r, generator=g)
    kv, k_rope = torch.randn(T, H, d_n + d_v, generator=g), torch.randn(T, d_r, generator=g)
    return [x.to(DEV, dtype) for x in (q_nope, q_rope, kv, k_rope)]


@pytest.mark.parametrize("n,T,H,d_n,d_r,d_v", [
    (40, 40, 2, 32, 16, 32),  # whole prompt, several query and key blocks
    (7, 53, 3, 32, 32, 48),  # a chunk continuing a context; value width not a power of two
    (1, 9, 2, 16, 16, 16),  # one query
    (19, 19, 1, 128, 64, 128),  # DeepSeek head dims
])
def test_prefill_attention_matches_fp64_reference(n, T, H, d_n, d_r, d_v):
    """The prefill kernel (non-absorbed, causal with the chunk at the end of its context) against the
    fp64 oracle, into a NaN-poisoned output, with kv a strided view like kv_b_proj's output."""
    q_nope, q_rope, kv, k_rope = _prefill_inputs(n, T, H, d_n, d_r, d_v)
    scale = (d_n + d_r) ** -0.5
    wide = torch.randn(T, H, d_n + d_v + 8, device=DEV)  # rows and heads with padding: a strided kv
    wide[..., : d_n + d_v] = kv
    out = torch.full((n, H, d_v), float("nan"), device=DEV)
    got = mla_prefill_attention(q_nope, q_rope, wide[..., : d_n + d_v], k_rope, scale, out=out)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    if DEV == "cuda":  # the GPU kernel runs bf16 operands and probabilities (fp32 accumulation)
        ref = prefill_attention(*(x.bfloat16() for x in (q_nope, q_rope, kv, k_rope)), scale)
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, f"prefill attention relative error {rel:.3g}"
    else:
        ref = prefill_attention(q_nope, q_rope, kv, k_rope, scale)
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    # the unmasked key blocks below the causal diagonal change no value: one masked loop gives the same output
    one_loop = dataclasses.replace(default_prefill_config(n, T), split_diagonal=False)
    assert isinstance(one_loop, PrefillConfig)
    got1 = mla_prefill_attention(q_nope, q_rope, wide[..., : d_n + d_v], k_rope, scale, config=one_loop)
    torch.testing.assert_close(got1, got, rtol=0, atol=0)
    # causality: changing the last context token moves only the last query's output
    kv2 = kv.clone()
    kv2[-1, :, d_n:] += 100  # the last token's values
    got2 = mla_prefill_attention(q_nope, q_rope, kv2, k_rope, scale)
    torch.testing.assert_close(got2[:-1], got[:-1], rtol=0, atol=0)
    assert (got2[-1] - got[-1]).abs().max() > 1e-2


@pytest.mark.parametrize("n,T,H,d_n,d_r,d_v", [(40, 40, 2, 32, 16, 32), (5, 70, 2, 64, 32, 64)])
def test_prefill_key_blocks_through_tensor_descriptors_change_nothing(n, T, H, d_n, d_r, d_v):
    """The key blocks read through tensor descriptors (rows past the context read as zeros by the copy) give the
    pointer loads' output bit for bit, kv a strided view; dims or strides a bulk copy cannot read get no
    descriptors (the pointer loads then run)."""
    q_nope, q_rope, kv, k_rope = _prefill_inputs(n, T, H, d_n, d_r, d_v)
    wide = torch.randn(T, H, d_n + d_v + 8, device=DEV)
    wide[..., : d_n + d_v] = kv
    kv = wide[..., : d_n + d_v]
    base = api.default_prefill_config(n, T)
    assert api._prefill_descriptors(kv, k_rope, d_n, d_v, base.block_n) is not None
    got = api.mla_prefill_attention(q_nope, q_rope, kv, k_rope, 0.125, config=dataclasses.replace(base, tma=True))
    want = api.mla_prefill_attention(q_nope, q_rope, kv, k_rope, 0.125, config=base)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert api._prefill_descriptors(kv[..., : d_n + 24], k_rope, d_n, 24, base.block_n) is None  # d_v 24
    odd = torch.randn(T, H, d_n + d_v + 1, device=DEV)[..., : d_n + d_v]  # heads not 16 bytes apart
    assert api._prefill_descriptors(odd, k_rope, d_n, d_v, base.block_n) is None


def test_prefill_default_tiling_follows_the_chunk_and_its_context(monkeypatch):
    """Short prompts take the 64-query tiling, long prompts and short chunks after long contexts the 128-query
    one; a tiling's words parse back to it, and a malformed one is refused."""
    monkeypatch.setattr(api, "interpreting", lambda: False)
    small, large = api.PrefillConfig(), api.PrefillConfig(128, 64, 8, 3)
    assert api.default_prefill_config(1536) == small and api.default_prefill_config(2048, 4096) == small
    assert api.default_prefill_config(4096) == large and api.default_prefill_config(700, 20480) == large
    for cfg in (small, large, dataclasses.replace(large, split_diagonal=False), dataclasses.replace(small, tma=True)):
        assert api.PrefillConfig.parse(cfg.describe()) == cfg
    with pytest.raises(ValueError, match="M128 N64 w8 s3"):
        api.PrefillConfig.parse("M128 w8")


def test_prefill_attention_bf16_and_errors():
    """bf16 inputs (the GPU path): bf16 probabilities, fp32 accumulation, close to the fp64 oracle; clear
    errors on shapes that do not fit together."""
    q_nope, q_rope, kv, k_rope = _prefill_inputs(24, 30, 2, 32, 16, 32, seed=3, dtype=torch.bfloat16)
    got = mla_prefill_attention(q_nope, q_rope, kv, k_rope, 0.15)
    assert got.dtype == torch.bfloat16
    ref = prefill_attention(q_nope, q_rope, kv, k_rope, 0.15)
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, f"bf16 prefill attention relative error {rel:.3g}"
    with pytest.raises(QuantMLAError, match="at least 24 context tokens"):
        mla_prefill_attention(q_nope, q_rope, kv[:10], k_rope[:10], 0.15)
    with pytest.raises(QuantMLAError, match="shapes disagree"):
        mla_prefill_attention(q_nope, q_rope[:, :1], kv, k_rope, 0.15)
    with pytest.raises(QuantMLAError, match=r"out must be \[24, 2, 32\]"):
        mla_prefill_attention(q_nope, q_rope, kv, k_rope, 0.15, out=got[:, :, :16])
    # inputs strided in their last dim (e.g. an interleaved RoPE's view) are taken as they are
    qr_strided = torch.stack([q_rope, q_rope], -1)[..., 0]
    assert qr_strided.stride(-1) == 2
    torch.testing.assert_close(mla_prefill_attention(q_nope, qr_strided, kv, k_rope, 0.15), got)
    # the CPU reference path checks `out` too, before it writes (a wider one would take the result broadcast)
    wide = torch.full((24, 2, 64), 7.0, dtype=torch.bfloat16)
    with mock.patch.object(api, "_use_triton", lambda t: False), \
            pytest.raises(QuantMLAError, match=r"out must be \[24, 2, 32\]"):
        mla_prefill_attention(q_nope.cpu(), q_rope.cpu(), kv.cpu(), k_rope.cpu(), 0.15, out=wide)
    assert torch.all(wide == 7.0)
