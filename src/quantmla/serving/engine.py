"""``Engine``: offline continuous-batching generation of an MLA checkpoint on the low-bit paged cache.

The model stays the model: embeddings, norms, MLPs/MoE, the LM head and the RoPE tables run as its
own modules (on CUDA the RMSNorm modules' arithmetic runs as one kernel a call: ``serving/norms.py``).
Only each MLA attention module's ``forward`` is replaced (while a step runs) by one
that projects through :class:`~quantmla.model.view.MLAView`, writes the step's (latent, RoPE key)
into its paged pool — quantized — and attends over the pool through the attention backend (decode
rows absorbed, prefill chunks as the backend chooses; both return per-head values), then applies the
module's own ``o_proj``. A step runs the model once over the flat batch of all scheduled tokens
(``[1, N]`` with per-token positions): decode tokens first, then prefill chunks. Pure decode steps
replay CUDA graphs captured per batch-size bucket when the backend allows, each launched before the previous
step's tokens reach the host (:mod:`quantmla.serving.overlap`); first prompt chunks of up to
``prefill_graph_max`` tokens replay graphs captured per token bucket (``prefill_buckets``), longer ones and a
prompt's later chunks run eagerly (the graphs live in :mod:`quantmla.serving.graphs`). A probe that finds the
model's step synchronizing with the host keeps steps eager (the engine says why). ``Engine.observers`` takes :class:`EngineObserver` objects,
told of every step and graph capture with host timings (how the benchmarks time and profile it).

>>> engine = Engine(model, EngineConfig(quant=QuantCacheConfig.of_bits(4, 4), kv_budget_bytes=2 << 30))
>>> outs = engine.generate([Request(0, prompt_ids, SamplingParams(max_new_tokens=256))])
"""

from __future__ import annotations

import time
import warnings

import torch

from quantmla.cache.config import QuantCacheConfig, centre_rope_keys, reconcile
from quantmla.cache.layout import CacheFormat
from quantmla.errors import QuantMLAError
from quantmla.model.spec import load_spec, mla_modules
from quantmla.model.view import MLAView
from quantmla.quant.format import BF16
from quantmla.serving import fused_rope, latent_range, mlp, norms
from quantmla.serving.admission import as_requests, eos_ids, refusal
from quantmla.serving.backends import AttentionBackend, AttnMeta, TorchPagedBackend
from quantmla.serving.config import EngineConfig, JobStats
from quantmla.serving.eager_step import eager_inputs
from quantmla.serving.fused_rope import step_pieces
from quantmla.serving.graphs import (
    NONFINITE,
    DecodeGraphs,
    EngineObserver,
    PrefillGraphs,
    StepTiming,
    graph_buckets,
    greedy,
)
from quantmla.serving.merged import MergedLinears, merge_reason
from quantmla.serving.overlap import PendingStep, nonfinite_error, source_rows
from quantmla.serving.patching import patch, unpatch
from quantmla.serving.rope_stage import StageRows, page_grouped
from quantmla.serving.scheduler import (
    FINISHED,
    RequestOutput,
    SamplingParams,
    Scheduler,
    Sequence,
    StepPlan,
)
from quantmla.serving.triton_backend import TritonPagedBackend, triton_available

BF16_CONFIG = QuantCacheConfig(content=BF16, rope=BF16, method="bf16")


def make_backend(name: str, spec, formats, num_pages, page_size, device, dtype, decode_config=None,
                 stage_rows: int = 0, graph_units: str = "length") -> AttentionBackend:
    device = torch.device(device)
    if name == "torch":
        return TorchPagedBackend(spec, formats, num_pages, page_size, device, dtype, stage_rows)
    if name in ("triton", "auto"):
        ok, why = triton_available(device, spec, formats, page_size)
        if ok:
            return TritonPagedBackend(spec, formats, num_pages, page_size, device, dtype, decode_config=decode_config,
                                      stage_rows=stage_rows, graph_units=graph_units)
        if name == "triton":
            raise QuantMLAError(f"the Triton attention backend cannot run here: {why}")
        if device.type == "cuda":  # no CUDA graphs, a Python loop a decode row: slow enough to say so
            warnings.warn(f"the Triton attention backend cannot run here ({why}); the torch backend runs instead")
        backend = TorchPagedBackend(spec, formats, num_pages, page_size, device, dtype, stage_rows)
        backend.fallback_reason = why
        return backend
    raise QuantMLAError(f"unknown attention backend {name!r}; use auto, torch or triton")


class Engine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None):
        config = config or EngineConfig()
        config.check()
        self.model, self.config = model.eval(), config
        spec = load_spec(model)
        spec.require_latent_cache()
        if set(spec.mla_layers) != set(range(spec.num_cache_layers)):
            raise QuantMLAError(
                f"{spec.family}: cache slots {sorted(set(range(spec.num_cache_layers)) - set(spec.mla_layers))} are not MLA "
                "attention (hybrid models with linear-attention layers): the paged engine serves models whose every "
                "attention layer is MLA"
            )
        quant = config.quant or BF16_CONFIG
        stored = QuantCacheConfig.from_model_config(model.config)
        if stored is not None and quant.quantizes:  # a calibrated model: its formats, always with its RoPE offsets
            quant = reconcile(stored, quant)
        quant.check_model(spec)
        if quant.fp_window:
            raise QuantMLAError("the paged engine keeps no full-precision window: set fp_window=0 in the cache config")
        self.spec, self.quant = spec, quant
        self.formats: dict[int, CacheFormat] = {s: quant.format_for(s) for s in spec.mla_layers}
        if config.rope_pages:
            self.formats = {s: CacheFormat(f.content, page_grouped(f.rope, config.rope_block))
                            for s, f in self.formats.items()}
            for f in self.formats.values():
                f.rope.meta_block(config.page_size)  # a block that does not divide the page: a clear error now
        stage_rows = config.max_num_seqs + 1 if config.rope_pages else 0  # a row per sequence, and the null row
        self.stage = StageRows(stage_rows) if stage_rows else None
        self.stage_bytes = AttentionBackend.stage_bytes(spec, self.formats, config.page_size, stage_rows,
                                                        next(model.parameters()).dtype)
        # RoPE key offsets (calibrated checkpoints): subtracted on write, softmax-invariant on read
        self.rope_offsets: dict[int, torch.Tensor] = {}
        self.page_bytes = AttentionBackend.bytes_per_page(spec, self.formats, config.page_size)
        if config.num_pages is not None:
            pool_pages = config.num_pages
        elif config.kv_budget_bytes is not None:
            pool_pages = (int(config.kv_budget_bytes) - self.stage_bytes) // self.page_bytes
        else:
            raise QuantMLAError("give the engine a KV budget: EngineConfig(kv_budget_bytes=...) or num_pages=...")
        if pool_pages < 1:
            raise QuantMLAError(
                f"a KV budget of {config.kv_budget_bytes} bytes holds no page: one page of {config.page_size} tokens over "
                f"{len(self.formats)} layers takes {self.page_bytes} bytes in {quant.describe()}"
            )
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        for s_ in spec.mla_layers:
            c = quant.rope_offset(s_, spec.d_r)
            if c is not None:
                self.rope_offsets[s_] = c.to(self.device)
        self.pool_pages = pool_pages
        self.num_pages = pool_pages  # pages the scheduler may use (<= pool), see set_budget
        # content scales past the tokens-as-M kernel's default builds: those layouts decode on its SCALE_VOTE build
        layouts = AttentionBackend.page_layouts(spec, self.formats, config.page_size)
        wide = latent_range.wide_layers(mla_modules(model), layouts, spec.num_heads, spec.latent_scale)
        decode_config = config.decode_config
        if wide and decode_config is None:
            decode_config = latent_range.wide_latents_config(latent_range.by_layout(wide, layouts))
        self.backend = make_backend(config.backend, spec, self.formats, pool_pages, config.page_size, self.device, self.dtype,
                                    decode_config=decode_config, stage_rows=stage_rows,
                                    graph_units=config.graph_units)
        if wide and self.backend.name == "triton":
            warnings.warn(latent_range.wide_warning(wide, decode_config if config.decode_config is None else None))
        self._ctx: AttnMeta | None = None
        self._mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)  # 4D: transformers skips masking
        self._patched: dict[int, torch.nn.Module] = {}  # layer -> its MLA module, patched
        self._patch()
        self.norms = norms.attach(model, self, lambda: _ACTIVE[0]) if config.fused_norms else {}
        self.mlps = mlp.attach(model, self, lambda: _ACTIVE[0]) if config.merged_projections else {}
        # the RoPE kernel: on CUDA, and on the CPU where the Triton kernels run at all (interpreted)
        if not config.fused_rope:
            self.rope = "off (EngineConfig.fused_rope)"
        elif self.device.type != "cuda" and self.backend.name != "triton":
            self.rope = "not on a CUDA device"
        else:
            self.rope = fused_rope.probe(model, MLAView(next(iter(mla_modules(model).values())), spec)) or "fused"
        # slot -> (weight, eps) of a latent RMSNorm that runs in the RoPE kernel's launch (the same arithmetic)
        self.latent_norms = fused_rope.latent_norms(self._patched, spec, self) if self.rope == "fused" else {}
        self.eos = self._eos_ids()
        width_tokens = min(config.max_model_len or pool_pages * config.page_size, pool_pages * config.page_size,
                           spec.max_positions or pool_pages * config.page_size)  # no wider than the model's context
        self.max_pages_per_seq = -(-width_tokens // config.page_size)
        self._graphs: DecodeGraphs | None = None
        self._prefill: PrefillGraphs | None = None
        self.graph_error: str | None = None
        self.prefill_graph_error: str | None = None
        self.emulate_graphs = config.cuda_graphs == "emulate"
        self.use_graphs = not config.keep_logits and (
            self.emulate_graphs or (bool(config.cuda_graphs) and self.device.type == "cuda" and self.backend.graph_safe))
        self.use_prefill_graphs = self.use_graphs and config.prefill_graphs
        self.stats = JobStats()
        # the public hook: EngineObserver objects told of every step and graph capture, with host timings
        self.observers: list[EngineObserver] = []
        self._t_launch = 0.0  # when the running step last launched GPU work (a forward returned, a graph replayed)
        self._t_resolved = 0.0  # when the tokens of a step launched ahead were last read back

    # -- construction helpers --------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig | None = None, dtype: torch.dtype = torch.bfloat16,
                        device: str = "cuda"):
        """Load a checkpoint directory (config.json + safetensors) and serve it. Without an explicit
        ``config.quant`` the checkpoint's own ``quantization_config`` is used, else BF16."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from quantmla.checks import check_device, check_weight_files

        check_device(device, "device")
        check_weight_files(path)
        config = config or EngineConfig()
        if config.quant is None:  # the checkpoint's formats are read (and checked) before any weight
            q = QuantCacheConfig.from_model_config(AutoConfig.from_pretrained(path))
            if q is not None:
                config = EngineConfig(**{**config.__dict__, "quant": q})
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device)
        return cls(model, config)

    def _eos_ids(self) -> set[int]:
        ids = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if ids is None:
            ids = getattr(self.model.config, "eos_token_id", None)
        if ids is None:
            return set()
        return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}

    def set_budget(self, kv_budget_bytes: int | None = None, num_pages: int | None = None) -> int:
        """Use fewer pages of the pool (a smaller KV budget, the RoPE stage included) for the next jobs; returns
        the page count."""
        pages = num_pages if num_pages is not None else (kv_budget_bytes - self.stage_bytes) // self.page_bytes
        if pages > self.pool_pages:
            raise QuantMLAError(f"budget of {pages} pages exceeds the pool's {self.pool_pages}; build a larger engine")
        if pages < 1:
            raise QuantMLAError(f"a KV budget of {kv_budget_bytes} bytes holds no page ({self.page_bytes} bytes a page)")
        self.num_pages = pages
        return pages

    @property
    def bytes_per_token(self) -> float:
        return self.page_bytes / self.config.page_size

    # -- attention patch -------------------------------------------------------------------------
    def _patch(self) -> None:
        why_not = []
        for slot, module in mla_modules(self.model).items():
            view = MLAView(module, self.spec)
            reg = patch(module, _KEY, _dispatch_forward, self, (self, slot, view), merged=None)
            if self.config.merged_projections and reg["merged"] is None:
                pair = [view.q_in_proj, module.kv_a_proj_with_mqa]  # one GEMM of the hidden states
                why = merge_reason(pair)
                if why is None:
                    reg["merged"] = MergedLinears(pair, lambda v=view: [v.q_in_proj, v.m.kv_a_proj_with_mqa])
                else:
                    why_not.append(why)
            self._patched[slot] = module
        self.projections = ("off (EngineConfig.merged_projections)" if not self.config.merged_projections
                            else why_not[0] if why_not else "merged")
        self._weights_seen = self._weights()

    def _weights(self) -> tuple:
        """Every parameter's identity and storage, as the graphs were captured over them."""
        return tuple((id(p), p.data_ptr()) for p in self.model.parameters())

    def _drop_stale_graphs(self) -> None:
        """Forget the graphs where a module or a weight was replaced since they were captured (``attn.q_proj =
        ...``, ``weight.data = ...``; between jobs): the next job captures them anew rather than replaying reads of
        the old storage. In-place updates keep the storage and the graphs."""
        if self._weights() != self._weights_seen:
            self._graphs = self._prefill = None
            self._weights_seen = self._weights()

    def close(self) -> None:
        """Unregister from the model; the last engine gives the modules their own forwards (and weights) back."""
        for module in self._patched.values():
            unpatch(module, _KEY, self, on_last=_release_merged)
        self._patched.clear()
        norms.detach(self.model, self)
        mlp.detach(self.model, self)
        self._graphs = self._prefill = None  # frees the graphs now: they hold references back to the engine

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- one model step --------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttnMeta, keep) -> torch.Tensor:
        if not self._patched:
            raise QuantMLAError("this engine was closed")
        self._ctx, _ACTIVE[0] = meta, self
        try:
            out = self.model(input_ids=ids[None], position_ids=pos[None], attention_mask=self._mask, use_cache=False,
                             logits_to_keep=keep)
        finally:
            self._ctx, _ACTIVE[0] = None, None
        self._t_launch = time.perf_counter()
        return out.logits[0]

    def _execute(self, plan: StepPlan) -> tuple[list[int | None], list | None]:
        """Run one scheduled step; returns the sampled token (or None) per plan item."""
        items = plan.items
        dec = [k for k, it in enumerate(items) if it.n == 1]
        pre = [k for k, it in enumerate(items) if it.n > 1]
        if self.use_graphs and not pre and len(dec) <= self._graph_max():
            toks = self._graphs_run([items[k] for k in dec])
            if toks is not None:
                self.stats.graph_steps += 1
                out: list[int | None] = [None] * len(items)
                for j, k in enumerate(dec):
                    out[k] = toks[j] if items[k].sample else None
                return out, None
        apart = bool(dec) and self.use_graphs and sum(items[k].n for k in pre) <= self.config.mixed_decode_graphs
        if pre and (self.use_prefill_graphs or apart) and len(dec) <= self._graph_max():
            got = self._prefill_graphs_step(items, dec, pre, apart)
            if got is not None:
                return got, None
        self.stats.eager_steps += 1
        return self._eager(items)

    def _eager(self, items) -> tuple[list[int | None], list | None]:
        """Run items (decode rows and prefill chunks, any mix) as one eager model forward."""
        x = eager_inputs(items, self.config.page_size, self.device, self.stage)
        x.meta.graph_buckets = graph_buckets(self, x.meta.num_decode)
        logits = self._forward(x.ids, x.pos, x.meta, torch.tensor(x.rows, dtype=torch.long, device=self.device))
        toks = greedy(logits).tolist()
        out = [toks[x.row_of[k]] if k in x.row_of else None for k in range(len(items))]
        kept = None
        if self.config.keep_logits:
            lg = logits.float().cpu()
            kept = [lg[x.row_of[k]] if k in x.row_of else None for k in range(len(items))]
        return out, kept

    # -- CUDA graphs for decode ------------------------------------------------------------------
    def _graph_max(self) -> int:
        return min(self.config.max_num_seqs, max(self.config.graph_buckets))

    def capture_graphs(self) -> None:
        """Capture decode graphs for every bucket up to max_num_seqs now (else lazily on first use)."""
        if not self.use_graphs:
            return
        if self._graphs is None:
            self._graphs = DecodeGraphs(self)
        with torch.inference_mode():
            for b in sorted(self._graphs.buckets, reverse=True):
                if self._graphs.get(b) is None:
                    break
            if self.use_prefill_graphs:
                if self._prefill is None:
                    self._prefill = PrefillGraphs(self)
                for n in sorted(self._prefill.buckets, reverse=True):
                    if self._prefill.get(n) is None:
                        break

    def decode_graph(self, rows: int) -> tuple[int, torch.cuda.CUDAGraph | None]:
        """(bucket, graph): the batch-size bucket a pure decode step of ``rows`` sequences pads to, and the
        CUDA graph it replays (None while not captured, or when graphs are emulated or off)."""
        if self._graphs is None:
            self._graphs = DecodeGraphs(self)
        bucket = next((b for b in self._graphs.buckets if b >= rows), None)
        if bucket is None:
            raise QuantMLAError(f"a decode step of {rows} rows has no graph bucket: at most {self._graph_max()} rows "
                                "(EngineConfig.max_num_seqs, graph_buckets)")
        return bucket, (self._graphs.graphs.get(bucket) or (None,))[0]

    @property
    def graph_count(self) -> int:
        """Decode and prefill graph buckets this engine holds (captured, or prepared when emulated); none once a
        module or weight was replaced (they are captured again in the next job)."""
        self._drop_stale_graphs()
        return sum(len(h.graphs) for h in (self._graphs, self._prefill) if h is not None)

    def _decode_graphs(self) -> DecodeGraphs:
        if self._graphs is None:
            self._graphs = DecodeGraphs(self)
        return self._graphs

    def _graphs_run(self, items) -> list[int]:
        return self._decode_graphs().run(items)

    def _prefill_graphs_step(self, items, dec: list[int], pre: list[int], apart: bool = False) -> list[int | None] | None:
        """A step with prefill chunks that start a prompt and fit the largest prefill graph (start 0, at most
        ``PrefillGraphs.max_tokens``): each such chunk through a prefill graph, decode rows through the decode
        graphs, the other chunks (a prompt's later part, cut by the token budget, or a first chunk longer than the
        largest graph) in one eager forward. The sequences are independent, so this is the flat eager step split in
        parts. None (no chunk fits a graph, and not ``apart``: the decode rows through their graphs beside eager
        chunks, ``EngineConfig.mixed_decode_graphs``): the whole step runs eagerly, decode rows included."""
        whole = []
        if self.use_prefill_graphs:
            if self._prefill is None:
                self._prefill = PrefillGraphs(self)
            whole = [k for k in pre if items[k].start == 0 and items[k].n <= self._prefill.max_tokens]
        if not (whole or apart) or (dec and not self.use_graphs):
            return None
        rest = [k for k in pre if k not in set(whole)]
        # A capture failure returns None midway; the eager step that follows recomputes every part of
        # this step, rewriting the same slots (a step's writes depend only on its own tokens).
        out: list[int | None] = [None] * len(items)
        launch = None
        if dec:  # queued first: the GPU replays the decode rows while the host launches the rest
            launch = self._decode_graphs().launch([items[k] for k in dec])
            if launch is None:
                return None
        if rest:
            toks, _ = self._eager([items[k] for k in rest])
            for j, k in enumerate(rest):
                out[k] = toks[j]
            self.stats.eager_chunks += len(rest)
        for k in whole:
            tok = self._prefill.run(items[k])
            if tok is None:
                return None
            out[k] = tok if items[k].sample else None
        if launch is not None:
            toks = self._graphs.tokens(launch)
            for j, k in enumerate(dec):
                out[k] = toks[j] if items[k].sample else None
        if whole:
            self.stats.prefill_graph_steps += 1
        else:
            self.stats.mixed_graph_steps += 1
        return out

    # -- overlapped decode steps (serving/overlap.py) ---------------------------------------------
    def _overlaps(self, plan: StepPlan) -> bool:
        """Whether ``plan`` may be launched before the tokens in flight reach the host."""
        return (self.config.overlap_steps and self.use_graphs and self.stage is None and plan.is_decode
                and len(plan.items) <= self._graph_max())

    def _resolve(self, sched: Scheduler, pending: PendingStep, on_step, total: int) -> None:
        """Read back the tokens of a step launched ahead and commit them (Scheduler.resolve)."""
        toks = self._graphs.tokens(pending.launch)
        now = time.perf_counter()
        dt = now - max(pending.t0, self._t_resolved)  # overlapped: since the later of its start, the last read
        self._t_resolved = now
        self.stats.graph_decode_s += dt
        items = pending.plan.items
        errors = {k: nonfinite_error(it.seq, pending.index[k] - it.seq.prompt_len) for k, it in enumerate(items)
                  if pending.index[k] >= 0 and toks[k] == NONFINITE}
        sched.resolve(pending.plan, pending.index, toks, errors)
        if self.observers:
            timing = StepTiming(pending.plan, "graph_decode", pending.launch_s, dt)
            for o in self.observers:
                o.step_end(timing)
        if on_step is not None:
            on_step(len(sched.finished), total)

    # -- the job ---------------------------------------------------------------------------------
    def generate(self, requests, params: SamplingParams | None = None, on_step=None) -> list[RequestOutput]:
        """Run every request to completion; outputs come back in the order of ``requests``.

        ``requests``: Request objects, or token-id lists (with ``params`` for all of them). A request that can
        never fit in the KV budget returns ``finish_reason="error"`` with the reason; the others go on.
        ``on_step(finished, total)``: called after every step with the number of requests done (progress)."""
        reqs = as_requests(requests, params)
        cfg = self.config
        sched = Scheduler(self.num_pages, cfg.page_size, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.watermark)
        seqs = [Sequence(r, i, eos_ids(r, self.eos)) for i, r in enumerate(reqs)]
        limits = dict(vocab=getattr(self.model.config, "vocab_size", None), max_positions=self.spec.max_positions,
                      width=self.max_pages_per_seq * cfg.page_size, capacity=self.num_pages * cfg.page_size)
        for s in seqs:
            why = refusal(s.req, **limits)
            if why is not None:  # fails alone, before any token of it reaches the model
                sched._fail(s, QuantMLAError(why))
            else:
                sched.add(s)  # fails it if it can never fit in the KV budget
        self.stats = JobStats(requests=len(reqs))
        self._drop_stale_graphs()
        if self.stage is not None:
            self.stage.update([])  # sequence indices are the job's: no row stays with an earlier job's
        t0 = time.perf_counter()
        pending: PendingStep | None = None  # a decode step launched ahead, its tokens not yet read (overlap.py)
        with torch.inference_mode():
            while sched.has_unfinished() or pending is not None:
                plan = sched.schedule() if sched.has_unfinished() else StepPlan([], [])
                if not plan.items and pending is None:
                    raise RuntimeError("scheduler produced an empty step with unfinished requests")  # invariant
                src = source_rows(plan, pending) if self._overlaps(plan) else None
                begun = src is not None
                if begun:
                    for o in self.observers:
                        o.step_begin(plan)
                    t1 = time.perf_counter()
                    got = self._decode_graphs().launch(plan.items, src)
                    if got is not None:
                        self.stats.graph_steps += 1
                        if pending is not None:
                            self._resolve(sched, pending, on_step, len(seqs))
                        pending = PendingStep(plan, sched.commit_ahead(plan), got, t1, self._t_launch - t1)
                        continue
                if pending is not None:  # this step needs the tokens in flight first
                    self._resolve(sched, pending, on_step, len(seqs))
                    pending = None
                    plan.items = [it for it in plan.items if it.seq.status != FINISHED]  # stopped on those tokens
                if not plan.items:
                    continue
                for o in self.observers if not begun else ():  # (begun: its graph could not be captured)
                    o.step_begin(plan)
                if self.stage is not None:
                    self.stage.update(sched.running)
                t1 = time.perf_counter()
                g0, p0, m0 = self.stats.graph_steps, self.stats.prefill_graph_steps, self.stats.mixed_graph_steps
                sampled, logits = self._execute(plan)  # returns after the sampled tokens reached the host
                dt = time.perf_counter() - t1
                kind = "graph_decode" if self.stats.graph_steps > g0 else \
                    "prefill_graph" if self.stats.prefill_graph_steps > p0 else \
                    "mixed_graph" if self.stats.mixed_graph_steps > m0 else "eager"
                if kind == "graph_decode":
                    self.stats.graph_decode_s += dt
                elif all(it.n == 1 for it in plan.items):
                    self.stats.eager_decode_steps += 1
                    self.stats.eager_decode_s += dt
                else:
                    self.stats.mixed_s += dt
                if self.observers:
                    timing = StepTiming(plan, kind, self._t_launch - t1, dt)
                    for o in self.observers:
                        o.step_end(timing)
                for k, it in enumerate(plan.items):
                    if it.sample and sampled[k] == NONFINITE:  # fails alone; its pages go back to the pool
                        sched.fail_running(it.seq, QuantMLAError(nonfinite_error(it.seq, it.seq.num_generated)))
                sched.commit(plan, sampled, logits)
                if on_step is not None:
                    on_step(len(sched.finished), len(seqs))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.stage is not None:
            self.stage.update([])
        st = self.stats
        st.wall_s = time.perf_counter() - t0
        st.scheduler = sched.stats
        outs = [s.output() for s in seqs]
        st.completed = sum(o.ok for o in outs)
        st.failed = len(outs) - st.completed
        st.output_tokens = sum(len(o.output_ids) for o in outs)
        return outs


def _dispatch_forward(module, *args, **kwargs):
    """An MLA module's forward while engines are attached: inside a step of one of them, attention on
    that engine's paged cache; otherwise the module's own forward."""
    reg = module.__dict__[_KEY]
    eng = _ACTIVE[0]
    entry = None if eng is None else reg["engines"].get(id(eng))
    if entry is None:
        return reg["orig"](*args, **kwargs)
    engine, slot, view = entry
    meta = engine._ctx
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    pe = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
    merged = reg["merged"] if engine.projections == "merged" else None
    q_nope, q_rope, latent, k_rope = step_pieces(view, hidden, pe, engine.rope == "fused", merged,
                                                 engine.latent_norms.get(slot))  # hidden [1, N, h]
    if view.spec.scaled_query_from:  # mistral4: the rotated queries times its per-position scale
        pos = kwargs.get("position_ids")
        if pos is None:
            raise QuantMLAError(f"{view.spec.family} scales its queries by position, but its attention module was "
                                "called without position_ids as a keyword; the engine needs them to apply the scale")
        q_nope, q_rope = view.scale_queries(pos[0], q_nope, q_rope)
    k_rope = centre_rope_keys(k_rope, engine.rope_offsets.get(slot))  # as the transformers cache does
    engine.backend.write(slot, latent, k_rope, meta.slot_mapping, meta.stage_rows)
    v = engine.backend.attend(slot, view, q_nope, q_rope, meta)  # [N, H, d_v]
    return view.project_out(v[None].to(hidden.dtype)), None


_ACTIVE: list = [None]  # the engine whose step is running (one at a time)
_KEY = "_quantmla_serving"  # the MLA modules' registry (serving/patching.py)


def _release_merged(reg: dict) -> None:
    if reg["merged"] is not None:
        reg["merged"].release()
