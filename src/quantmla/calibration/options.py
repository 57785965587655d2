"""The options of a calibration, one object shared by ``calibrate``, the streamed run and the CLI."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quantmla.calibration.capture import WEIGHTINGS
from quantmla.calibration.rope import SEARCHES
from quantmla.errors import QuantMLAError

METHODS = ("quantmla", "hadamard", "rtn")
PATHS = ("content", "rope")


@dataclass(frozen=True)
class CalibrationOptions:
    """How :func:`quantmla.calibration.calibrate` (and ``calibrate_streamed``) fits a model.

    method: ``quantmla`` (learned content transform, searched RoPE pair scalars), ``hadamard``
    (the QuaRot point on the content path) or ``rtn`` (no transform). paths: which of
    ``content`` / ``rope`` get transforms. seed: every random choice derives from it.
    steps: Adam steps per layer of the content fit (and the RoPE Adam search, unless rope_steps).
    lr: Adam learning rate. batch_size: calibration sequences per forward and fit minibatch.
    queries_per_seq / rope_keys_per_seq: positions sampled per sequence for the objectives.
    rope_weighting: weighting of the positional QK objective (``attention`` or ``uniform``).
    rope_searches: the RoPE searches tried (calibration/rope.py). rope_center: remove the RoPE
    keys' context mean before they are quantized (the checkpoint then carries ``rope_offsets``;
    False: fitted without offsets, marked ``"rope_centring": false``). rope_center_context: the
    positions the offset serves, 0 … n−1 (None: the model's max_position_embeddings; 0: the plain
    mean of the calibration keys). rope_spread: fraction (0..1) of the RoPE objective's keys moved
    to random positions of the context. rope_page: fit the RoPE path for keys stored per channel per
    page of that many tokens (``cache.rope_channel``; 0: the format's per-token groups).
    heldout_fraction: share of the sequences held out to choose and report transforms.
    max_capture_bytes: budget of captured activations per capture pass (bytes).
    device: where captured activations live and the fits run (None: the CPU)."""

    method: str = "quantmla"
    paths: tuple[str, ...] = PATHS
    seed: int = 0
    steps: int = 200
    rope_steps: int | None = None
    lr: float = 1e-2
    batch_size: int = 4
    queries_per_seq: int = 64
    rope_keys_per_seq: int = 128
    rope_weighting: str = "attention"
    rope_searches: tuple[str, ...] = SEARCHES
    rope_center: bool = True
    rope_center_context: int | None = None
    rope_spread: float = 0.0
    rope_page: int = 0
    heldout_fraction: float = 0.25
    max_capture_bytes: int = 2 << 30
    device: str | None = None

    def __post_init__(self):
        for name in ("paths", "rope_searches"):  # lists from JSON or callers: stored as tuples
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.device is not None:
            object.__setattr__(self, "device", str(self.device))

    @classmethod
    def of(cls, options: CalibrationOptions | dict | None = None, **changes) -> CalibrationOptions:
        """`options` (an instance, a dict of fields, or None: the defaults) with `changes` applied;
        an unknown name is refused with the list of known ones."""
        if isinstance(options, cls):
            base = dataclasses.asdict(options)
        else:
            base = dict(options or {})
        base.update(changes)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(base) - known)
        if unknown:
            raise QuantMLAError(f"unknown calibration options {unknown}; known: {sorted(known)}")
        return cls(**base)

    @property
    def fitted_rope_steps(self) -> int:
        """Adam steps of the RoPE search: rope_steps, or steps when unset."""
        return self.steps if self.rope_steps is None else self.rope_steps

    def check(self) -> CalibrationOptions:
        """These options, or a QuantMLAError naming the bad one; run before any work."""
        if self.rope_center_context is not None and int(self.rope_center_context) < 0:
            raise QuantMLAError(f"rope_center_context is a number of positions (>= 0) or None, "
                                f"got {self.rope_center_context}")
        if not 0.0 <= float(self.rope_spread) <= 1.0:
            raise QuantMLAError(f"rope_spread is a fraction of the RoPE keys, between 0 and 1; got {self.rope_spread}")
        if int(self.rope_page) < 0 or (self.rope_page and self.rope_page & (self.rope_page - 1)):
            raise QuantMLAError(f"rope_page is a page of tokens, a power of two (0: per-token groups); got {self.rope_page}")
        if self.rope_page and self.rope_spread:
            raise QuantMLAError("rope_spread moves the kept keys away from their pages; it cannot be combined with rope_page")
        if self.method not in METHODS:
            raise QuantMLAError(f"unknown calibration method {self.method!r}; use one of {METHODS}")
        bad = [p for p in self.paths if p not in PATHS]
        if bad or not self.paths:
            raise QuantMLAError(f"paths must be a non-empty subset of {PATHS}, got {self.paths}")
        if self.rope_weighting not in WEIGHTINGS:
            raise QuantMLAError(f"rope_weighting must be one of {WEIGHTINGS}, got {self.rope_weighting!r}")
        if int(self.steps) < 0 or int(self.batch_size) < 1:
            raise QuantMLAError(f"steps must be >= 0 and batch_size >= 1, got {self.steps} and {self.batch_size}")
        if self.rope_steps is not None and int(self.rope_steps) < 0:
            raise QuantMLAError(f"rope_steps must be >= 0 (None: steps), got {self.rope_steps}")
        for name in ("queries_per_seq", "rope_keys_per_seq"):
            if int(getattr(self, name)) < 1:
                raise QuantMLAError(f"{name} is a number of positions sampled per sequence (>= 1), "
                                    f"got {getattr(self, name)}")
        if not 0.0 < float(self.heldout_fraction) < 1.0:
            raise QuantMLAError(f"heldout_fraction is the share of sequences held out, between 0 and 1; "
                                f"got {self.heldout_fraction}")
        bad = [s for s in self.rope_searches if s not in SEARCHES]
        if bad or not self.rope_searches:
            raise QuantMLAError(f"rope_searches must be a non-empty subset of {SEARCHES}, got {self.rope_searches}")
        if self.rope_spread and not (self.rope_center and self.method == "quantmla" and "rope" in self.paths):
            raise QuantMLAError("rope_spread spreads the keys whose context mean the RoPE centring removes: it needs "
                                "rope_center, the quantmla method and the rope path")
        return self

    def to_dict(self) -> dict:
        """JSON-able fields (a streamed run's manifest records them)."""
        d = dataclasses.asdict(self)
        d["paths"], d["rope_searches"] = list(self.paths), list(self.rope_searches)
        return d

    @classmethod
    def from_args(cls, args) -> CalibrationOptions:
        """The options of ``quantmla calibrate``'s command-line flags."""
        return cls(method=args.method, paths=tuple(p.strip() for p in args.paths.split(",") if p.strip()),
                   seed=args.seed, steps=args.steps, rope_weighting=args.rope_weighting,
                   rope_center=not args.no_rope_center, rope_spread=args.rope_spread)
