"""Layer-streamed calibration (the orchestrator): calibrate a model that never sits in memory whole.

DeepSeek-V3 / Kimi-K2 geometry (61 decoder layers, hundreds of GB) does not fit one GPU or the host.
Calibration does not need it to: the fused transforms preserve the full-precision function, so
each layer's transforms are fitted on that layer's *full-precision* inputs alone (docs/design.md §4).
This module therefore

1. reads the sharded safetensors checkpoint through ``model.safetensors.index.json``, one decoder
   layer at a time, into the family's own ``DecoderLayer`` (built on the meta device from the
   config, then given that layer's tensors: ``model.layers.{i}.*``);
2. runs the calibration tokens through that one layer (hidden states kept in memory, on the
   device, or in a file-backed mapping on disk), capturing what its MLA attention sees;
3. fits the layer's transforms (seed = base seed + cache slot), fuses them, and writes the layer's
   output shard atomically (temporary name, fsync, rename) followed by a done-marker;
4. frees the layer and moves on. At the end it writes ``model.safetensors.index.json`` and a
   ``config.json`` carrying ``quantization_config``.

Peak memory is about one layer of weights plus the activations ([N, S, hidden] twice, plus the
captured attention inputs of the current layer). :class:`StreamReport` records it per layer.

The next layer's inputs are produced by the layer's *original* weights, before fusing, so they are
exactly what an in-memory capture on the unmodified model sees: the streamed result equals the
in-memory ``calibrate`` result for the same seed.

Resuming: every output unit (the non-layer tensors, each decoder layer) has a marker
``.quantmla_stream/<unit>.json`` written only after its shard was renamed into place; a marker is
trusted only if its shard exists with the recorded size and tensor names (and sha256, if enabled).
A killed run leaves at most a ``*.tmp.<pid>`` file, which is never read. The hidden states entering
a layer are checkpointed (``checkpoint_every``), so a resumed run restarts from the newest
checkpoint at or before the first unfinished layer instead of from the embeddings.

Source checkpoints in block-FP8 (official DeepSeek-V3 / Kimi-K2 releases: ``weight`` in
float8_e4m3fn plus ``weight_scale_inv``) are dequantized on read; the output then stores those
weights in bfloat16 (and drops the scales), i.e. it is a BF16 checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.calibration.options import CalibrationOptions
from quantmla.calibration.outdir import swap_in
from quantmla.calibration.stream.activations import ActivationBuffer
from quantmla.calibration.stream.files import (
    INDEX_NAME, ShardEntry, atomic_write_json, read_safetensors_header, write_safetensors_streamed,
)
from quantmla.calibration.stream.fitters import FitFn, ProjectFitter, _transform_to, fuse_layer, make_fitter
from quantmla.calibration.stream.memory import WeightMeter, nbytes_of, peak_rss_bytes, reset_peak_rss, rss_bytes
from quantmla.calibration.stream.source import ShardedCheckpoint, Skeleton
from quantmla.calibration.stream.state import (
    EXTRA_UNIT, FORMAT_VERSION, LayerStats, RunState, StreamReport, _calib_digest, _layer_unit, _unit_file, choose_work_dir,
)
from quantmla.errors import QuantMLAError
from quantmla.transforms.fuse import FUSED_INTO

_NON_WEIGHT_FILES = re.compile(
    r"^(tokenizer.*|added_tokens\.json|special_tokens_map\.json|generation_config\.json|chat_template.*|vocab\..*|"
    r"merges\.txt|.*\.tiktoken|.*\.model|.*\.py|preprocessor_config\.json|README\.md|LICENSE.*)$"
)


class Streamer:
    """Shared machinery of the single-process and distributed streamed calibration."""

    def __init__(self, source, output, calib_ids: torch.Tensor, quant: QuantCacheConfig, *, method: str, seed: int,
                 batch_size: int, dtype, device, activations: str, checkpoint_every: int, fit_fn: FitFn | None,
                 fit_kwargs: dict | None, attn_implementation: str | None, checksum: bool, overwrite: bool,
                 prepare: bool = True, work_dir: str | None = None):
        if activations not in ("memory", "device", "disk"):
            raise QuantMLAError(f"activations must be 'memory', 'device' or 'disk', got {activations!r}")
        if calib_ids.dim() != 2:
            raise QuantMLAError(f"calibration ids must be [sequences, tokens] (equal lengths, no padding), got {tuple(calib_ids.shape)}")
        self.t0 = time.perf_counter()
        self.ckpt = ShardedCheckpoint(source)
        self.calib_ids = calib_ids.to(torch.long).cpu()
        self.quant, self.method, self.seed = quant, method, int(seed)
        self.batch_size = max(1, int(batch_size))
        self.device = torch.device(device)
        self.activations, self.checkpoint_every = activations, int(checkpoint_every)
        if isinstance(fit_kwargs, CalibrationOptions):
            fit_kwargs = fit_kwargs.to_dict()
            for k, mine in (("method", method), ("seed", int(seed))):
                theirs = fit_kwargs.pop(k)
                if theirs != mine:
                    raise QuantMLAError(f"fit_kwargs (CalibrationOptions) has {k}={theirs!r} but the streamed run's "
                                        f"{k} is {mine!r}: pass {k}= to calibrate_streamed, or the same value in both")
        self.fit_kwargs = dict(fit_kwargs or {})
        if fit_fn is None or (isinstance(fit_fn, type) and issubclass(fit_fn, ProjectFitter)):
            self.fit_kwargs.setdefault("batch_size", self.batch_size)  # calibrate's one batch_size
        self.checksum = checksum
        self.dtype = dtype = dtype or torch.float32
        self.meter = WeightMeter()
        self.skel = Skeleton(self.ckpt, dtype, self.device, attn_implementation, self.meter)
        self.spec = self.skel.spec
        vocab = getattr(self.skel.base.get_input_embeddings(), "num_embeddings", None)
        if vocab is not None and self.calib_ids.numel():
            lo, hi = int(self.calib_ids.min()), int(self.calib_ids.max())
            if lo < 0 or hi >= vocab:  # before anything is written to the output
                raise QuantMLAError(f"calibration token ids span {lo}..{hi}, outside the model's vocabulary "
                                    f"[0, {vocab}): tokenize the calibration text with this checkpoint's tokenizer")
        self.fitter = make_fitter(self.spec, tuple(self.calib_ids.shape), quant, method, self.seed, self.fit_kwargs, fit_fn)
        # decoder layers of the model class (longcat_flash: num_layers, each with two MLA blocks)
        self.L = self.ckpt.num_layers = len(self.skel.base.layers)
        self.final = os.path.abspath(os.fspath(output))
        self.manifest = {
            "format_version": FORMAT_VERSION,
            "source_index": self.ckpt.index_digest(),
            "source_weights": self.ckpt.weights_digest(),
            "calibration": _calib_digest(self.calib_ids),
            "quant": quant.to_dict(),
            "method": method,
            "seed": self.seed,
            "dtype": str(dtype).replace("torch.", ""),
            "batch_size": self.batch_size,
            "attn_implementation": attn_implementation or getattr(self.skel.config, "_attn_implementation", None),
            "fit_kwargs": json.loads(json.dumps(self.fit_kwargs, default=str)),
            "fitter": type(self.fitter).__name__ + (f"({getattr(fit_fn, '__name__', type(fit_fn).__name__)})" if fit_fn else ""),
        }
        if work_dir is None:
            work_dir = choose_work_dir(self.final, overwrite, self.manifest) if prepare else self.final
        self.state = RunState(work_dir)  # the final directory, or a staging one swapped in by finalize
        if prepare:
            self.state.prepare(self.manifest, overwrite)
        self.report = StreamReport(
            output=self.final, num_layers=self.L, tokens=int(self.calib_ids.numel()),
            model_bytes=sum(self.ckpt.nbytes(n) for n in self.ckpt.weight_map),
            max_layer_bytes=max((sum(self.ckpt.nbytes(n) for n in self.ckpt.layer_names(i)) for i in range(self.L)), default=0),
            start_rss_bytes=rss_bytes(),
        )
        self.fault: Callable[[str, int], None] | None = None
        self.show_progress = False  # progress bars inside a layer (its forward batches, its fit's steps)

    # -- units -----------------------------------------------------------------------------------
    def raw_units(self) -> dict[str, list[str]]:
        """Units copied unchanged: the non-layer tensors, and stored layers beyond num_hidden_layers
        (e.g. DeepSeek-V3's multi-token-prediction layer 61)."""
        units = {EXTRA_UNIT: list(self.ckpt.other)}
        for i in self.ckpt.layer_indices():
            if i >= self.L:
                units[_layer_unit(i)] = self.ckpt.layer_names(i)
        return units

    def _source_entries(self, names: Iterable[str], overrides: dict[str, torch.Tensor] | None = None) -> list[ShardEntry]:
        overrides = overrides or {}
        out = []
        for n in names:
            if self.ckpt.is_fp8_scale(n) and n[: -len("_scale_inv")] in overrides:
                continue
            if self.ckpt.is_fp8_scale(n):
                continue  # the weight is written dequantized
            dt = self.ckpt.output_dtype(n)
            shape = self.ckpt.meta(n)[1]
            if n in overrides:
                t = overrides[n]
                out.append(ShardEntry(n, dt, shape, lambda t=t, dt=dt: t.detach().to("cpu", dt)))
            elif self.ckpt.is_fp8_weight(n):
                out.append(ShardEntry(n, dt, shape, lambda n=n, dt=dt: self.ckpt.read(n).to(dt)))
            else:
                out.append(ShardEntry(n, dt, shape, lambda n=n: self.ckpt.read_raw(n)))
        return out

    def write_raw_units(self) -> None:
        for unit, names in self.raw_units().items():
            if self.state.is_done(unit, self.checksum) or not names:
                continue
            file = _unit_file(unit)
            write_safetensors_streamed(os.path.join(self.state.output, file), self._source_entries(names))
            self.state.mark_done(unit, file, self.checksum, {"raw": True})

    def write_layer(self, i: int, fused: dict[str, torch.Tensor], info: dict) -> dict:
        """Write decoder layer i: fused tensors (full names) from memory, the rest copied from the
        source tensor by tensor; then its done-marker."""
        names = self.ckpt.layer_names(i)
        unknown = sorted(set(fused) - set(names))
        if unknown:
            raise QuantMLAError(f"fused tensors not in the checkpoint's layer {i}: {unknown[:4]}")
        file = _unit_file(_layer_unit(i))
        fault = None
        if self.fault is not None:
            fault = lambda ev, k: self.fault(ev, i)  # noqa: E731
        write_safetensors_streamed(os.path.join(self.state.output, file), self._source_entries(names, fused), fault)
        if self.fault is not None:
            self.fault("shard_renamed", i)
        return self.state.mark_done(_layer_unit(i), file, self.checksum, info)

    def done_layers(self) -> set[int]:
        return {i for i in range(self.L) if self.state.is_done(_layer_unit(i), self.checksum)}

    # -- per-layer work --------------------------------------------------------------------------
    def new_buffer(self, k: int) -> ActivationBuffer:
        N, S = self.calib_ids.shape
        shape = (N, S, self.spec.hidden_size)
        path = os.path.join(self.state.acts, f"work-{k:05d}.{os.getpid()}.bin") if self.activations == "disk" else None
        return ActivationBuffer(shape, self.dtype, self.activations, self.device, path)

    def start(self, first_needed: int) -> tuple[int, ActivationBuffer]:
        """Hidden states entering the earliest layer we can restart from (<= first_needed)."""
        cps = [k for k in self.state.act_checkpoints() if k <= first_needed]
        if cps:
            k = max(cps)
            buf = ActivationBuffer.load(self.state.act_path(k), self.activations, self.device)
            self.report.resumed_from = k
            return k, buf
        buf = self.new_buffer(0)
        self.skel.embed(self.calib_ids, buf.t, self.batch_size)
        return 0, buf

    def load_layer(self, i: int) -> tuple[torch.nn.Module, int]:
        layer = self.skel.layer_module(i)
        n = self.skel.materialize(layer, self.ckpt.layer_key(i))
        return layer, n

    @torch.no_grad()
    def forward_layer(self, i: int, layer: torch.nn.Module, h_in: ActivationBuffer, h_out: ActivationBuffer | None,
                      capture: bool) -> dict[int, Any]:
        """Run all calibration batches through layer i (its original weights), writing its outputs
        into `h_out`. With `capture`, the fitter observes what each MLA module of the layer sees;
        returns slot -> captured data (the fitter's ``end``)."""
        N, S = self.calib_ids.shape
        mods = self.skel.mla_submodules(layer) if capture else {}
        states = {slot: self.fitter.begin(slot, m) for slot, (_, m) in mods.items()}
        cur = {"start": 0}

        def hook(slot):
            def pre(module, args, kwargs):
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                self.fitter.observe(states[slot], hidden, kwargs.get("position_embeddings"), cur["start"])

            return pre

        handles = [m.register_forward_pre_hook(hook(slot), with_kwargs=True) for slot, (_, m) in mods.items()]
        from tqdm.auto import tqdm

        try:
            for s in tqdm(range(0, N, self.batch_size), desc=f"layer {i}: forward", leave=False,
                          disable=not self.show_progress):
                cur["start"] = s
                x = h_in.t[s : s + self.batch_size].to(self.device, self.dtype)
                kw = self.skel.layer_kwargs(x.shape[0], S, i)
                y = layer(x, **kw)
                y = y[0] if isinstance(y, tuple) else y
                if h_out is not None:
                    h_out.t[s : s + self.batch_size] = y.to(h_out.t.device, h_out.dtype)
        finally:
            for h in handles:
                h.remove()
        return {slot: self.fitter.end(st) for slot, st in states.items()}

    def fit_modules(self, mods: dict[int, tuple[str, torch.nn.Module]], captured: dict[int, Any], layer_prefix: str,
                    fuse_target: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
        """Fit and fuse every MLA module of one layer; -> (full-name tensors the fusion changed, info). Every other
        tensor is copied from the source as it is stored there (not through the compute dtype and back)."""
        transforms, info = {}, {}
        for slot, (_, m) in mods.items():
            lt, info[str(slot)] = self.fitter.fit(slot, captured[slot], m)
            transforms[slot] = _transform_to(lt, m.kv_a_layernorm.weight.device)
        before = {(slot, k): v.detach().clone() for slot, (_, m) in mods.items() for k, v in m.state_dict().items()
                  if k.split(".", 1)[0] in FUSED_INTO}
        fuse_layer(fuse_target, self.spec, transforms)
        fused = {}
        for slot, (rel, m) in mods.items():
            for k, v in m.state_dict().items():
                if (slot, k) in before and not torch.equal(before[slot, k], v):
                    fused[f"{layer_prefix}{rel}.{k}" if rel else f"{layer_prefix}{k}"] = v
        return fused, info

    def finalize(self) -> None:
        """Index and config.json (with quantization_config) once every unit is done."""
        units = [u for u, names in self.raw_units().items() if names] + [_layer_unit(i) for i in range(self.L)]
        weight_map, total = {}, 0
        for u in units:
            if not self.state.is_done(u, self.checksum):
                raise QuantMLAError(f"cannot finalize {self.state.output}: {u} is not done")
            m = self.state.read_marker(u)
            hdr = read_safetensors_header(os.path.join(self.state.output, m["file"]))
            for name, h in hdr.items():
                weight_map[name] = m["file"]
                total += h["data_offsets"][1] - h["data_offsets"][0]
        atomic_write_json(os.path.join(self.state.output, INDEX_NAME),
                          {"metadata": {"total_size": total, "quantmla_streamed": True}, "weight_map": dict(sorted(weight_map.items()))})
        fitted, slots = {}, []  # the slots' RoPE key offsets (api.centre_rope_keys), from the layers' markers
        for i in range(self.L):
            for slot, inf in self.state.read_marker(_layer_unit(i)).get("fit", {}).items():
                slot = int(inf.get("slot", slot)) if isinstance(inf, dict) else int(slot)
                slots.append(slot)
                if isinstance(inf, dict) and inf.get("rope_offset") is not None:
                    fitted[slot] = inf["rope_offset"]
        from quantmla.calibration.api import slot_offsets

        centred = self.fitter.rope_centring(slots)
        offsets = slot_offsets(fitted, slots, centred)
        cfg = dict(self.ckpt.config_dict)
        cfg["quantization_config"] = dataclasses.replace(self.quant, method=self.method, rope_offsets=offsets).to_dict()
        if self.ckpt.has_fp8:
            for key in ("torch_dtype", "dtype"):
                if key in cfg:
                    cfg[key] = "bfloat16"
        atomic_write_json(os.path.join(self.state.output, "config.json"), cfg)
        for f in os.listdir(self.ckpt.path):
            src = os.path.join(self.ckpt.path, f)
            if os.path.isfile(src) and _NON_WEIGHT_FILES.match(f) and f != "config.json":
                dst = os.path.join(self.state.output, f)
                shutil.copyfile(src, dst + ".tmp")
                os.replace(dst + ".tmp", dst)
        self.state.drop_act_checkpoints(keep=-1)
        for f in os.listdir(self.state.output):  # partial files of killed runs (never read)
            if re.search(r"\.tmp\.\d+$", f):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.state.output, f))
        layers = []
        for i in range(self.L):
            for slot, inf in sorted(self.state.read_marker(_layer_unit(i)).get("fit", {}).items(), key=lambda kv: int(kv[0])):
                layers.append(inf if isinstance(inf, dict) and "slot" in inf else {"slot": int(slot), "transform": inf})
        report = {**self.fitter.report_header(), "layers": layers, "streamed": True}
        atomic_write_json(os.path.join(self.state.output, "calibration_report.json"), report)
        atomic_write_json(os.path.join(self.state.dir, "complete.json"), {"units": units, "total_size": total})
        if self.state.output != self.final:  # replacing an earlier checkpoint: swap the new one in whole
            swap_in(self.state.output, self.final)

    def stats(self, i: int, slots, nbytes: int, **kw) -> LayerStats:
        st = LayerStats(layer=i, slots=list(slots), weight_bytes=nbytes, rss_bytes=rss_bytes(),
                        peak_rss_bytes=peak_rss_bytes(), live_weight_peak_bytes=self.meter.peak, **kw)
        if self.device.type == "cuda":
            st.device_peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        return st

    def close_report(self) -> StreamReport:
        r = self.report
        r.peak_live_weight_bytes = self.meter.peak
        r.peak_rss_bytes = max(r.peak_rss_bytes, peak_rss_bytes())
        r.seconds = time.perf_counter() - self.t0
        return r


def calibrate_streamed(
    source,
    output,
    calib_ids: torch.Tensor,
    quant: QuantCacheConfig | None = None,
    *,
    method: str = "quantmla",
    seed: int = 0,
    batch_size: int = 4,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    activations: str = "memory",
    checkpoint_every: int = 1,
    fit_fn: FitFn | None = None,
    fit_kwargs: dict | None = None,
    attn_implementation: str | None = None,
    checksum: bool = False,
    overwrite: bool = False,
    progress: Callable[[LayerStats], None] | None = None,
    _fault: Callable[[str, int], None] | None = None,
) -> StreamReport:
    """Calibrate the checkpoint at `source` layer by layer into `output`; resumes a killed run.

    calib_ids: [N, S] token ids (equal lengths, no padding). quant: the cache formats the
    transforms are fitted for. method / seed / fit_kwargs: as for :func:`quantmla.calibration.calibrate`
    (fit_kwargs takes its keyword options: paths, steps, lr, queries_per_seq, ...); the result equals
    calibrate's on the same model, ids and seed. batch_size: sequences per forward (calibrate's
    batch_size, also its fit minibatch, for calibrate's fit and subclasses of its :class:`ProjectFitter`).
    fit_fn: a custom :class:`LayerFitter` (instance or class) or :data:`FitFn`. dtype: compute dtype
    (default float32, as ``quantmla calibrate``); weights are
    written in the checkpoint's own dtypes. device: where layers run.
    activations: where the [N, S, hidden] hidden states live — "memory" (CPU RAM), "device", or
    "disk" (file-backed, for calibration sets larger than RAM). checkpoint_every: save the hidden
    states entering every k-th layer for resuming (0: never; a resumed run then recomputes the
    full-precision forward from the embeddings, which gives the same result).
    Returns a :class:`StreamReport` with per-layer time and memory."""
    quant = quant or QuantCacheConfig()
    reset_peak_rss()  # peak RSS in the report is measured from here
    st = Streamer(source, output, calib_ids, quant, method=method, seed=seed, batch_size=batch_size, dtype=dtype,
                  device=device, activations=activations, checkpoint_every=checkpoint_every, fit_fn=fit_fn,
                  fit_kwargs=fit_kwargs, attn_implementation=attn_implementation, checksum=checksum, overwrite=overwrite)
    st.fault = _fault
    st.show_progress = st.fitter.show_progress = progress is not None  # bars inside each layer, then its stats line
    st.write_raw_units()
    done = st.done_layers()
    need = [i for i in range(st.L) if i not in done]
    st.report.skipped = sorted(done)
    if need:
        _stream_layers(st, need, owner=lambda i: 0, rank=0, send=None, progress=progress)
    st.finalize()
    return st.close_report()


def _stream_layers(st: Streamer, need: list[int], owner: Callable[[int], int], rank: int,
                   send: Callable[[int, dict], None] | None, progress) -> None:
    """The forward stream (run by rank 0): layers from the restart point through the last needed
    one; layers owned by this rank are fitted and written here, the others' captured inputs are
    handed to `send(layer, records)`."""
    first, last = min(need), max(need)
    k, h = st.start(first)
    needset = set(need)
    for i in range(k, last + 1):
        reset_peak_rss()  # peak_rss_bytes of each layer's stats: that layer's own peak
        t0 = time.perf_counter()
        layer, nbytes = st.load_layer(i)
        t1 = time.perf_counter()
        mods = st.skel.mla_submodules(layer)
        fit_here = i in needset and owner(i) == rank
        capture = i in needset and bool(mods)
        h_next = st.new_buffer(i + 1) if i < last else None
        captured = st.forward_layer(i, layer, h, h_next, capture)
        cap_bytes = nbytes_of(captured)
        t2 = time.perf_counter()
        fit_s = write_s = 0.0
        if i in needset and not fit_here:
            send(i, captured)
        if fit_here:
            fused, info = st.fit_modules(mods, captured, st.ckpt.layer_key(i), layer) if mods else ({}, {})
            t3 = time.perf_counter()
            st.write_layer(i, fused, {"fit": info, "slots": list(mods), "rank": rank})
            fit_s, write_s = t3 - t2, time.perf_counter() - t3
        del captured
        st.skel.release(layer, nbytes)
        stats = st.stats(i, mods, nbytes, load_s=t1 - t0, forward_s=t2 - t1, fit_s=fit_s, write_s=write_s,
                         activation_bytes=h.nbytes * (2 if h_next is not None else 1), rank=rank, fitted=fit_here,
                         captured_bytes=cap_bytes)
        st.report.layers.append(stats)
        st.report.peak_rss_bytes = max(st.report.peak_rss_bytes, stats.peak_rss_bytes)
        if progress is not None and i in needset:
            progress(stats)
        if h_next is not None:
            if st.checkpoint_every and (i + 1) % st.checkpoint_every == 0:
                h_next.save(st.state.act_path(i + 1), {"layer": i + 1})
                st.state.drop_act_checkpoints(keep=i + 1)
            old = h
            h = h_next
            if old.mode == "disk" and old.path and "work-" in os.path.basename(old.path):
                with contextlib.suppress(OSError):
                    os.remove(old.path)
            del old
