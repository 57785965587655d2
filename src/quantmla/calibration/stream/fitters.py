"""Per-layer fitting inside a streamed calibration: the :class:`LayerFitter` protocol, calibrate's
own fit made streamable (:class:`ProjectFitter`), custom fit functions (:class:`RecordsFitter`), and
fusing a layer's transforms."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.calibration.options import CalibrationOptions
from quantmla.calibration.stream.memory import to_device
from quantmla.errors import QuantMLAError
from quantmla.model.spec import MLASpec


class LayerFitter:
    """Per-layer fitting in the three steps streaming needs:

    ``begin(slot, module)``  -> capture state, before the layer's forward;
    ``observe(state, hidden, position_embeddings, start)`` for every calibration batch (called
        from a pre-hook on the MLA module; `start` is the batch's first sequence index);
    ``end(state)``           -> the captured data: CPU tensors, picklable (it is what a
        distributed run sends to the rank that fits the layer);
    ``fit(slot, data, module)`` -> (LayerTransform, json-able info), given the module's
        full-precision weights. Must be deterministic for (slot, data): seeds derive from
        ``seed`` and ``slot`` only, never from global RNG state left by other layers.
    """

    def __init__(self, spec: MLASpec, shape: tuple[int, int], quant: QuantCacheConfig, method: str, seed: int,
                 fit_kwargs: dict | None = None):
        self.spec, self.shape, self.quant, self.method, self.seed = spec, tuple(shape), quant, method, int(seed)
        self.fit_kwargs = dict(fit_kwargs or {})
        self.show_progress = False  # a progress bar over a layer's fit (set by the streamer)

    def begin(self, slot: int, module: torch.nn.Module) -> Any:
        raise NotImplementedError

    def observe(self, state: Any, hidden: torch.Tensor, position_embeddings, start: int) -> None:
        raise NotImplementedError

    def end(self, state: Any) -> Any:
        return state

    def fit(self, slot: int, data: Any, module: torch.nn.Module) -> tuple[Any, dict]:
        raise NotImplementedError

    def rope_centring(self, slots) -> bool:
        """Whether this fit centres the RoPE keys (api.rope_centring); stand-in fits do not."""
        return False

    def report_header(self) -> dict:
        return {"method": self.method, "seed": self.seed, "quant": dataclasses.replace(self.quant, method=self.method).to_dict(),
                "tokens": self.shape[0] * self.shape[1]}


# A fit function: (module, spec, records, quant, *, method, seed, **kw) -> LayerTransform, where
# records are capture_attention_inputs' records of that module ({"hidden": [B, S, hidden] (the
# module's input), "position_embeddings": ...}, one per batch).
FitFn = Callable[..., Any]


class RecordsFitter(LayerFitter):
    """Keeps the attention inputs themselves (CPU) and calls a :data:`FitFn` on them."""

    def __init__(self, fit_fn: FitFn, *a, **kw):
        super().__init__(*a, **kw)
        self.fit_fn = fit_fn

    def begin(self, slot, module):
        return []

    def observe(self, state, hidden, position_embeddings, start):
        pe = position_embeddings
        if isinstance(pe, tuple):
            pe = tuple(p.detach().cpu() for p in pe)
        elif torch.is_tensor(pe):
            pe = pe.detach().cpu()
        state.append({"hidden": hidden.detach().cpu(), "position_embeddings": pe})

    def fit(self, slot, data, module):
        seed = self.seed + slot
        torch.manual_seed(seed)
        lt = self.fit_fn(module, self.spec, data, self.quant, method=self.method, seed=seed, **self.fit_kwargs)
        return lt, (lt.summary() if hasattr(lt, "summary") else {})


def _transform_to(lt, device):
    """A LayerTransform with its tensors on `device` (where the module it is fused into lives)."""
    from quantmla.transforms import ContentTransform, LayerTransform, RopeTransform

    if lt is None or not hasattr(lt, "content"):
        return lt
    c = None if lt.content is None else ContentTransform(lt.content.rotation.to(device), lt.content.gamma.to(device))
    r = None if lt.rope is None else RopeTransform(lt.rope.z.to(device))
    return LayerTransform(c, r)


class ProjectFitter(LayerFitter):
    """Adapter that makes :func:`quantmla.calibration.calibrate`'s per-layer work streamable: the
    same sequence split (generator seeded `seed`), the same sampled query and key positions
    (``capture.plan_capture``), the same capture (a ``capture.LayerCapture`` fed each batch from the
    layer's own forward), and
    ``api.fit_layer`` — calibrate's own per-layer fit (generator ``seed·1000003 + slot``). Tests
    check the weights equal calibrate's.

    fit_kwargs: the fields of calibrate's :class:`CalibrationOptions` (a dict or an instance;
    method and seed are the streamer's). ``batch_size`` defaults to the streamer's (capture batches
    and fit minibatches, as in calibrate); ``device``: where the captured data lives and the fit runs
    (default CPU). ``timer``: None, or a function of a step's name giving a context manager that the
    step runs inside: "capture" (one batch's capture, inside the layer's forward and its capture time)
    and, through ``fit_layer``'s own ``timer``, "content" and "rope" (a path's fit); a subclass that
    times the steps sets it."""

    timer = None

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        from quantmla.calibration import api
        from quantmla.calibration import capture as cap

        given = {k: v for k, v in self.fit_kwargs.items() if k not in ("progress", "verbose")}
        for k, mine in (("method", self.method), ("seed", self.seed)):
            if k in given and given.pop(k) != mine:
                raise QuantMLAError(f"fit_kwargs {k}={self.fit_kwargs[k]!r} differs from the streamed run's {k}={mine!r}")
        self.o = o = CalibrationOptions.of(given, method=self.method, seed=self.seed).check()
        N, L = self.shape
        api.check_formats(self.spec, self.quant, o, L)
        self.store_device = torch.device(o.device or "cpu")
        g = torch.Generator().manual_seed(self.seed)
        self.fit_seqs, self.held_seqs = api.split_sequences(N, o.heldout_fraction, g)
        # the positions capture_calibration_data samples (same generator), and its budget check
        self.plan = cap.plan_capture(self.spec, (N, L), queries_per_seq=o.queries_per_seq,
                                     rope_keys_per_seq=o.rope_keys_per_seq, seed=self.seed)
        self.plan.check_budget(o.max_capture_bytes, "max_capture_bytes")
        self.capture_bytes = self.plan.layer_bytes
        self.capture_seconds: dict[int, float] = {}  # slot -> time spent capturing (inside the forward)

    def begin(self, slot, module):
        from quantmla.calibration.capture import LayerCapture

        return {"capture": LayerCapture(slot, module, self.spec, self.plan, self.store_device), "seconds": 0.0}

    def observe(self, state, hidden, position_embeddings, start):
        t0 = time.perf_counter()
        with self.timer("capture") if self.timer else contextlib.nullcontext():
            state["capture"].record(hidden, position_embeddings, start)
        state["seconds"] += time.perf_counter() - t0

    def end(self, state):
        data = state["capture"].finish()
        self.capture_seconds[data.slot] = state["seconds"]
        return data

    def fit(self, slot, d, module):
        import dataclasses as dc

        from quantmla.calibration.api import fit_layer

        o = self.o
        d = to_device(d, self.store_device)  # data received from another rank arrives on the CPU
        secs = {"capture": self.capture_seconds.pop(slot, None)}
        t = time.perf_counter()
        from tqdm.auto import tqdm

        quantmla = self.method == "quantmla"
        total = (o.steps if quantmla and "content" in o.paths else 0) + (1 if quantmla and "rope" in o.paths else 0)
        with tqdm(total=total, desc=f"slot {slot}: fit", leave=False, disable=not self.show_progress or not total) as pbar:
            lt, rep = fit_layer(d, self.quant.format_for(slot), self.fit_seqs, self.held_seqs, o, pbar=pbar,
                                timer=self.timer)
        secs["fit"] = time.perf_counter() - t
        info = json.loads(json.dumps(dc.asdict(rep), default=float))
        info["seconds"] = secs
        return lt, info

    def rope_centring(self, slots) -> bool:
        from quantmla.calibration.api import rope_centring

        return rope_centring(self.quant, slots, method=self.method, paths=self.o.paths, rope_center=self.o.rope_center)

    def report_header(self) -> dict:
        h = super().report_header()
        h.update(paths=list(self.o.paths), fit_sequences=len(self.fit_seqs), heldout_sequences=len(self.held_seqs),
                 rope_weighting=self.o.rope_weighting)
        return h


def make_fitter(spec: MLASpec, shape, quant: QuantCacheConfig, method: str, seed: int, fit_kwargs: dict | None,
                fit_fn: FitFn | LayerFitter | type | None = None) -> LayerFitter:
    """The fitter for `method`: a given FitFn / LayerFitter; else the project's function-aligned
    calibration (methods of quantmla.calibration.METHODS) through :class:`ProjectFitter`."""
    if isinstance(fit_fn, LayerFitter):
        return fit_fn
    if isinstance(fit_fn, type) and issubclass(fit_fn, LayerFitter):
        return fit_fn(spec, shape, quant, method, seed, fit_kwargs)
    if fit_fn is not None:
        return RecordsFitter(fit_fn, spec, shape, quant, method, seed, fit_kwargs)
    return ProjectFitter(spec, shape, quant, method, seed, fit_kwargs)


def fuse_layer(layer: torch.nn.Module, spec: MLASpec, transforms: dict) -> None:
    """Fuse {slot: LayerTransform} into the MLA modules inside `layer` (a decoder layer or an
    attention module); identity transforms are skipped, as calibrate does."""
    from quantmla.transforms import fuse_transforms

    todo = {k: v for k, v in transforms.items() if getattr(v, "content", None) is not None or getattr(v, "rope", None) is not None}
    if todo:
        fuse_transforms(layer, todo, spec)
