"""The heads-as-M kernel's cluster merge (CLUSTER_MERGE, kernels/cuda/wg_epilogue.cuh) without a GPU: the units cut in
multiples of a cluster, the cluster chosen per call, the metadata's partial slots and combine rows, its builds for
sm_90a, and the clear errors of configs and launches that cannot take it. The kernel itself runs in
tests/test_kernels_gpu_warpgroup.py."""

import subprocess

import numpy as np
import pytest
import torch
from helpers.cuda_plans import plan

from quantmla.errors import UnsupportedFormatError
from quantmla.kernels import cuda, schedule
from quantmla.kernels.cuda import build


def _spans(units, info, lens):
    """Each sequence's units as (start, end) spans, checked to be its own and in order."""
    out = []
    for b, (first, n) in enumerate(info):
        rows = units[first:first + n]
        assert (rows[:, 0] == b).all() and (rows[:, 3] == n).all()
        out.append([(int(s), int(e)) for _, s, e, _ in rows])
    assert sum(info[:, 1]) == len(units) == info[-1, 0] + info[-1, 1]
    return out


@pytest.mark.parametrize("multiple", [2, 4, 8])
def test_cut_units_in_multiples(multiple):
    """Every sequence's splits a multiple of `multiple` (so its first unit is one too), its units covering [0, len)
    in order and evened out (whole tiles of at most the even share; only trailing units may be empty), a sequence of 0
    tokens `multiple` empty units; without `multiple` the cut is the one it was."""
    rng = np.random.default_rng(multiple)
    for _ in range(200):
        lens = rng.integers(0, 40000, size=int(rng.integers(1, 12)))
        lens[rng.random(len(lens)) < 0.2] = rng.integers(0, 3)
        chunk = int(rng.integers(1, 40))
        units, info = schedule.cut_units(lens, chunk, 64, multiple=multiple)
        assert (info[:, 1] % multiple == 0).all() and (info[:, 0] % multiple == 0).all()
        for n, spans in zip(lens, _spans(units, info, lens)):
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [e - s for s, e in spans]
            tiles = -(-int(n) // 64)
            share = -(-tiles // len(spans)) * 64
            assert all(0 <= x <= share for x in sizes) and all(s % 64 == 0 or s == n for s, _ in spans)
            nonempty = [x > 0 for x in sizes]
            assert nonempty == sorted(nonempty, reverse=True)  # empty units only at the end
            base = schedule.cut_units(np.array([n]), chunk, 64)[1][0, 1]
            assert len(spans) == -(-base // multiple) * multiple
        u1, i1 = schedule.cut_units(lens, chunk, 64, multiple=1)
        u0, i0 = schedule.cut_units(lens, chunk, 64)
        assert (u1 == u0).all() and (i1 == i0).all()


def test_cluster_units_takes_the_largest_cluster_within_the_waves():
    """The cluster a call gets: 8 for a lone 32K sequence at 128 heads on 132 SMs (64 units of 8 tiles), 2 for 32
    sequences of 2 units (each cluster its whole sequence), none where rounding up would start a wave (64 sequences of
    one unit), 4 where 8 would add a wave to hundreds of forced splits; and no larger than the device runs at once."""
    one, waves = 132 // 2, lambda n: -(-n // 66)
    c, u, i = schedule.cluster_units(np.array([32768]), 8, 64, 8, one)
    assert (c, len(u), i[0, 1]) == (8, 64, 64)
    c, u, i = schedule.cluster_units(np.array([8192] * 32), 64, 64, 8, one)
    assert (c, len(u)) == (2, 64) and (i[:, 1] == 2).all()
    c, u, i = schedule.cluster_units(np.array([4096] * 64), 64, 64, 8, one)
    base = schedule.cut_units(np.array([4096] * 64), 64, 64)
    assert c == 1 and (u == base[0]).all() and (i == base[1]).all()
    lens = np.array([20000, 3, 511])
    c, u, i = schedule.cluster_units(lens, 1, 64, 8, one)
    assert c == 4 and waves(len(u)) == waves(len(schedule.cut_units(lens, 1, 64)[0])) and (i[:, 1] % 4 == 0).all()
    asked = []
    c, u, _ = schedule.cluster_units(np.array([32768]), 8, 64, 8, one, fits=lambda c, n: asked.append((c, n)) or c <= 2)
    assert c == 2 and asked == [(8, 64), (4, 64), (2, 64)]
    assert schedule.cluster_units(np.array([32768]), 8, 64, 8, one, fits=lambda c, n: False)[0] == 1


def test_cluster_metadata(monkeypatch):
    """A cluster config's metadata: the units cut for the cluster it takes, that cluster in its config, one partial slot
    a cluster, the combine's rows (first slot, slots) the units' divided by it, and no combine where every cluster holds
    its whole sequence."""
    monkeypatch.setattr(cuda, "clusters_fit", lambda *a: True)
    monkeypatch.setattr(schedule, "cfg_plan", lambda *a: None)
    cfg = schedule.DecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1, min_chunk=128,
                                kernel="cuda", warpgroup=True, cluster=8)
    md = schedule.get_mla_metadata(torch.tensor([32768, 32768]), 128, 1, config=cfg, num_sms=132)
    c = md.config.cluster
    assert c == 8 and md.num_units == 64 and (md.seq_info[:, 1] == 32).all()
    assert (md.combine_info == md.seq_info // c).all() and md.combine_splits == md.max_splits // c
    po, plse = md.partials(128, 512, torch.float32, "cpu")
    assert po.shape == (md.num_units // c, 128, 512) and plse.shape == (md.num_units // c, 128)
    assert md.config.describe().endswith(f" x{c}")
    whole = schedule.get_mla_metadata(torch.tensor([8192] * 32), 128, 1, config=cfg, num_sms=132)
    assert whole.config.cluster == 2 and whole.combine_splits == 1
    for lens in ([4096] * 64, [32768, 5000]):  # (rounding 57 and 9 splits up to 58 and 10 would start a second wave)
        plain = schedule.get_mla_metadata(torch.tensor(lens), 128, 1, config=cfg, num_sms=132)
        assert plain.config.cluster == 1 and (plain.combine_info == plain.seq_info).all()


def test_cluster_config_errors():
    """A cluster of another size, or on a kernel other than heads as M, is refused with the reason, before any build."""
    lay, _ = plan("bf16", 128, warpgroup=True)
    for kw in ({"cluster": 3, "warpgroup": True}, {"cluster": 2}, {"cluster": 4, "warpgroup": True, "tokens_m64": True},
               {"cluster": 16, "warpgroup": True}):
        with pytest.raises(UnsupportedFormatError, match="clusters of 2, 4 or 8"):
            schedule.cuda_config(128, lay, "cuda", **kw)


def test_launch_refuses_clusters_the_build_does_not_take():
    """A launch whose clusters and build disagree (the merge build without clusters, clusters without it, clusters that
    do not divide the units) is a ValueError before the driver is touched."""
    _, merge = plan("bf16", 128, warpgroup=True, cluster_merge=True)
    lay, plain = plan("bf16", 128, warpgroup=True)
    assert dict(merge.macros)["CLUSTER_MERGE"] == 1 and "CLUSTER_MERGE" not in dict(plain.macros)
    assert merge.describe() != plain.describe()
    lse = torch.zeros(4, 128)
    args = (None, None, None, None, None, None, None, None, None, lse, lse, lse, 0, 128, 1, 128, 1, 1.0)
    for p, grid, c in ((merge, (16, 2), 1), (plain, (16, 2), 2), (merge, (12, 2), 8), (merge, (16, 2), 3)):
        with pytest.raises(ValueError, match="clusters of 2, 4 or 8"):
            cuda.launch_decode(p, grid, args, torch.device("cuda"), cluster=c)


@pytest.mark.skipif(build.nvcc() is None, reason="needs nvcc")
def test_cluster_merge_builds_for_sm90(tmp_path):
    """The cluster-merge builds of the heads-as-M kernels (BF16, INT4/INT4, FP8, the warpgroups out of phase) compile
    for sm_90a with no stack spills and no warning; their staged rows fit below the rows' sums (static_asserts)."""
    for fmt, kw in (("bf16", {}), ("int4/int4", {}), ("fp8", {}), ("bf16", {"seesaw": True})):
        _, p = plan(fmt, 128, warpgroup=True, cluster_merge=True, **kw)
        mac = p.macros
        cmd = [build.nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
               *[f"-D{k}={v}" for k, v in mac], "-o", str(tmp_path / "cm.cubin"), str(build.source_of(mac))]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in r.stderr, r.stderr[-2000:]
        assert "warning" not in r.stderr.lower(), r.stderr[-2000:]
