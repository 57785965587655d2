"""Which decode kernel and plan the API's configs choose, without a GPU (the CUDA device, nvcc and the builds mocked):
by rows and device, by the work units' length in eager calls and in the engine's decode graph buckets, with the
SCALE_VOTE build asked for, and where a build fails. The plans themselves are tested in tests/test_kernels_cuda.py."""

import re
from unittest import mock

import pytest
import torch
from helpers.cuda_plans import CUDA

from quantmla.cache.layout import PageLayout, TokenLayout, preset
from quantmla.errors import UnsupportedFormatError
from quantmla.kernels import cuda
from quantmla.kernels.cuda import build


def _defaults_on_hopper_and_ampere(fmt):
    """default_config at 128 and 32 rows on a mocked sm_90, and at 128 rows on a mocked sm_80 (nvcc found, builds
    not run)."""
    from quantmla.kernels.schedule import default_config

    lay = PageLayout(TokenLayout(512, 64, preset(fmt)), 64)
    with mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
            many, few = default_config(128, lay, "cuda"), default_config(32, lay, "cuda")
        with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)):
            ampere = default_config(128, lay, "cuda")
    return many, few, ampere


def test_default_config_takes_heads_as_m_at_64_rows_or_more(monkeypatch):
    """BF16 at 64 query rows or more: the heads-as-M kernel on Hopper; fewer rows, or a GPU before Hopper: Triton.
    Integer codes likewise, else the built tile; FP8 likewise, else Triton's tiles."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    many, few, ampere = _defaults_on_hopper_and_ampere("bf16")
    assert many.kernel == "cuda" and many.warpgroup and many.block_m == 64 and many.ctas_per_sm == 1
    assert few.kernel == "fused" and not few.warpgroup
    assert ampere.kernel == "fused" and not ampere.warpgroup
    many, few, ampere = _defaults_on_hopper_and_ampere("int4/int4")
    assert many.kernel == "cuda" and many.warpgroup and many.num_stages == 3
    assert few.kernel == "cuda" and not few.warpgroup and not few.tokens_m
    assert ampere.kernel == "cuda" and not ampere.warpgroup
    many, few, ampere = _defaults_on_hopper_and_ampere("fp8")  # FP8: one raw stage; Triton's tiles before Hopper
    assert many.kernel == "cuda" and many.warpgroup and many.num_stages == 1
    assert not few.warpgroup and ampere.kernel == "generic"


def test_default_config_takes_the_cuda_kernel_only_on_cuda(monkeypatch):
    from quantmla.kernels.schedule import default_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    assert default_config(16, lay, "cpu").kernel != "cuda"
    fp8 = PageLayout(TokenLayout(512, 64, preset("fp8")), 64)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        cfg, other = default_config(16, lay, "cuda"), default_config(16, fp8, "cuda")
        built = default_config(32, lay, "cuda")
        from quantmla.kernels.schedule import cuda_config

        i48 = PageLayout(TokenLayout(512, 64, preset("int4/int8")), 64)
        asked = (cuda_config(16, lay, "cuda", tokens_m=False), cuda_config(16, i48, "cuda", tokens_m=True),
                 cuda_config(16, fp8, "cuda", tokens_m=True))
    assert not asked[0].tokens_m and asked[0].block_n == cuda.BLOCK_N  # the built tile when asked for
    assert asked[1] is None and "2- or 4-bit affine" in cuda.plan_reason[i48]  # no silent fall back when asked
    assert asked[2].tokens_m and asked[2].token_blocks == 1  # FP8 on tokens as M when asked for
    # integer codes and FP8 at 16 rows: tokens as the MMA's M dimension; more rows: the built tile
    assert cfg.kernel == "cuda" and cfg.tokens_m and cfg.block_n == cuda.TM_BLOCK_N and cfg.block_m == 16
    assert other.kernel == "cuda" and other.tokens_m and other.token_blocks == 1
    assert built.kernel == "cuda" and not built.tokens_m and built.block_m == 32


@pytest.mark.parametrize("name,lens,tokens_m", [
    ("fp8", [131072], False),          # 256 units of 512 tokens: the built tile
    ("fp8", [16384] * 8, False),
    ("fp8", [16384] * 32, True),       # units of 2048 tokens: tokens as M
    ("fp8", [4096] * 64, True),        # 1024 tokens (two CTAs an SM: one is slower in graphs of layers)
    ("fp8", [2048] * 128, True),       # 1024 tokens, 2 splits
    ("fp8", [20480] * 4, False),       # 320 tokens
    ("fp8", [20480] * 7, True),        # 576 tokens, FP8_TM_MIN_TOKENS
    ("int4/int4", [131072], True),     # integer codes: tokens as M at any length
    ("int4/int4", [2048] * 8, True),   # 128-token units, 128 CTAs: the 4-warp plan, one token block a warp
    ("int4/int4", [2048] * 16, True),  # 128-token units, 256 CTAs: the 4-warp plan, two token blocks a warp
    ("int4/int4", [2048] * 32, True),  # 256 tokens (TM_TWO_BLOCKS_MIN_TOKENS), 256 CTAs: two blocks a warp
    ("int4/int4", [2048] * 2, True),   # 128-token units, 32 CTAs: one block a warp
    ("int2/int4", [8192] * 10, True),  # 320 tokens: 2-bit content keeps the warps apart
    ("int2/int4", [2048] * 8, True),   # 128 tokens: the same
    ("int4/int4", [8192] * 10, True),  # 320 tokens: the 4-warp plan
    ("int4/int4", [8192] * 12, True),  # 384 tokens, TM_WS_MIN_TOKENS: the warps apart
])
def test_kernel_chosen_by_the_units_tokens(monkeypatch, name, lens, tokens_m):
    """The API's schedule keeps FP8 on the tokens-as-M kernel where its work units have at least
    FP8_TM_MIN_TOKENS tokens and takes the built tile below; 4-bit content codes keep the tokens-as-M kernel's warps
    apart where units have at least TM_WS_MIN_TOKENS tokens and take its 4-warp plan below, with one token block a warp
    below TM_TWO_BLOCKS_MIN_TOKENS, and 2-bit content codes keep the warps apart at any length (each measured faster
    there); a config passed in is kept."""
    from quantmla.kernels import schedule

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lay = PageLayout(TokenLayout(512, 64, preset(name)), 64)
    seq = torch.tensor(lens, dtype=torch.int32)  # on the CPU: the configs are the CUDA device's (below)
    real_cuda_config = schedule.cuda_config
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        on_cuda = lambda rows, layout, device, **kw: real_cuda_config(rows, layout, "cuda", **kw)  # noqa: E731
        default = schedule.default_config(16, lay, "cuda")
        with mock.patch.object(schedule, "default_config", return_value=default), \
                mock.patch.object(schedule, "cuda_config", on_cuda):
            md = schedule.get_mla_metadata(seq, 16, 1, lay, num_sms=132)
            kept = schedule.get_mla_metadata(seq, 16, 1, lay, config=default, num_sms=132)
    assert default.tokens_m and md.config.kernel == "cuda" and md.config.tokens_m == tokens_m
    assert name != "fp8" or (md.chunk_tokens >= cuda.FP8_TM_MIN_TOKENS) == tokens_m
    assert name != "fp8" or not tokens_m or md.config.ctas_per_sm == 2, md.config  # FP8 on tokens as M: two CTAs
    if name != "fp8":  # the warps apart from tokens_m_ws_min_tokens on, the 4-warp plan (4 warps a CTA) below
        least = {"int4/int4": cuda.TM_WS_MIN_TOKENS, "int2/int4": 0}[name]
        assert cuda.tokens_m_ws_min_tokens(lay) == least
        assert default.specialized and md.config.specialized == (md.chunk_tokens >= least), md.chunk_tokens
        assert md.config.num_warps == (8 if md.config.specialized else 4)
        # on 4 warps 4-bit content takes one token block a warp where its 128-token units' CTAs fit one an SM
        blocks = {("int4/int4", 8): 1, ("int4/int4", 2): 1, ("int4/int4", 16): 2, ("int4/int4", 32): 2,
                  ("int4/int4", 10): 2}
        if not md.config.specialized:
            assert md.config.token_blocks == blocks[(name, len(lens))], (md.num_units, md.chunk_tokens)
    spans = md.units[:, 2] - md.units[:, 1]
    assert int(spans.sum()) == sum(lens) and md.num_units <= 2 * 132  # one wave, every token once
    assert kept.config == default  # a config passed in is the one that runs


@pytest.mark.parametrize("name,b,max_len,want", [
    ("fp8", 4, 26112, "built"),          # the long job's rows (max_model_len) in 59 splits of 7 tiles: the built tile
    ("fp8", 8, 26112, "default"),        # 32 splits of 13 tiles: tokens as M
    ("fp8", 32, 26112, "default"),       # 8 splits of 51 tiles
    ("fp8", 7, 12288, "built"),          # 6 tiles: the built tile, whose splits give another combine shape
    ("int4/int4", 4, 26112, "default"),  # integer codes: tokens as M, splits of 7 tiles (448 tokens): the warps apart
    ("int4/int4", 8, 2304, "four_warps"),  # the short job's rows in splits of 2 tiles: tokens as M on 4 warps, 144 CTAs
    ("int2/int4", 16, 4096, "apart_short"),  # splits of 4 tiles (256 tokens): 2-bit content keeps the warps apart
    ("int2/int4", 8, 2304, "apart_short"),   # the short job's rows, 128-token units: the same
    ("int2/int4", 4, 26112, "default"),      # 448-token units: the warps apart, as for 4-bit content
    ("int4/int4", 16, 4096, "four_warps"),  # 256 tokens: two token blocks a warp (one at 8 x 2304 above)
    ("int4/int4", 9, 2304, "four_warps"),   # 128-token units, 162 CTAs: two token blocks a warp
    ("int4/int4", 4, 2304, "four_warps"),   # 128-token units, 72 CTAs: one token block a warp
])
def test_decode_graph_buckets_take_the_kernel_an_eager_call_would(monkeypatch, name, b, max_len, want):
    """A decode graph bucket's plan and its combine shape (``graph_combine``, which eager rows in mixed steps launch
    the combine kernel in) use the API's config for the units the bucket cuts a max_len row into
    (``config_for_units``), so FP8 over short units replays the built tile, and 4-bit content codes over units shorter
    than TM_WS_MIN_TOKENS the tokens-as-M kernel's 4-warp plan, as an eager call of b rows of max_len reads them; a
    backend's own ``decode_config`` is kept. want: "built", "four_warps", "default" (the API's default config), or
    "apart_short": 2-bit content codes on the default (the warps apart) over units shorter than TM_WS_MIN_TOKENS,
    where the same bucket of INT4/INT4 takes the 4-warp plan."""
    import types

    from quantmla.kernels import api, schedule
    from quantmla.serving.triton_backend import StaticDecodePlan, TritonPagedBackend, bucket_splits, decode_tiling

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(schedule, "num_sms_of", lambda device: 132)
    lay = PageLayout(TokenLayout(512, 64, preset(name)), 64)
    real_cuda_config = schedule.cuda_config
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        four_bit = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)  # the 2-bit cases' comparison
        defaults = {x: schedule.default_config(16, x, "cuda") for x in (lay, four_bit)}
        default = defaults[lay]
        on_cuda = lambda rows, layout, device, **kw: real_cuda_config(rows, layout, "cuda", **kw)  # noqa: E731
        monkeypatch.setattr(schedule, "cuda_config", on_cuda)
        for mod in (api, schedule):  # the CUDA device's default, on the CPU
            monkeypatch.setattr(mod, "default_config", lambda rows, layout, device: defaults[layout])
        backend = types.SimpleNamespace(spec=types.SimpleNamespace(num_heads=16), device=torch.device("cpu"),
                                        kinds={"k": lay}, decode_config=None, _graph_combine={})
        cfg = decode_tiling(backend, lay, b, max_len)
        plan = StaticDecodePlan(backend, b, max_len)
        combine = TritonPagedBackend.graph_combine(backend, (b,), max_len)["k"]
        eager = schedule.get_mla_metadata(torch.full((b,), max_len, dtype=torch.int32), 16, 1, lay, num_sms=132)
        other = real_cuda_config(16, lay, "cuda", tokens_m=want == "built")  # the kernel the rule does not pick
        four_eager = schedule.get_mla_metadata(torch.full((b,), max_len, dtype=torch.int32), 16, 1, four_bit,
                                               num_sms=132)
        four = decode_tiling(types.SimpleNamespace(spec=backend.spec, device=backend.device, decode_config=None),
                             four_bit, b, max_len)
        backend.decode_config = lambda rows, layout, device: default
        kept = decode_tiling(backend, lay, b, max_len)
    apart = want in ("default", "apart_short")  # the default config: the warps apart for integer codes
    assert default.tokens_m and cfg.kernel == "cuda" and (cfg == default) == apart
    assert cfg.tokens_m == (want != "built")
    if name != "fp8":  # the warps apart by default, on 4 warps exactly where the bucket's units are short
        assert default.specialized and cfg.specialized == apart
        # 4-bit content: the warps apart from TM_WS_MIN_TOKENS on; 2-bit: at any length
        assert (eager.chunk_tokens >= cuda.TM_WS_MIN_TOKENS) == (want == "default"), eager.chunk_tokens
        assert cuda.tokens_m_ws_min_tokens(lay) == (0 if name == "int2/int4" else cuda.TM_WS_MIN_TOKENS)
        if name == "int2/int4":  # the same bucket of 4-bit content: 4 warps exactly where the units are short
            assert four == four_eager.config and defaults[four_bit].specialized
            assert (four_eager.chunk_tokens < cuda.TM_WS_MIN_TOKENS) == (want == "apart_short")
            assert cfg.specialized and cfg.num_warps == 8
            assert four.specialized == (want == "default") and four.num_warps == (8 if four.specialized else 4)
        # one token block a warp where the bucket's units are shorter than 256 tokens and fit one CTA an SM
        # (8 x 2304: 18 splits a row, 144 CTAs; 4 x 2304: 72)
        two = name == "int4/int4" and b in (8, 9, 16)
        assert cfg.token_blocks == (2 if two else 1), (b, max_len, plan.split["k"])
    assert plan.md["k"].config == cfg == eager.config  # the graph replays what an eager call of those rows reads
    assert combine == plan.md["k"].combine == api.combine_shape(b, 16, 512, plan.split["k"][0], 132)
    if (b, max_len) == (7, 12288):  # the other kernel's splits give another shape: graph_combine follows the bucket's
        assert api.combine_shape(b, 16, 512, bucket_splits(other, 16, b, max_len, 132)[0], 132) != combine
    assert kept == default  # a backend's decode_config is the one that runs


def test_failed_tokens_m_build_falls_back_to_the_built_tile():
    """Where the default's tokens-as-M build fails, the config is the built tile's (and the failure is kept);
    asked for the tokens-as-M kernel alone, there is no config."""
    from quantmla.errors import QuantMLAError
    from quantmla.kernels.schedule import cuda_config

    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)

    def prepare(plan, device):
        if dict(plan.macros).get("TM"):
            raise QuantMLAError("nvcc failed to build the CUDA decode kernel (test)")

    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare", prepare):
        cfg, only = cuda_config(16, lay, "cuda"), cuda_config(16, lay, "cuda", tokens_m=True)
    assert cfg.kernel == "cuda" and not cfg.tokens_m and cfg.block_n == cuda.BLOCK_N
    assert only is None and "nvcc failed" in cuda.plan_reason[lay]


def test_scale_vote_through_the_configs(monkeypatch):
    """scale_vote reaches the plan from default_config and cuda_config, the config carries it (its name with a "v");
    config_for_units keeps it on the 4-warp plan of short units; with the scores on 8-bit MMAs it is refused with the
    reason."""
    from quantmla.kernels import schedule

    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    monkeypatch.setattr(schedule, "interpreting", lambda: False)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        plain, vote = (schedule.default_config(16, lay, "cuda", scale_vote=v) for v in (False, True))
        short = schedule.config_for_units(vote, 16, lay, "cuda", unit_tokens=128)
        plain_short = schedule.config_for_units(plain, 16, lay, "cuda", unit_tokens=128)
        assert cuda.decode_plan(lay, 16, torch.bfloat16, CUDA, tokens_m=True, specialized=True, s8_scores=True,
                                scale_vote=True) is None
        assert "8-bit warpgroup MMAs with the scale vote" in cuda.plan_reason[lay]
    assert vote.scale_vote and not plain.scale_vote and vote.specialized and vote.tokens_m
    assert vote.describe() == plain.describe().replace("cuda/tm/ws", "cuda/tm/wsv", 1)
    assert short.scale_vote and not short.specialized and not plain_short.scale_vote
    assert short.describe() == plain_short.describe().replace("cuda/tm", "cuda/tm" + "v", 1)


def log2_p_scale_max() -> float:
    """LOG2_P_SCALE_MAX as softmax_tm.cuh defines it (``constexpr float LOG2_P_SCALE_MAX = <x>f;``)."""
    text = build.SOURCE_TM.with_name("softmax_tm.cuh").read_text()
    found = re.findall(r"constexpr\s+float\s+LOG2_P_SCALE_MAX\s*=\s*([0-9.eE+-]+)f?\s*;", text)
    assert len(found) == 1, found
    return float(found[0])


def test_the_scale_votes_bound_keeps_p_scale_a_finite_fp16():
    """The SCALE_VOTE build caps a token's P at 2^min(8, max(0, LOG2_P_SCALE_MAX - log2 s)), s its largest content
    scale (softmax_tm.cuh, p_limits), so P·scale, an fp16 operand, is at most max(2^LOG2_P_SCALE_MAX, s). It stays a
    finite fp16 for every scale up to TM_VOTE_MAX_CONTENT_SCALE (fp16's 65504, all that fp16 metadata stores) where
    2^LOG2_P_SCALE_MAX < 65504: a header constant of 16.0 or more fails here. The default build caps P at 2^8 and
    reads scales up to TM_MAX_CONTENT_SCALE = 65504 / 2^8 exactly, so 2^LOG2_P_SCALE_MAX < 2^8 · TM_MAX_CONTENT_SCALE
    (not >=): the vote keeps P's full 2^8 up to 2^(LOG2_P_SCALE_MAX - 8), under TM_MAX_CONTENT_SCALE by less than
    1 % (254.2 at 15.99), and a little less above."""
    log2_max = log2_p_scale_max()
    fp16_max = torch.finfo(torch.float16).max
    assert cuda.TM_VOTE_MAX_CONTENT_SCALE == fp16_max and cuda.TM_MAX_CONTENT_SCALE * 2**8 == fp16_max
    assert 2**log2_max < fp16_max  # P·scale <= 2^LOG2_P_SCALE_MAX stays finite, fp16 rounding included
    assert torch.tensor(2**log2_max).half().isfinite()
    assert 0.99 * cuda.TM_MAX_CONTENT_SCALE < 2 ** (log2_max - 8) < cuda.TM_MAX_CONTENT_SCALE


def test_the_launch_asks_for_the_configs_scale_vote(monkeypatch):
    """launch_cuda asks decode_plan for the build its config names, SCALE_VOTE included (no plan here: it warns and
    leaves the call to Triton)."""
    from quantmla.kernels import launch
    from quantmla.kernels.schedule import DecodeConfig

    asked = {}
    monkeypatch.setattr(cuda, "decode_plan", lambda *a, **kw: asked.update(kw))
    monkeypatch.setattr(cuda, "mode", lambda: "auto")
    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    args = [None] * 16
    args[2], args[8], args[15] = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16), 16
    for vote in (True, False):
        cfg = DecodeConfig(kernel="cuda", tokens_m=True, specialized=True, scale_vote=vote)
        with pytest.warns(UserWarning, match="the Triton kernel runs instead"):
            assert launch.launch_cuda((1, 1), args, lay, cfg) is None
        assert asked["scale_vote"] is vote and asked["tokens_m"] and asked["specialized"]


def test_the_launch_refuses_a_plan_of_other_key_tiles(monkeypatch):
    """A caller's tokens-as-M config with 32-token tiles: its units start on 32-token tiles, which the 64-token
    kernel's page copies cannot start from, so the launch leaves the call to Triton with a warning saying why (and
    raises where QUANTMLA_DECODE_KERNEL=cuda asks for the CUDA kernel only); with the kernel's own tiles it launches."""
    import dataclasses
    import types

    from quantmla.kernels import launch, schedule

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    launched = []
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"), \
            mock.patch.object(cuda, "launch_decode", lambda plan, grid, args, device: launched.append(plan)):
        base = schedule.cuda_config(16, lay, "cuda")
        args = [None] * 18
        args[2], args[8], args[15] = types.SimpleNamespace(device=torch.device("cuda")), torch.zeros(1).bfloat16(), 16
        assert base.tokens_m and launch.launch_cuda((1, 4), tuple(args), lay, base) is not None and launched
        ours = dataclasses.replace(base, block_n=32)
        monkeypatch.setattr(cuda, "mode", lambda: "auto")
        with pytest.warns(UserWarning, match="its key tile is 64 tokens, the schedule's 32"):
            assert launch.launch_cuda((1, 4), tuple(args), lay, ours) is None
        monkeypatch.setattr(cuda, "mode", lambda: "cuda")
        with pytest.raises(UnsupportedFormatError, match="its key tile is 64 tokens"):
            launch.launch_cuda((1, 4), tuple(args), lay, ours)
    assert len(launched) == 1


@pytest.mark.parametrize("own", ["wide_latents", "function", "function_marked"])
def test_the_engines_wide_configs_follow_the_units_rules(monkeypatch, own):
    """The engine's WideLatentsConfig, whose class declares ``follows_units``, is where the unit-length rules start, in
    a graph bucket (decode_tiling) and in an eager call (the backend's get_mla_metadata, with follow_units): INT4/INT4
    over the short job's 128-token units takes the 4-warp plan with SCALE_VOTE. A plain function's config is kept as
    given, one with a ``follows_units`` attribute set on it included (only a class declares it)."""
    import types

    from quantmla.kernels import schedule
    from quantmla.serving.backends import AttnMeta
    from quantmla.serving.latent_range import WideLatentsConfig
    from quantmla.serving.triton_backend import TritonPagedBackend, decode_tiling, follows_units

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(schedule, "num_sms_of", lambda device: 132)
    lay = PageLayout(TokenLayout(512, 64, preset("int4/int4")), 64)
    real_cuda_config, real_default_config = schedule.cuda_config, schedule.default_config
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch.object(build, "nvcc", return_value="/usr/bin/nvcc"), mock.patch.object(cuda, "prepare"):
        vote = schedule.default_config(16, lay, "cuda", scale_vote=True)
        monkeypatch.setattr(schedule, "cuda_config",
                            lambda rows, layout, device, **kw: real_cuda_config(rows, layout, "cuda", **kw))
        monkeypatch.setattr(schedule, "default_config",  # the CUDA device's configs, on the CPU
                            lambda rows, layout, device, **kw: real_default_config(rows, layout, "cuda", **kw))
        if own == "wide_latents":
            config = WideLatentsConfig(frozenset({lay}), frozenset({lay}))
        else:
            config = lambda rows, layout, device: vote
            if own == "function_marked":
                config.follows_units = True
        follows = own == "wide_latents"
        assert follows_units(config) == follows and config(16, lay, torch.device("cpu")) == vote
        backend = types.SimpleNamespace(spec=types.SimpleNamespace(num_heads=16), device=torch.device("cpu"),
                                        decode_config=config, kind_of={0: "k"}, kinds={"k": lay})
        graph = decode_tiling(backend, lay, 8, 2304)
        meta = AttnMeta(slot_mapping=torch.zeros(8, dtype=torch.int64), num_decode=8,
                        seq_lens=torch.full((8,), 2304, dtype=torch.int32))
        eager = TritonPagedBackend._metadata(backend, 0, meta)
    assert vote.specialized and vote.scale_vote
    for cfg in (graph, eager.config):
        assert cfg.scale_vote and cfg.tokens_m and cfg.specialized != follows, cfg.describe()
    assert (graph == vote) != follows and (eager.config == vote) != follows
