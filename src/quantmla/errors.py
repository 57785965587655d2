"""User-facing errors: each names the problem and the fix."""


class QuantMLAError(ValueError):
    """Bad input or configuration, with a message a user can act on."""


class NotMLAError(QuantMLAError):
    """The checkpoint or model has no Multi-Head Latent Attention layers."""


class UnsupportedFormatError(QuantMLAError):
    """Bits, group size or another cache-format field that is not supported."""


class NonFiniteError(QuantMLAError):
    """NaN or Inf in activations that were to be quantized."""


class MetadataRangeError(QuantMLAError):
    """A group's scale or zero point does not fit the format's metadata dtype (fp16 beyond 65504)."""


class CacheConfigMismatchError(QuantMLAError):
    """A calibrated checkpoint asked to serve a cache format its transforms were not fitted for."""


class CorruptCheckpointError(QuantMLAError):
    """A checkpoint file that is missing, truncated or not in the format its name says."""


class CLIError(Exception):
    """An error with a message meant for the user (no traceback). It lives here, not in ``cli``, so that commands
    raise the one class ``cli.main`` catches, also where ``python -m quantmla.cli`` runs cli as ``__main__``."""
