"""The ``ampfx`` command: ``demo``, ``lists``, ``explain``, ``compare``, ``plot``.

    ampfx demo [--dtype bf16|fp16] [--steps N] [--loss-scale-plot FILE.png] [--out DIR]
    ampfx lists [--dtype bf16|fp16]
    ampfx explain TARGET [--dtype bf16|fp16] [--input 8,3,32,32[:float32] ...] [--int-range 0,1000]
                  [--format table|json|html] [--out DIR] [--html FILE]
    ampfx compare TARGET --input 8,16 [--dtype bf16|fp16] [--int-range LOW,HIGH] [--top N] [--json FILE] [--seed N]
    ampfx plot TARGET [--dtype bf16|fp16] --input 8,3,32,32 [--int-range LOW,HIGH] [--loss ce|mse] [--by module|op]
               [--log-y] [--out FILE.png]

Every subcommand's ``--dtype`` defaults to bf16. Integer inputs are drawn from ``--int-range``
(default 0,2: give the vocabulary size for token ids).

``TARGET`` is ``package.module:callable`` or ``path/to/file.py:callable``; the
callable returns the model (an ``nn.Module`` instance or class).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from ..api import convert
from ..tools.compare import compare
from ..errors import CLIError, PolicyError
from ..ops import LISTS
from ..errors import did_you_mean
from ..policy.names import LIST_NAMES, parse_dtype
from ..policy import Policy, from_env

_TENSOR_DTYPES = {"float32": torch.float32, "float": torch.float32, "float64": torch.float64,
                  "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64, "long": torch.int64,
                  "int32": torch.int32, "bool": torch.bool}


def _dtype_arg(value: str) -> torch.dtype:
    try:
        return parse_dtype(value, where="--dtype")
    except PolicyError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a low-precision dtype: give bf16, bfloat16, fp16, "
                                         "float16 or half") from None


def _positive(value: str) -> int:
    """An argparse type: a whole number >= 1 (step counts)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is not positive: give 1 or more")
    return number


def parse_int_range(value: str) -> tuple[int, int]:
    """An argparse type: ``LOW,HIGH`` -> integer inputs drawn from ``[LOW, HIGH)``."""
    try:
        low, high = (int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give LOW,HIGH as two integers, e.g. 0,1000") from None
    if high <= low:
        raise argparse.ArgumentTypeError(f"{value!r}: HIGH must be above LOW (values are drawn from [LOW, HIGH))")
    return low, high


def parse_input(spec: str, int_range: tuple[int, int] = (0, 2)) -> torch.Tensor:
    """``8,3,32,32`` or ``8,128:int64`` -> a random tensor of that shape and dtype; every size >= 1.
    Integer inputs are drawn from ``[low, high)`` of ``int_range`` (``--int-range``)."""
    shape_text, _, dtype_text = spec.partition(":")
    try:
        shape = tuple(int(s) for s in shape_text.split(","))
    except ValueError:
        raise CLIError(f"--input {spec!r}: the shape must be comma-separated integers, e.g. 8,3,32,32") from None
    if any(n < 1 for n in shape):
        raise CLIError(f"--input {spec!r}: sizes must be positive (a 0 or negative size), e.g. 8,3,32,32")
    dtype = _TENSOR_DTYPES.get(dtype_text or "float32")
    if dtype is None:
        raise CLIError(f"--input {spec!r}: unknown dtype {dtype_text!r}; use one of {', '.join(_TENSOR_DTYPES)}")
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(*int_range, shape, dtype=dtype)


def load_target(target: str) -> torch.nn.Module:
    """``pkg.mod:fn`` or ``file.py:fn`` -> the model it builds."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise CLIError(f"TARGET {target!r}: use module.path:callable or file.py:callable")
    if where.endswith(".py"):
        path = Path(where)
        if not path.exists():
            raise CLIError(f"TARGET {target!r}: no file {where}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent.resolve()))
        spec.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:  # as `python -m`: the current directory imports
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise CLIError(f"TARGET {target!r}: cannot import {where} ({e})") from None
    factory = getattr(module, name, None)
    if factory is None:
        raise CLIError(f"TARGET {target!r}: {where} has no attribute {name!r}")
    model = _build(target, name, factory) if callable(factory) and not isinstance(factory, torch.nn.Module) \
        else factory
    if not isinstance(model, torch.nn.Module):
        raise CLIError(f"TARGET {target!r}: {name} returned {type(model).__name__}, not an nn.Module")
    return model


def _build(target: str, name: str, factory: Any) -> Any:
    """``factory()``; one that needs arguments is a user error naming them."""
    try:
        inspect.signature(factory).bind()
    except TypeError as e:
        raise CLIError(f"TARGET {target!r}: {name}() cannot be called without arguments ({e}); point TARGET at a "
                       f"function that builds the model, e.g. def build(): return {name}(...)") from None
    except ValueError:  # no readable signature (a builtin): just call it
        pass
    return factory()


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    return tuple(parse_input(s, args.int_range) for s in args.input)


def _check_runs(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], args: argparse.Namespace) -> None:
    """Run the float32 model once on the inputs: one that cannot run on them is a user error, before
    any conversion (which would otherwise fail deep inside, or convert a model that cannot be run).
    The buffers the run updates (batch-norm statistics) are put back as they were."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad():
            model(*inputs)
            for b, value in buffers:
                b.copy_(value)
    except Exception as e:  # noqa: BLE001 - the model's own error, shown in one line
        text = str(e).strip().splitlines()
        given = " ".join(f"--input {s}" for s in args.input)
        raise CLIError(f"TARGET {args.target!r}: the model does not run in float32 on {given} ({type(e).__name__}"
                       f"{': ' + text[0] if text else ''}); give inputs its forward accepts (shapes, dtypes, "
                       f"--int-range for token ids)") from None


def _check_writable(path: str | None, flag: str, *, directory: bool = False) -> None:
    """Fail before any work when ``path`` cannot be written: its nearest existing ancestor must be a
    writable directory (and ``path`` itself, if it exists, a directory for ``directory`` else a file)."""
    if not path:
        return
    target = Path(path)
    if target.exists() and target.is_dir() != directory:
        raise CLIError(f"{flag} {path!r}: {'not a directory' if directory else 'is a directory'}; give a "
                       f"{'directory' if directory else 'file'} path")
    parent = target if directory else target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise CLIError(f"{flag} {path!r}: cannot write there ({parent} is not a writable directory)")


def _check_figure(path: str) -> None:
    """Fail before any work when matplotlib cannot write a figure of ``path``'s extension."""
    from matplotlib.figure import Figure

    kinds = Figure().canvas.get_supported_filetypes()
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in kinds:
        raise CLIError(f"--out {path!r}: matplotlib writes no {('.' + suffix) if suffix else 'extensionless'} "
                       f"figure; give one of {', '.join('.' + k for k in sorted(kinds))}")


def _write(path: str, text: str, flag: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise CLIError(f"{flag} {path!r}: cannot write there ({e.strerror or e})") from None


def cmd_lists(args: argparse.Namespace) -> int:
    policy = from_env(Policy(args.dtype))
    lists = policy.lists()
    for cat in LISTS:
        print(f"{LIST_NAMES[cat]} ({cat.value}):")
        for name, (c, source, reason) in sorted(lists.items()):
            if c is cat:
                print(f"  {name:<34} [{source}] {reason}")
    print("options (each with the variable that sets it; - : in code or a policy file only):")
    for f in policy.option_fields():  # every option, from the fields' metadata
        if f.metadata.get("internal") or f.name.endswith(("_add", "_remove")):
            continue
        value = getattr(policy, f.name)
        if callable(value):  # a predicate
            value = getattr(value, "__qualname__", type(value).__name__)
        elif hasattr(value, "spec"):  # an FP8 recipe of one's own
            value = value.name
        elif value is None and "none" in f.metadata:  # what None stands for (gemm_min_flops: the device's)
            value = f.metadata["none"]
        print(f"  {f.name:<34} {str(value):<24} {f.metadata.get('env', '-')}")
    if policy.env:
        print("environment: " + ", ".join(f"{k}={v}" for k, v in policy.env))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    inputs = _inputs(args) or None
    if args.tracer == "export" and inputs is None:
        raise CLIError("--tracer export runs the model on example inputs: give --input, e.g. --input 8,16")
    _check_writable(args.out, "--out", directory=True)
    _check_writable(args.html, "--html")
    model = load_target(args.target)
    if inputs is not None:
        _check_runs(model, inputs, args)
    amp = convert(model, args.dtype, example_inputs=inputs, tracer=args.tracer, **_fp8(args))
    rep = amp.ampfx_report
    root = next((reg.method for reg in rep.parts if reg.path == ""), "")
    if inputs is None and root.startswith("eager") and not any(r.dtype is not None for r in rep.records):
        raise CLIError(f"TARGET {args.target!r}: nothing was converted: torch.fx could not trace the model and it "
                       "has no convertible submodules; give --input so that it is run (and its error shown)")
    if args.format == "json":
        for r in (rep.autocast_diff() if args.autocast_diff else rep.records):
            print(json.dumps(r.as_json(), default=str))
    elif args.format == "html":
        print(rep.html())
    else:
        print(rep.summary())
        if args.autocast_diff:
            print(rep.autocast_summary())
        print(rep.table(color=sys.stdout.isatty(), autocast=args.autocast_diff))
    if args.out:
        try:
            saved = rep.save(args.out)
        except OSError as e:
            raise CLIError(f"--out {args.out!r}: cannot write the report there ({e.strerror or e})") from None
        print(f"report saved to {saved}", file=sys.stderr)
    if args.html:
        _write(args.html, rep.html(), "--html")
        print(f"graph written to {args.html}", file=sys.stderr)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Convert the model and print :func:`ampfx.tools.compare`'s tables (and write them as JSON)."""
    if not args.input:
        raise CLIError("compare runs the model: give at least one --input, e.g. --input 8,16")
    _check_writable(args.json, "--json")
    torch.manual_seed(args.seed)  # the model's initial weights and the random inputs, repeatable
    model = load_target(args.target)
    inputs = _inputs(args)
    _check_runs(model, inputs, args)
    amp = convert(model, args.dtype, example_inputs=inputs, tracer=args.tracer, **_fp8(args))
    result = compare(model, amp, inputs, top=args.top)
    print(result.table(color=sys.stdout.isatty()))
    if args.json:
        _write(args.json, json.dumps(result.to_dict(), indent=2) + "\n", "--json")
        print(f"comparison written to {args.json}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo

    _check_writable(args.loss_scale_plot, "--loss-scale-plot")
    if args.loss_scale_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CLIError("--loss-scale-plot needs matplotlib: pip install 'ampfx[plots]'") from None
    _check_writable(args.out, "--out", directory=True)
    demo(str(args.dtype), steps=args.steps, loss_scale_plot=args.loss_scale_plot, out=args.out)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CLIError("needs matplotlib: pip install 'ampfx[plots]'") from None
    from .plots import collect_magnitudes, describe, range_plot, synthetic_loss

    inputs = _inputs(args)
    if not inputs:
        raise CLIError("give at least one --input, e.g. --input 8,3,32,32")
    _check_writable(args.out, "--out")
    _check_figure(args.out)
    model = load_target(args.target)
    _check_runs(model, inputs, args)
    mags = collect_magnitudes(model, (inputs, None), synthetic_loss(args.loss), by=args.by)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    range_plot(mags, args.dtype, path=args.out, log_y=args.log_y)
    print(describe(mags, args.dtype))
    print(f"figure saved to {args.out}", file=sys.stderr)
    return 0


_DTYPE_HELP = "the low-precision dtype: bf16 (default) or fp16"


def _input_options(p: argparse.ArgumentParser, what: str) -> None:
    """``--input`` (repeatable) and ``--int-range``."""
    p.add_argument("--input", action="append", default=[], metavar="SHAPE[:DTYPE]",
                   help=f"{what}, e.g. 8,3,32,32 or 8,128:int64 (repeat for several); float inputs are drawn "
                        "from a standard normal, integer ones from --int-range")
    p.add_argument("--int-range", type=parse_int_range, default=(0, 2), metavar="LOW,HIGH",
                   help="integer inputs are drawn from [LOW, HIGH): for token ids give the vocabulary, e.g. "
                        "0,30522 (default 0,2)")


def _tracer_option(p: argparse.ArgumentParser) -> None:
    """``--tracer``, as :func:`ampfx.convert`'s ``tracer=`` takes it."""
    p.add_argument("--tracer", choices=["auto", "fx", "export"], default="auto",
                   help="capture with torch.fx, torch.export, or fx then export where fx fails (default auto)")


def _fp8_option(p: argparse.ArgumentParser) -> None:
    """``--fp8``, as :func:`ampfx.convert`'s ``fp8=`` takes it (``AMPFX_FP8`` sets it too)."""
    p.add_argument("--fp8", metavar="RECIPE", help="FP8 GEMMs where they pay, each GEMM node's FP8 decision in the "
                                                   "log: tensorwise, rowwise or rowwise_with_gw_hp (docs/fp8.md)")


def _fp8(args: argparse.Namespace) -> dict:
    """``fp8=`` for convert when ``--fp8`` was given (else the environment's ``AMPFX_FP8`` holds)."""
    return {"fp8": args.fp8} if args.fp8 is not None else {}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ampfx", description="Automatic mixed precision as a torch.fx graph rewrite.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="convert the built-in example, show the report, train it side by side")
    d.add_argument("--dtype", type=_dtype_arg, default=torch.bfloat16, help=_DTYPE_HELP)
    d.add_argument("--steps", type=_positive, default=200, help="training steps per run (default 200)")
    d.add_argument("--loss-scale-plot", metavar="PNG", help="with --dtype fp16: plot GradScaler's loss scale per step")
    d.add_argument("--out", metavar="DIR", default="ampfx-demo",
                   help="directory the full decision log and its HTML page are saved in (default ampfx-demo)")
    d.set_defaults(func=cmd_demo)
    ls = sub.add_parser("lists", help="the effective allow/infer/clear/deny lists after AMPFX_* overrides")
    ls.add_argument("--dtype", type=_dtype_arg, default=torch.bfloat16, help=_DTYPE_HELP)
    ls.set_defaults(func=cmd_lists)
    e = sub.add_parser("explain", help="convert a model and print the decision log")
    e.add_argument("target", help="module.path:callable or file.py:callable returning the model")
    e.add_argument("--dtype", type=_dtype_arg, default=torch.bfloat16, help=_DTYPE_HELP)
    _input_options(e, "an example input, run once in float32 to check it (without --input the model is not run)")
    _tracer_option(e)
    _fp8_option(e)
    e.add_argument("--format", choices=["table", "json", "html"], default="table",
                   help="table (default), json (one record per line) or html (the graph page, to stdout)")
    e.add_argument("--out", help="directory to save the full report in (JSON lines, code, report.html)")
    e.add_argument("--html", metavar="FILE", help="write the decision log as a self-contained HTML page")
    e.add_argument("--autocast-diff", action="store_true",
                   help="compare with torch.autocast: the table gets an autocast column (and a summary line of "
                        "the differences); --format json prints only the nodes that differ, with ampfx's reason")
    e.set_defaults(func=cmd_explain)
    c = sub.add_parser("compare", help="convert a model, then measure its output and gradient errors against "
                                       "float32 beside torch.autocast's")
    c.add_argument("target", help="module.path:callable or file.py:callable returning the float32 model")
    c.add_argument("--dtype", type=_dtype_arg, default=torch.bfloat16, help=_DTYPE_HELP)
    _input_options(c, "an input of the batch")
    c.add_argument("--top", type=_positive, default=10, help="parameters listed, worst first (default 10)")
    c.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    c.add_argument("--seed", type=int, default=0,
                   help="torch's seed for the model's weights and the inputs (default 0)")
    _tracer_option(c)
    _fp8_option(c)
    c.set_defaults(func=cmd_compare)
    pl = sub.add_parser("plot", help="histogram activation and gradient magnitudes against the dtype's range "
                                     "(needs matplotlib)")
    pl.add_argument("target", help="module.path:callable or file.py:callable returning the float32 model")
    pl.add_argument("--dtype", type=_dtype_arg, default=torch.bfloat16,
                    help=_DTYPE_HELP + " (fp16's narrow range is what the plot is most often for)")
    _input_options(pl, "an example input")
    pl.add_argument("--loss", choices=["ce", "mse"], default="ce",
                    help="ce: cross-entropy against random labels (classes on dim 1); mse: mean square of the output")
    pl.add_argument("--by", choices=["module", "op"], default="module", help="record leaf modules or every traced op")
    pl.add_argument("--log-y", action="store_true", help="logarithmic y axis")
    pl.add_argument("--out", default="ampfx-range.png", help="the PNG to write (default ampfx-range.png)")
    pl.set_defaults(func=cmd_plot)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse names them without a suggestion
        sub = _subparser(parser, args.command)
        known = [o for a in sub._actions for o in a.option_strings]
        hints = "".join(did_you_mean(u.split("=")[0], known) for u in unknown if u.startswith("-"))
        sub.error(f"unrecognized arguments: {' '.join(unknown)}.{hints}")
    try:
        return args.func(args)
    except BrokenPipeError:  # `ampfx lists | head`
        sys.stderr.close()
        return 0
    except Exception as e:  # noqa: BLE001 - user errors become one line; anything else keeps its traceback
        if not _user_error(e):
            raise
        print(f"ampfx {args.command}: error: {e}", file=sys.stderr)
        return 2


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of ``command`` (its options are what a misspelt one is compared with)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command, parser)
    return parser


def _user_error(e: BaseException) -> bool:
    """A bad argument or input: a ``CLIError``, a ``PolicyError`` or any class of :mod:`ampfx.errors`
    (each names the input and the fix). Other exceptions are bugs and keep their traceback."""
    return isinstance(e, (CLIError, PolicyError)) or type(e).__module__ == "ampfx.errors"


if __name__ == "__main__":
    sys.exit(main())
