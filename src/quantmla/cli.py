"""The ``quantmla`` command. Each subcommand lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them up."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from quantmla.errors import CLIError, QuantMLAError  # noqa: F401 - CLIError: commands import it from here

# name -> (module, one-line help); a command's module is imported only when that command runs or its
# arguments are shown (build_parser).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "spec": ("quantmla.model.command", "Show the MLA spec of a checkpoint or config"),
    "bytes": ("quantmla.cache.command", "Bytes per token per layer of cache formats"),
    "train-reference": ("quantmla_lab.training.command", "Train a small MLA reference model on real text (lab)"),
    "analyze": ("quantmla.analysis.command", "Measure the dual-path error model per layer"),
    "calibrate": ("quantmla.calibration.command", "Learn and fuse path-specific transforms"),
    "eval": ("quantmla.evaluation.command", "Perplexity and retrieval under a quantized cache"),
    "bench-kernel": ("quantmla_lab.bench.kernels.command", "Benchmark the low-bit MLA decode kernel (GPU, lab)"),
    "serve": ("quantmla.serving.serve_command", "Generate with a checkpoint on the paged low-bit cache"),
    "serve-bench": ("quantmla_lab.bench.serving.command", "Whole-job throughput under cache pressure (GPU, lab)"),
    "demo": ("quantmla.demo", "The main job: calibrate, evaluate and report on the shipped model"),
}

# Lab commands (reference-model training, benchmarks) live in the lab package beside the library
# (lab/quantmla_lab in the repository); the library itself never imports it.
LAB_PACKAGE = "quantmla_lab"


def lab_installed() -> bool:
    """Whether the lab package can be imported here."""
    return importlib.util.find_spec(LAB_PACKAGE) is not None


def is_lab_command(name: str) -> bool:
    return SUBCOMMANDS[name][0].startswith(LAB_PACKAGE + ".")


def lab_missing(name: str) -> str:
    """What a lab command says where the lab package is not importable."""
    return (f"`quantmla {name}` is a lab command: it lives in the lab package {LAB_PACKAGE} (the folder lab/ of the "
            "QuantMLA repository), which is not importable here. Run it from a checkout of the repository, "
            "installed with `pip install -e .` (as `make setup` does) or with lab/ on the path beside src/ "
            "(PYTHONPATH=src:lab).")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where its help already states one, where it is None (the
    help says what happens then) or where it is a switch's False."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        if "default" in help_.lower() or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return help_
        return super()._get_help_string(action)


def build_parser(commands=None) -> argparse.ArgumentParser:
    """The parser of every subcommand. commands: the subcommands whose arguments it holds (importing
    their modules; None: all); the others are listed with their help line only, as is a lab command
    whose package is not importable (its description says where it lives)."""
    parser = argparse.ArgumentParser(
        prog="quantmla",
        description="QuantMLA: low-bit dual-path KV caching for Multi-Head Latent Attention models.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        if is_lab_command(name) and not lab_installed():
            p = sub.add_parser(name, help=help_, description=f"{help_}. {lab_missing(name)}",
                               formatter_class=HelpFormatter)
            p.set_defaults(_module=None)
            continue
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        p.set_defaults(_module=module)
        if commands is not None and name not in commands:
            continue
        p.add_argument("--threads", type=int, default=None,
                       help="CPU threads of this process (default: OMP_NUM_THREADS if set, else the CPUs it may use, "
                            "at most 8, so that several quantmla processes on one host do not oversubscribe it)")
        importlib.import_module(module).add_arguments(p)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in argv (its first word that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    words = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    name = _command_of(words)
    if name in SUBCOMMANDS and is_lab_command(name) and not lab_installed():
        print(f"quantmla {name}: error: {lab_missing(name)}", file=sys.stderr)
        return 2
    parser = build_parser({name})  # only the command run is imported
    args = parser.parse_args(words)
    # what result files record as their command: the arguments actually parsed, also when called as main([...])
    args.command_line = "quantmla " + " ".join(words)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        module = importlib.import_module(args._module)
        prepare(args, check_device=not getattr(module, "CHECKS_DEVICE", False))
        return int(module.run(args) or 0)
    except (CLIError, QuantMLAError, OSError) as e:  # bad input: the message, no traceback (OSError: paths, files)
        print(f"quantmla {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"quantmla {args.command}: interrupted", file=sys.stderr)
        return 130


def prepare(args, check_device: bool = True) -> None:
    """What every command checks and sets before its work: the CPU thread count, and a --device
    that exists here (unless the command's module sets ``CHECKS_DEVICE``: it checks it itself)."""
    import torch

    from quantmla import checks

    if args.threads is not None:
        checks.check_at_least(args.threads, "--threads", 1)
    torch.set_num_threads(args.threads or checks.default_threads())
    if check_device and isinstance(getattr(args, "device", None), str):
        checks.check_device(args.device)


if __name__ == "__main__":
    sys.exit(main())
