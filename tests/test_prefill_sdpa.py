"""The prefill SDPA benchmark's arithmetic on the CPU: the two-part merge and the fp64 reference rows."""

import torch

from quantmla_lab.bench.serving.prefill_sdpa import causal_pairs, chunk_tensors, merge_two_parts, reference_rows


def _attend(q, k, v, scale, mask=None):
    s = torch.einsum("hnd,htd->hnt", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnt,htv->hnv", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def test_two_parts_merge_to_lower_right_causal_attention():
    torch.manual_seed(0)
    H, n, T, d, dv = 3, 5, 12, 8, 6
    q, k, v = torch.randn(H, n, d, dtype=torch.float64), torch.randn(H, T, d, dtype=torch.float64), \
        torch.randn(H, T, dv, dtype=torch.float64)
    lower_right = torch.arange(T)[None, :] <= (T - n + torch.arange(n))[:, None]
    full, _ = _attend(q, k, v, 0.3, lower_right)
    o1, l1 = _attend(q, k[:, :T - n], v[:, :T - n], 0.3)
    o2, l2 = _attend(q, k[:, T - n:], v[:, T - n:], 0.3, torch.ones(n, n, dtype=torch.bool).tril())
    assert torch.allclose(merge_two_parts(o1, l1, o2, l2), full, atol=1e-12)
    # a wrong weight (log2 instead of natural log-sum-exps) does not merge to it
    assert not torch.allclose(merge_two_parts(o1, l1 / 0.6931, o2, l2 / 0.6931), full, atol=1e-3)


def test_reference_rows_are_lower_right_causal():
    n, T, H, dn, dr, dv = 4, 9, 2, 8, 4, 8
    q_nope, q_rope, kv, k_rope = [t.float() for t in chunk_tensors(n, T, H, dn, dr, dv, "cpu")]
    rows = torch.tensor([0, 3])
    out = reference_rows(q_nope, q_rope, kv, k_rope, 0.25, rows)
    q = torch.cat([q_nope, q_rope], -1).double().transpose(0, 1)
    k = torch.cat([kv[..., :dn], k_rope[:, None].expand(T, H, dr)], -1).double().transpose(0, 1)
    v = kv[..., dn:].double().transpose(0, 1)
    mask = torch.arange(T)[None, :] <= (T - n + torch.arange(n))[:, None]
    want, _ = _attend(q, k, v, 0.25, mask)
    assert torch.allclose(out, want.transpose(0, 1)[rows], atol=1e-12)
    assert causal_pairs(n, T) == int(mask.sum())


def test_sdpa_operands_lay_the_chunk_out_as_sdpa_takes_it():
    from torch.nn.attention.bias import causal_lower_right

    from quantmla_lab.bench.serving.prefill_sdpa import sdpa_operands

    n, T, H, dn, dr, dv = 4, 9, 2, 8, 4, 6
    q_nope, q_rope, kv, k_rope = [t.double() for t in chunk_tensors(n, T, H, dn, dr, dv, "cpu")]
    q, k, v = sdpa_operands(q_nope, q_rope, kv, k_rope, pad_v=True)
    assert v.shape[-1] == k.shape[-1] == dn + dr and not v[..., dv:].any()
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, T), scale=0.25)
    want = reference_rows(q_nope, q_rope, kv, k_rope, 0.25, torch.arange(n))
    assert torch.allclose(o[0, :, :, :dv].transpose(0, 1), want, atol=1e-10)


def test_packed_buffers_hold_the_chunk_as_views():
    """The packed operands: after the RoPE key is written into its slots, SDPA's q, k and v are views of the two
    buffers (no copies) and attend as the reference does; an unfilled slot does not."""
    from torch.nn.attention.bias import causal_lower_right

    from quantmla_lab.bench.serving.prefill_sdpa import fill_rope_slot, packed_operands, packed_views

    n, T, H, dn, dr, dv = 4, 9, 2, 8, 4, 6
    q_nope, q_rope, kv, k_rope = [t.double() for t in chunk_tensors(n, T, H, dn, dr, dv, "cpu")]
    q, kvr = packed_operands(q_nope, q_rope, kv, k_rope)
    assert kvr.shape == (T, H, dn + dr + dv) and not kvr[..., dn: dn + dr].any()
    want = reference_rows(q_nope, q_rope, kv, k_rope, 0.25, torch.arange(n))

    def attend():
        qv, k, v = packed_views(q, kvr, dn, dr)
        assert qv.data_ptr() == q.data_ptr() and k.data_ptr() == kvr.data_ptr() and v.untyped_storage().data_ptr() == \
            kvr.untyped_storage().data_ptr() and v.shape[-1] == dv and k.stride(-1) == 1 == v.stride(-1)
        o = torch.nn.functional.scaled_dot_product_attention(qv, k, v, attn_mask=causal_lower_right(n, T), scale=0.25)
        return o[0].transpose(0, 1)

    assert not torch.allclose(attend(), want, atol=1e-3)
    fill_rope_slot(kvr, k_rope, dn)
    assert torch.allclose(attend(), want, atol=1e-10)
