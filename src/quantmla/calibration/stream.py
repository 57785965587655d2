"""Layer-streamed calibration: calibrate a model that never sits in memory whole.

DeepSeek-V3 / Kimi-K2 geometry (61 decoder layers, hundreds of GB) does not fit one GPU or the host.
Calibration does not need it to: the fused transforms preserve the full-precision function, so
each layer's transforms are fitted on that layer's *full-precision* inputs alone (DESIGN.md §4).
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
import copy
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from quantmla.cache.config import QuantCacheConfig
from quantmla.calibration.outdir import STATE_DIR, fresh_staging, holds_checkpoint, staging_dir, swap_in
from quantmla.errors import QuantMLAError
from quantmla.model.spec import MLASpec, is_mla_attention, spec_from_model

FORMAT_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
EXTRA_UNIT = "extra"

# safetensors dtype names
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# ================================================================================================
# files: atomic writes
# ================================================================================================
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _tmp_name(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}"


def atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = _tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _write_tensor_bytes(f, t: torch.Tensor, chunk: int = 1 << 28) -> None:
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    arr = flat.numpy()
    for s in range(0, arr.shape[0], chunk):
        f.write(memoryview(arr[s : s + chunk]))


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def read_safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file (names -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise QuantMLAError(f"{path} is not a safetensors file (truncated)")
        (n,) = struct.unpack("<Q", raw)
        if n > 1 << 30:
            raise QuantMLAError(f"{path} is not a safetensors file (header size {n})")
        hdr = f.read(n)
        if len(hdr) < n:
            raise QuantMLAError(f"{path} is truncated inside its header")
    out = json.loads(hdr)
    out.pop("__metadata__", None)
    return out


@dataclass
class ShardEntry:
    """One tensor of a shard being written: its name, dtype, shape and how to produce it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    get: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors_streamed(path: str, entries: list[ShardEntry], fault: Callable[[str, int], None] | None = None) -> int:
    """Write a safetensors file one tensor at a time (never holding the whole shard), atomically:
    temporary name, fsync, rename, fsync of the directory. Returns the file size."""
    # larger elements first (keeps every tensor aligned to its element size), then by name
    entries = sorted(entries, key=lambda e: (-torch.empty((), dtype=e.dtype).element_size(), e.name))
    header: dict[str, Any] = {}
    off = 0
    for e in entries:
        if e.dtype not in _ST_NAMES:
            raise QuantMLAError(f"cannot store {e.name} of dtype {e.dtype} in safetensors")
        header[e.name] = {"dtype": _ST_NAMES[e.dtype], "shape": [int(s) for s in e.shape], "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = _tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for k, e in enumerate(entries):
            t = e.get()
            if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                raise QuantMLAError(f"{e.name}: produced {t.dtype} {tuple(t.shape)}, announced {e.dtype} {e.shape}")
            _write_tensor_bytes(f, t)
            del t
            if fault is not None:
                f.flush()
                fault("tensor_written", k)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return os.path.getsize(path)


# ================================================================================================
# memory accounting
# ================================================================================================
def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """High-water mark of the resident set (VmHWM; since the last :func:`reset_peak_rss`)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5). False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc malloc_trim), so a layer's memory does not
    linger as allocator slack when the next, differently shaped layer is loaded."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


class WeightMeter:
    """Bytes of checkpoint weights this process holds materialized right now, and the peak.

    Every tensor the streamer reads from the checkpoint into a module is added when loaded and
    subtracted when the module is released; tests assert on :attr:`peak`."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.loaded_total = 0

    def add(self, n: int) -> None:
        self.live += n
        self.loaded_total += n
        self.peak = max(self.peak, self.live)

    def sub(self, n: int) -> None:
        self.live -= n


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def nbytes_of(obj, _seen=None) -> int:
    """Bytes of the tensors reachable from `obj` (dicts, lists, tuples, dataclasses), each once."""
    seen = set() if _seen is None else _seen
    if torch.is_tensor(obj):
        key = (obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes()) if obj.device.type != "meta" else id(obj)
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes() if obj.device.type != "meta" else 0
    if isinstance(obj, dict):
        return sum(nbytes_of(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes_of(v, seen) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(nbytes_of(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return 0


# ================================================================================================
# the source checkpoint
# ================================================================================================
_LAYER_RE = re.compile(r"^(?P<prefix>(?:.+\.)?)layers\.(?P<idx>\d+)\.(?P<rest>.+)$")


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


class ShardedCheckpoint:
    """Read access, tensor by tensor, to a (sharded) safetensors checkpoint directory."""

    def __init__(self, path: str):
        self.path = os.path.abspath(os.fspath(path))
        cfg_file = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"{self.path!r} is not a checkpoint directory: no config.json found there")
        with open(cfg_file) as f:
            self.config_dict = json.load(f)
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(self.path)
        idx = os.path.join(self.path, INDEX_NAME)
        single = os.path.join(self.path, "model.safetensors")
        if os.path.isfile(idx):
            with open(idx) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            self.weight_map = {k: "model.safetensors" for k in read_safetensors_header(single)}
        else:
            raise FileNotFoundError(
                f"{self.path} has neither {INDEX_NAME} nor model.safetensors: layer streaming reads safetensors "
                "checkpoints (convert .bin checkpoints with save_pretrained(safe_serialization=True))"
            )
        self._headers: dict[str, dict] = {}
        tc = _text_config(self.config)
        self.num_layers = int(tc.num_hidden_layers)
        by_prefix: dict[str, int] = {}
        for name in self.weight_map:
            m = _LAYER_RE.match(name)
            if m:
                by_prefix[m["prefix"]] = by_prefix.get(m["prefix"], 0) + 1
        if not by_prefix:
            raise QuantMLAError(f"{self.path}: no tensor is named '<prefix>layers.<i>.*'; cannot stream decoder layers")
        self.layer_prefix = max(by_prefix, key=by_prefix.get) + "layers."  # e.g. "model.layers."
        self._layers: dict[int, list[str]] = {}
        self._nonlayer: list[str] = []
        for name in sorted(self.weight_map):
            if name.startswith(self.layer_prefix):
                i = int(name[len(self.layer_prefix) :].split(".", 1)[0])
                self._layers.setdefault(i, []).append(name)
            else:
                self._nonlayer.append(name)
        qc = self.config_dict.get("quantization_config") or {}
        self.fp8_block = tuple(qc.get("weight_block_size") or (128, 128))

    # -- names -----------------------------------------------------------------------------------
    @property
    def other(self) -> list[str]:
        """Tensors outside the decoder stack (embeddings, final norm, head)."""
        return list(self._nonlayer)

    def layer_indices(self) -> list[int]:
        return sorted(self._layers)

    def layer_names(self, i: int) -> list[str]:
        return list(self._layers.get(i, []))

    def layer_key(self, i: int) -> str:
        return f"{self.layer_prefix}{i}."

    def index_digest(self) -> str:
        return hashlib.sha256(json.dumps(self.weight_map, sort_keys=True).encode()).hexdigest()

    # -- headers ---------------------------------------------------------------------------------
    def _header(self, file: str) -> dict:
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(os.path.join(self.path, file))
        return self._headers[file]

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        h = self._header(self.weight_map[name])[name]
        if h["dtype"] not in _ST_DTYPES:
            raise QuantMLAError(f"{name}: unsupported safetensors dtype {h['dtype']}")
        return _ST_DTYPES[h["dtype"]], tuple(h["shape"])

    def nbytes(self, name: str) -> int:
        b, e = self._header(self.weight_map[name])[name]["data_offsets"]
        return e - b

    # -- FP8 -------------------------------------------------------------------------------------
    def is_fp8_weight(self, name: str) -> bool:
        return self.meta(name)[0] in _FP8 and (name + "_scale_inv") in self.weight_map

    def is_fp8_scale(self, name: str) -> bool:
        return name.endswith("_scale_inv") and name[: -len("_scale_inv")] in self.weight_map and self.is_fp8_weight(name[: -len("_scale_inv")])

    @property
    def has_fp8(self) -> bool:
        return any(n.endswith("_scale_inv") for n in self.weight_map)

    # -- reading ---------------------------------------------------------------------------------
    def read_raw(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"{name} is not in {self.path}")
        with safe_open(os.path.join(self.path, self.weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)

    def read(self, name: str) -> torch.Tensor:
        """The tensor as the model computes with it: block-FP8 weights are dequantized to fp32."""
        t = self.read_raw(name)
        if t.dtype in _FP8 and (name + "_scale_inv") in self.weight_map:
            s = self.read_raw(name + "_scale_inv").float()
            bm, bn = self.fp8_block
            m, n = t.shape
            s = s.repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
            t = t.float() * s
        return t

    def output_dtype(self, name: str) -> torch.dtype:
        """dtype a tensor is written with: its own, except dequantized FP8 weights (bfloat16)."""
        dt, _ = self.meta(name)
        return torch.bfloat16 if self.is_fp8_weight(name) else dt


# ================================================================================================
# the model skeleton: meta-device structure, non-layer parts materialized
# ================================================================================================
_EXPERT_RE = re.compile(r"^(?P<pre>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _keep_fp32(model: torch.nn.Module) -> list[str]:
    pats = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return sorted(pats)


class Skeleton:
    """The family's own model class built on the meta device (no memory), whose modules are given
    real tensors only while they are used."""

    def __init__(self, ckpt: ShardedCheckpoint, dtype: torch.dtype, device: torch.device,
                 attn_implementation: str | None, meter: WeightMeter):
        from transformers import AutoModel, AutoModelForCausalLM

        self.ckpt, self.dtype, self.device, self.meter = ckpt, dtype, torch.device(device), meter
        config = copy.deepcopy(ckpt.config)
        config.quantization_config = None if ckpt.has_fp8 else getattr(config, "quantization_config", None)
        if getattr(config, "quantization_config", None) is None and hasattr(config, "quantization_config"):
            del config.quantization_config
        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        with torch.device("meta"):
            try:
                self.model = AutoModelForCausalLM.from_config(config, **kw)
            except ValueError:
                self.model = AutoModel.from_config(config, **kw)
        self.config = self.model.config
        self.base = self.model.base_model
        if not hasattr(self.base, "layers"):
            raise QuantMLAError(f"{type(self.base).__name__} has no .layers: layer streaming needs a decoder-only layer stack")
        self.spec: MLASpec = spec_from_model(self.model)
        self.keep_fp32 = _keep_fp32(self.model)
        base_prefix = ckpt.layer_prefix[: -len("layers.")]  # "model."
        self.base_prefix = base_prefix
        self._restore_nonpersistent_buffers()
        self._kwargs: dict[tuple[int, int], list[dict]] = {}

    # -- non-layer modules -----------------------------------------------------------------------
    def _restore_nonpersistent_buffers(self) -> None:
        """Rotary inv_freq, embedding scales...: computed from the config in __init__, lost on meta.
        Rebuild the base model class at toy size on the CPU (no layers, vocab 8) and copy them."""
        cfg = copy.deepcopy(self.config)
        tc = _text_config(cfg)
        tc.num_hidden_layers = 0
        tc.vocab_size = 8
        for k in ("layer_types", "mlp_layer_types"):
            if isinstance(getattr(tc, k, None), list):
                setattr(tc, k, [])
        if getattr(tc, "pad_token_id", None) is not None and tc.pad_token_id >= 8:
            tc.pad_token_id = None
        aux = type(self.base)(tc)
        aux_bufs = dict(aux.named_buffers())
        for mname, mod in self.base.named_modules():
            if mname == "layers" or mname.startswith("layers."):
                continue
            for bname in list(mod._non_persistent_buffers_set):
                full = f"{mname}.{bname}" if mname else bname
                b = getattr(mod, bname, None)
                if b is None or b.device.type != "meta":
                    continue
                if full not in aux_bufs:
                    raise QuantMLAError(f"cannot rebuild the non-persistent buffer {full} of {type(mod).__name__}")
                mod._buffers[bname] = aux_bufs[full].to(self.device)

    def _cast(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not any(p in name for p in self.keep_fp32):
            t = t.to(self.dtype)
        return t.to(self.device)

    def materialize(self, module: torch.nn.Module, prefix: str) -> int:
        """Give `module` (now on meta) its tensors from the checkpoint (names `prefix` + key).
        Merges per-expert checkpoint tensors into fused expert parameters. Returns bytes loaded."""
        sd = module.state_dict(keep_vars=True)
        loaded: dict[str, torch.Tensor] = {}
        missing = []
        for k, v in sd.items():
            full = prefix + k
            if full in self.ckpt.weight_map:
                loaded[k] = self._cast(full, self.ckpt.read(full))
                continue
            m = _EXPERT_RE.match(k)
            if m and v.dim() == 3:
                loaded[k] = self._cast(full, self._merge_experts(prefix + m["pre"], m["proj"], v.shape[0]))
                continue
            if v.device.type != "meta":  # a real buffer the checkpoint does not store
                continue
            missing.append(full)
        if missing:
            raise QuantMLAError(
                f"{self.ckpt.path}: {len(missing)} tensors the model needs are not in the checkpoint, e.g. {missing[:4]}"
            )
        for k, t in loaded.items():
            if tuple(t.shape) != tuple(sd[k].shape):
                raise QuantMLAError(f"{prefix + k}: checkpoint shape {tuple(t.shape)}, model expects {tuple(sd[k].shape)}")
        module.load_state_dict(loaded, strict=False, assign=True)
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.device.type == "meta":
                raise QuantMLAError(f"{prefix + name} stayed on the meta device after loading (not in the checkpoint)")
        n = sum(_tensor_bytes(t) for t in loaded.values())
        self.meter.add(n)
        return n

    def _merge_experts(self, pre: str, proj: str, num: int) -> torch.Tensor:
        """Per-expert checkpoint tensors (``experts.{e}.gate_proj.weight`` ...) -> the fused
        parameter of transformers' expert module (gate_up_proj [E, 2I, H], down_proj [E, H, I]),
        filled in place (peak: the fused tensor plus one expert's)."""
        parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
        names = [[f"{pre}.{e}.{p}.weight" for p in parts] for e in range(num)]
        absent = [n for row in names for n in row if n not in self.ckpt.weight_map]
        if absent:
            raise QuantMLAError(f"{self.ckpt.path}: expert tensors missing, e.g. {absent[:2]}")
        out = None
        for e, row in enumerate(names):
            off = 0
            for n in row:
                t = self.ckpt.read(n)
                if out is None:
                    rows = t.shape[0] * len(parts)
                    out = torch.empty((num, rows, *t.shape[1:]), dtype=t.dtype)
                out[e, off : off + t.shape[0]] = t
                off += t.shape[0]
                del t
        return out

    def release(self, module: torch.nn.Module, nbytes: int) -> None:
        module.to_empty(device="meta")
        self.meter.sub(nbytes)
        trim_heap()

    # -- layer inputs ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _recording(self):
        """Swap the layer stack for recorders (identity layers that keep their inputs) and the final
        norm for the identity, so the base model's own forward yields every layer's call."""
        rec: list[dict] = [None] * len(self.base.layers)  # type: ignore[list-item]

        class Recorder(torch.nn.Module):
            def __init__(self, i):
                super().__init__()
                self.i = i

            def forward(self, hidden_states, *args, **kwargs):
                if args:
                    raise QuantMLAError("decoder layers called with positional arguments beyond hidden_states")
                rec[self.i] = {"hidden": hidden_states, "kwargs": kwargs}
                return hidden_states

        layers, norm = self.base.layers, getattr(self.base, "norm", None)
        self.base.layers = torch.nn.ModuleList([Recorder(i) for i in range(len(layers))])
        if norm is not None:
            self.base.norm = torch.nn.Identity()
        try:
            yield rec
        finally:
            self.base.layers = layers
            if norm is not None:
                self.base.norm = norm

    @torch.no_grad()
    def layer_kwargs(self, batch: int, seq: int, layer: int) -> dict:
        """Keyword arguments (mask, position ids, position embeddings...) the base model passes to
        decoder layer `layer` for a [batch, seq] input without padding (computed once per shape)."""
        key = (batch, seq)
        if key not in self._kwargs:
            dummy = torch.zeros(batch, seq, self.spec.hidden_size, dtype=self.dtype, device=self.device)
            with self._recording() as rec:
                self.base(inputs_embeds=dummy, use_cache=False)
            self._kwargs[key] = [r["kwargs"] for r in rec]
        return self._kwargs[key][layer]

    @torch.no_grad()
    def embed(self, ids: torch.Tensor, out: torch.Tensor, batch_size: int) -> None:
        """Hidden states entering layer 0 of calibration ids [N, S], written into out [N, S, hidden]."""
        emb = self.base.get_input_embeddings()
        emb_name = next(n for n, m in self.base.named_modules() if m is emb)
        n = self.materialize(emb, f"{self.base_prefix}{emb_name}.")
        try:
            for s in range(0, ids.shape[0], batch_size):
                with self._recording() as rec:
                    self.base(input_ids=ids[s : s + batch_size].to(self.device), use_cache=False)
                out[s : s + batch_size] = rec[0]["hidden"].to(out.device, out.dtype)
        finally:
            self.release(emb, n)

    def layer_module(self, i: int) -> torch.nn.Module:
        return self.base.layers[i]

    def materialize_attention(self, i: int) -> tuple[dict[int, tuple[str, torch.nn.Module]], int]:
        """Only the MLA attention modules of layer i (what a fitting rank needs); -> (mods, bytes)."""
        layer = self.layer_module(i)
        mods = self.mla_submodules(layer)
        n = 0
        for _, (rel, m) in mods.items():
            n += self.materialize(m, f"{self.ckpt.layer_key(i)}{rel}.")
        return mods, n

    def mla_submodules(self, layer: torch.nn.Module) -> dict[int, tuple[str, torch.nn.Module]]:
        """cache slot -> (name relative to the layer, attention module)."""
        out = {}
        for name, m in layer.named_modules():
            if is_mla_attention(m):
                out[int(m.layer_idx)] = (name, m)
        return dict(sorted(out.items()))


# ================================================================================================
# activations
# ================================================================================================
class ActivationBuffer:
    """[N, S, hidden] hidden states: in memory ("memory"/"device") or in a file-backed shared
    mapping ("disk", pages written back by the kernel, so RAM holds only what is being used)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, mode: str, device, path: str | None = None,
                 tensor: torch.Tensor | None = None):
        self.shape, self.dtype, self.mode, self.path = tuple(shape), dtype, mode, path
        if tensor is not None:
            self.t = tensor
        elif mode == "disk":
            numel = 1
            for s in shape:
                numel *= s
            if os.path.exists(path):
                os.remove(path)
            self.t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(*shape)
        else:
            self.t = torch.empty(shape, dtype=dtype, device=device if mode == "device" else "cpu")

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.t)

    def save(self, final: str, meta: dict) -> None:
        """Commit these activations as a checkpoint file (atomic); for disk mode the mapping's file."""
        if self.mode == "disk":
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.path, final)
            self.path = final
        else:
            tmp = _tmp_name(final)
            with open(tmp, "wb") as f:
                _write_tensor_bytes(f, self.t)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        _fsync_dir(os.path.dirname(final))
        atomic_write_json(final + ".json", {**meta, "shape": list(self.shape), "dtype": _ST_NAMES[self.dtype],
                                            "bytes": os.path.getsize(final)})

    @classmethod
    def load(cls, final: str, mode: str, device) -> "ActivationBuffer":
        with open(final + ".json") as f:
            meta = json.load(f)
        shape, dtype = tuple(meta["shape"]), _ST_DTYPES[meta["dtype"]]
        numel = 1
        for s in shape:
            numel *= s
        if mode == "disk":  # read-only input: map the checkpoint itself (private, paged lazily)
            t = torch.from_file(final, shared=False, size=numel, dtype=dtype).view(*shape)
            return cls(shape, dtype, mode, device, final, tensor=t)
        t = torch.from_file(final, shared=False, size=numel, dtype=dtype).view(*shape).clone()
        return cls(shape, dtype, mode, device, None, tensor=t.to(device) if mode == "device" else t)

    @staticmethod
    def valid(final: str) -> bool:
        try:
            with open(final + ".json") as f:
                meta = json.load(f)
            return os.path.getsize(final) == meta["bytes"]
        except (OSError, ValueError, KeyError):
            return False


# ================================================================================================
# fitting: the per-layer entry point
# ================================================================================================
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


def standin_fit(module, spec: MLASpec, records: list[dict], quant: QuantCacheConfig, *, method: str, seed: int, **_):
    """A fit with no learning, for tests of the streaming machinery: "random" draws a seeded
    random content + RoPE transform, perturbed by the data (so wrong inputs give a different
    transform); "identity" returns no transform."""
    from quantmla.transforms import ContentTransform, LayerTransform, RopeTransform, random_orthogonal

    if method == "identity":
        return LayerTransform(None, None)
    if method != "random":
        raise QuantMLAError(f"the stand-in fit knows 'random' and 'identity', not {method!r}")
    g = torch.Generator().manual_seed(int(seed))
    h = torch.cat([r["hidden"].reshape(-1, r["hidden"].shape[-1]).double() for r in records])
    gamma = torch.exp(torch.randn(spec.d_c, generator=g, dtype=torch.float64) * 0.3) * (1 + float(h.pow(2).mean()) * 1e-3)
    z = torch.polar(torch.exp(torch.randn(spec.num_pairs, generator=g, dtype=torch.float64) * 0.3),
                    torch.rand(spec.num_pairs, generator=g, dtype=torch.float64) * 6.28 - 3.14)
    return LayerTransform(ContentTransform(random_orthogonal(spec.d_c, g), gamma), RopeTransform(z))


def to_device(obj, device):
    """`obj` with every tensor (in dicts, lists, tuples, dataclasses) moved to `device`."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)
                                           if f.init})
    return obj


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

    fit_kwargs: calibrate's keyword arguments (paths, steps, rope_steps, lr, queries_per_seq,
    rope_keys_per_seq, rope_weighting, rope_searches, rope_center, rope_spread, heldout_fraction, max_capture_bytes, device:
    where the captured data lives and the fit runs, default CPU). ``batch_size`` is the streamer's
    (capture batches and fit minibatches, as in calibrate)."""

    OPTIONS = ("paths", "steps", "rope_steps", "lr", "batch_size", "queries_per_seq", "rope_keys_per_seq",
               "rope_weighting", "rope_searches", "rope_center", "rope_spread", "heldout_fraction", "max_capture_bytes", "device")

    @staticmethod
    def defaults() -> dict:
        """calibrate's own defaults, read from its signature (so the two cannot drift apart)."""
        import inspect

        from quantmla.calibration import api

        params = inspect.signature(api.calibrate).parameters
        return {k: params[k].default for k in ProjectFitter.OPTIONS if k in params}

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        from quantmla.calibration import api
        from quantmla.calibration import capture as cap

        unknown = sorted(set(self.fit_kwargs) - set(self.OPTIONS) - {"progress", "verbose"})
        if unknown:
            raise QuantMLAError(f"unknown calibration options for streaming: {unknown}")
        o = {**self.defaults(), **{k: v for k, v in self.fit_kwargs.items() if k in self.OPTIONS}}
        o["rope_steps"] = o["steps"] if o["rope_steps"] is None else o["rope_steps"]
        o["rope_searches"] = tuple(o["rope_searches"])
        o["paths"] = api.check_options(self.quant, method=self.method, paths=o["paths"], rope_weighting=o["rope_weighting"],
                                       rope_spread=o["rope_spread"])
        api.check_formats(self.spec, self.quant)
        self.o = o
        self.store_device = torch.device(o.get("device") or "cpu")
        N, L = self.shape
        g = torch.Generator().manual_seed(self.seed)
        self.fit_seqs, self.held_seqs = api.split_sequences(N, o["heldout_fraction"], g)
        # the positions capture_calibration_data samples (same generator), and its budget check
        self.plan = cap.plan_capture(self.spec, (N, L), queries_per_seq=o["queries_per_seq"],
                                     rope_keys_per_seq=o["rope_keys_per_seq"], seed=self.seed)
        self.plan.check_budget(o["max_capture_bytes"], "max_capture_bytes")
        self.capture_bytes = self.plan.layer_bytes
        self.capture_seconds: dict[int, float] = {}  # slot -> time spent capturing (inside the forward)

    def begin(self, slot, module):
        from quantmla.calibration.capture import LayerCapture

        return {"capture": LayerCapture(slot, module, self.spec, self.plan, self.store_device), "seconds": 0.0}

    def observe(self, state, hidden, position_embeddings, start):
        t0 = time.perf_counter()
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
        total = (o["steps"] if quantmla and "content" in o["paths"] else 0) + (1 if quantmla and "rope" in o["paths"] else 0)
        with tqdm(total=total, desc=f"slot {slot}: fit", leave=False, disable=not self.show_progress or not total) as pbar:
            lt, rep = fit_layer(d, self.quant.format_for(slot), self.fit_seqs, self.held_seqs, method=self.method,
                                paths=o["paths"], seed=self.seed, steps=o["steps"], rope_steps=o["rope_steps"], lr=o["lr"],
                                batch_size=o["batch_size"], rope_weighting=o["rope_weighting"],
                                rope_searches=o["rope_searches"], rope_center=o["rope_center"],
                                rope_spread=o["rope_spread"], pbar=pbar)
        secs["fit"] = time.perf_counter() - t
        info = json.loads(json.dumps(dc.asdict(rep), default=float))
        info["seconds"] = secs
        return lt, info

    def rope_centring(self, slots) -> bool:
        from quantmla.calibration.api import rope_centring

        return rope_centring(self.quant, slots, method=self.method, paths=self.o["paths"], rope_center=self.o["rope_center"])

    def report_header(self) -> dict:
        h = super().report_header()
        h.update(paths=list(self.o["paths"]), fit_sequences=len(self.fit_seqs), heldout_sequences=len(self.held_seqs),
                 rope_weighting=self.o["rope_weighting"])
        return h


STANDIN_METHODS = ("random", "identity")


def make_fitter(spec: MLASpec, shape, quant: QuantCacheConfig, method: str, seed: int, fit_kwargs: dict | None,
                fit_fn: FitFn | LayerFitter | type | None = None) -> LayerFitter:
    """The fitter for `method`: a given FitFn / LayerFitter; else the project's function-aligned
    calibration (methods of quantmla.calibration.METHODS) through :class:`ProjectFitter`; else the
    stand-in fits (``random``, ``identity``)."""
    if isinstance(fit_fn, LayerFitter):
        return fit_fn
    if isinstance(fit_fn, type) and issubclass(fit_fn, LayerFitter):
        return fit_fn(spec, shape, quant, method, seed, fit_kwargs)
    if fit_fn is not None:
        return RecordsFitter(fit_fn, spec, shape, quant, method, seed, fit_kwargs)
    if method in STANDIN_METHODS:
        return RecordsFitter(standin_fit, spec, shape, quant, method, seed, fit_kwargs)
    return ProjectFitter(spec, shape, quant, method, seed, fit_kwargs)


def fuse_layer(layer: torch.nn.Module, spec: MLASpec, transforms: dict) -> None:
    """Fuse {slot: LayerTransform} into the MLA modules inside `layer` (a decoder layer or an
    attention module); identity transforms are skipped, as calibrate does."""
    from quantmla.transforms import fuse_transforms

    todo = {k: v for k, v in transforms.items() if getattr(v, "content", None) is not None or getattr(v, "rope", None) is not None}
    if todo:
        fuse_transforms(layer, todo, spec)


# ================================================================================================
# the run: state directory, markers, report
# ================================================================================================
@dataclass
class LayerStats:
    layer: int
    slots: list[int]
    weight_bytes: int
    load_s: float = 0.0
    forward_s: float = 0.0
    fit_s: float = 0.0
    write_s: float = 0.0
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    live_weight_peak_bytes: int = 0
    activation_bytes: int = 0
    device_peak_bytes: int = 0
    rank: int = 0
    fitted: bool = True
    wait_s: float = 0.0  # distributed: time a fitting rank waited for this layer's data
    captured_bytes: int = 0  # what the fit works from (the fitter's captured data)


@dataclass
class StreamReport:
    output: str
    num_layers: int
    tokens: int
    model_bytes: int
    max_layer_bytes: int
    layers: list[LayerStats] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # done before this run (resumed)
    resumed_from: int | None = None  # activation checkpoint used (input index), None: embeddings
    peak_live_weight_bytes: int = 0
    peak_rss_bytes: int = 0
    start_rss_bytes: int = 0
    seconds: float = 0.0
    per_rank: list = field(default_factory=list)  # distributed runs: memory per rank

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        gb = 1 << 30
        fitted = sum(1 for s in self.layers if s.fitted)
        return (
            f"{fitted} layers fitted, {len(self.layers)} layer steps ({len(self.skipped)} done before), {self.tokens} tokens, "
            f"{self.seconds:.1f} s; model {self.model_bytes / gb:.3f} GiB, largest layer {self.max_layer_bytes / gb:.3f} GiB, "
            f"peak live weights {self.peak_live_weight_bytes / gb:.3f} GiB, peak RSS growth "
            f"{(self.peak_rss_bytes - self.start_rss_bytes) / gb:.3f} GiB"
        )


def _calib_digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes() + str(tuple(ids.shape)).encode()).hexdigest()


def _unit_file(unit: str) -> str:
    return f"model-{unit}.safetensors"


def _layer_unit(i: int) -> str:
    return f"layer-{i:05d}"


def choose_work_dir(output: str, overwrite: bool) -> str:
    """Where a streamed run into `output` writes: `output` itself (a new run, or resuming one),
    or, when `overwrite` replaces a checkpoint already there, a fresh staging directory beside it
    (calibration/outdir.py) that finalize swaps in. A run killed while staging resumes there
    when started again without `overwrite`."""
    staged = staging_dir(output)
    if overwrite:
        return fresh_staging(output) if holds_checkpoint(output) else output
    if os.path.isfile(os.path.join(output, STATE_DIR, "run.json")):
        return output
    if os.path.isfile(os.path.join(staged, STATE_DIR, "run.json")):
        return staged
    return output


class RunState:
    """The output directory's state: run manifest, unit markers, activation checkpoints."""

    def __init__(self, output: str):
        self.output = os.path.abspath(output)
        self.dir = os.path.join(self.output, STATE_DIR)
        self.acts = os.path.join(self.dir, "activations")

    def marker(self, unit: str) -> str:
        return os.path.join(self.dir, f"{unit}.json")

    def prepare(self, manifest: dict, overwrite: bool) -> None:
        os.makedirs(self.output, exist_ok=True)
        run = os.path.join(self.dir, "run.json")
        if overwrite and os.path.isdir(self.dir):
            shutil.rmtree(self.dir)
        if os.path.isfile(run):
            with open(run) as f:
                old = json.load(f)
            diff = sorted(k for k in set(old) | set(manifest) if old.get(k) != manifest.get(k))
            if diff:
                raise QuantMLAError(
                    f"{self.output} holds a streamed calibration with different {', '.join(diff)}; "
                    "resume with the same settings, use another output directory, or pass overwrite=True (--overwrite)"
                )
        else:
            stray = [f for f in os.listdir(self.output) if f.endswith(".safetensors") or f == INDEX_NAME]
            if stray and not overwrite:
                raise QuantMLAError(
                    f"{self.output} already holds a checkpoint not written by a streamed calibration "
                    f"({stray[0]}, ...); choose an empty output directory or pass overwrite=True (--overwrite)"
                )
            os.makedirs(self.dir, exist_ok=True)
            atomic_write_json(run, manifest)
        os.makedirs(self.acts, exist_ok=True)

    def is_done(self, unit: str, checksum: bool = False) -> bool:
        """A unit is done only if its marker exists and its shard matches it (size, tensor names,
        and sha256 when `checksum`). A shard without a marker, or a bad one, is not done."""
        try:
            with open(self.marker(unit)) as f:
                m = json.load(f)
            path = os.path.join(self.output, m["file"])
            if os.path.getsize(path) != m["bytes"]:
                return False
            if sorted(read_safetensors_header(path)) != sorted(m["tensors"]):
                return False
            if checksum and m.get("sha256") and _sha256_file(path) != m["sha256"]:
                return False
            return True
        except (OSError, ValueError, KeyError, QuantMLAError):
            return False

    def mark_done(self, unit: str, file: str, checksum: bool, info: dict) -> dict:
        path = os.path.join(self.output, file)
        tensors = sorted(read_safetensors_header(path))
        m = {"unit": unit, "file": file, "bytes": os.path.getsize(path), "tensors": tensors, **info}
        if checksum:
            m["sha256"] = _sha256_file(path)
        atomic_write_json(self.marker(unit), m)
        return m

    def read_marker(self, unit: str) -> dict:
        with open(self.marker(unit)) as f:
            return json.load(f)

    # activation checkpoints: h-{k}.bin holds the hidden states entering layer k
    def act_path(self, k: int) -> str:
        return os.path.join(self.acts, f"h-{k:05d}.bin")

    def act_checkpoints(self) -> list[int]:
        out = []
        for f in os.listdir(self.acts):
            m = re.fullmatch(r"h-(\d{5})\.bin", f)
            if m and ActivationBuffer.valid(os.path.join(self.acts, f)):
                out.append(int(m[1]))
        return sorted(out)

    def drop_act_checkpoints(self, keep: int) -> None:
        for k in self.act_checkpoints():
            if k != keep:
                for p in (self.act_path(k), self.act_path(k) + ".json"):
                    with contextlib.suppress(OSError):
                        os.remove(p)
        for f in os.listdir(self.acts):  # stale work files of killed runs
            if ".tmp." in f or f.startswith("work-"):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.acts, f))


# ================================================================================================
# the streamer
# ================================================================================================
_NON_WEIGHT_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|generation_config\.json|chat_template.*|vocab\..*|merges\.txt|"
    r".*\.tiktoken|.*\.model|.*\.py|preprocessor_config\.json|README\.md|LICENSE.*)$"
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
        self.fit_kwargs = dict(fit_kwargs or {})
        if fit_fn is None and method not in STANDIN_METHODS:
            self.fit_kwargs.setdefault("batch_size", self.batch_size)  # calibrate's one batch_size
        self.checksum = checksum
        self.dtype = dtype = dtype or torch.float32
        self.meter = WeightMeter()
        self.skel = Skeleton(self.ckpt, dtype, self.device, attn_implementation, self.meter)
        self.spec = self.skel.spec
        self.fitter = make_fitter(self.spec, tuple(self.calib_ids.shape), quant, method, self.seed, self.fit_kwargs, fit_fn)
        # decoder layers of the model class (longcat_flash: num_layers, each with two MLA blocks)
        self.L = self.ckpt.num_layers = len(self.skel.base.layers)
        self.final = os.path.abspath(os.fspath(output))
        if work_dir is None:
            work_dir = choose_work_dir(self.final, overwrite) if prepare else self.final
        self.state = RunState(work_dir)  # the final directory, or a staging one swapped in by finalize
        self.manifest = {
            "format_version": FORMAT_VERSION,
            "source_index": self.ckpt.index_digest(),
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
        """Fit and fuse every MLA module of one layer; -> (full-name tensors of the fused modules, info)."""
        transforms, info = {}, {}
        for slot, (_, m) in mods.items():
            lt, info[str(slot)] = self.fitter.fit(slot, captured[slot], m)
            transforms[slot] = _transform_to(lt, m.kv_a_layernorm.weight.device)
        fuse_layer(fuse_target, self.spec, transforms)
        fused = {}
        for slot, (rel, m) in mods.items():
            for k, v in m.state_dict().items():
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
        offsets = slot_offsets(fitted, slots, self.spec.d_r, centred)
        cfg = dict(self.ckpt.config_dict)
        cfg["quantization_config"] = dataclasses.replace(self.quant, method=self.method, rope_offsets=offsets,
                                                         rope_centring=centred).to_dict()
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
    batch_size, also its fit minibatch). fit_fn: a custom :class:`LayerFitter` (instance or class) or
    :data:`FitFn`. dtype: compute dtype (default float32, as ``quantmla calibrate``); weights are
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


@dataclass(frozen=True)
class KillAt:
    """Fault injection for tests: SIGKILL this process (no cleanup, like the OOM killer) at
    `event` of layer `layer` — "tensor_written" (mid-shard: a partial temporary file is left),
    "shard_renamed" (shard in place, marker not yet written)."""

    layer: int
    event: str = "tensor_written"

    def __call__(self, event: str, layer: int) -> None:
        if event == self.event and layer == self.layer:
            os.kill(os.getpid(), signal.SIGKILL)


# ================================================================================================
# synthetic sharded checkpoints (tests, benchmarks): written layer by layer, never whole
# ================================================================================================
def _split_experts(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fused expert parameter -> per-expert tensors in transformers' saved (checkpoint) naming."""
    m = _EXPERT_RE.match(name)
    if not m or t.dim() != 3:
        return {name: t}
    out = {}
    for e in range(t.shape[0]):
        if m["proj"] == "gate_up_proj":
            half = t.shape[1] // 2
            out[f"{m['pre']}.{e}.gate_proj.weight"] = t[e, :half].clone()
            out[f"{m['pre']}.{e}.up_proj.weight"] = t[e, half:].clone()
        else:
            out[f"{m['pre']}.{e}.down_proj.weight"] = t[e].clone()
    return out


@torch.no_grad()
def _random_init(module: torch.nn.Module, g: torch.Generator) -> None:
    for name, p in sorted(module.named_parameters()) + sorted(module.named_buffers()):
        if not p.is_floating_point():
            continue
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and p.dim() == 1:
            p.copy_((1 + 0.3 * torch.randn(p.shape, generator=g)).abs() + 0.1)
        elif p.dim() >= 2:
            fan_in = p.shape[-1]
            std = 1.0 if "embed" in name else fan_in ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
        elif leaf in ("inv_freq", "original_inv_freq", "embed_scale"):
            continue
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def write_random_checkpoint(config, path: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """A sharded safetensors checkpoint of `config` with random weights, one shard per decoder
    layer plus one for the rest, written layer by layer (peak memory: one layer). Experts are
    stored per expert, as transformers saves them. Returns {"bytes", "max_layer_bytes"}."""
    from transformers import AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = model.base_model
    per_expert = any("mlp.experts.*.gate_proj.weight" in (getattr(c, "source_patterns", None) or [])
                     for c in get_checkpoint_conversion_mapping(config.model_type) or [])
    prefix = model.base_model_prefix + "."
    weight_map, total, max_layer = {}, 0, 0

    def dump(module, mprefix, file, g):
        nonlocal total
        module.to_empty(device="cpu")
        _random_init(module, g)
        sd = {}
        for k, v in module.state_dict().items():
            if k.rsplit(".", 1)[-1] in module_nonpersistent(module):
                continue
            for n, t in (_split_experts(mprefix + k, v) if per_expert else {mprefix + k: v}).items():
                sd[n] = t.to(dtype) if t.is_floating_point() else t
        entries = [ShardEntry(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in sd.items()]
        write_safetensors_streamed(os.path.join(path, file), entries)
        module.to_empty(device="meta")
        nb = sum(_tensor_bytes(t) for t in sd.values())
        total += nb
        for n in sd:
            weight_map[n] = file
        return nb

    for i, layer in enumerate(base.layers):
        g = torch.Generator().manual_seed(seed * 100003 + i)
        max_layer = max(max_layer, dump(layer, f"{prefix}layers.{i}.", f"model-layer-{i:05d}.safetensors", g))
    g = torch.Generator().manual_seed(seed * 100003 + 99991)
    rest = torch.nn.ModuleDict()
    for name, child in base.named_children():
        if name != "layers" and any(True for _ in child.parameters()):
            rest[name] = child
    extra = {f"{prefix}{k}": v for k, v in rest.named_children()}
    if model.get_output_embeddings() is not None and not getattr(config, "tie_word_embeddings", False):
        extra["lm_head"] = model.get_output_embeddings()
    holder = torch.nn.ModuleDict({k.replace(".", "__"): v for k, v in extra.items()})
    holder.to_empty(device="cpu")
    _random_init(holder, g)
    sd = {}
    for k, v in holder.state_dict().items():
        mod_key, rest_key = k.split(".", 1)
        if rest_key in ("inv_freq", "original_inv_freq", "embed_scale"):
            continue
        sd[mod_key.replace("__", ".") + "." + rest_key] = v.to(dtype) if v.is_floating_point() else v
    write_safetensors_streamed(os.path.join(path, "model-extra.safetensors"),
                               [ShardEntry(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in sd.items()])
    for n in sd:
        weight_map[n] = "model-extra.safetensors"
    total += sum(_tensor_bytes(t) for t in sd.values())
    holder.to_empty(device="meta")
    config.save_pretrained(path)
    atomic_write_json(os.path.join(path, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    return {"bytes": total, "max_layer_bytes": max_layer}


def module_nonpersistent(module: torch.nn.Module) -> set[str]:
    out = set()
    for m in module.modules():
        out |= set(m._non_persistent_buffers_set)
    return out
