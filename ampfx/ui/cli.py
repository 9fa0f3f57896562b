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

The parser imports no torch: ``ampfx --help`` and an argument error answer before torch is imported, and
:func:`check` (what ``scripts/demo.sh`` runs before its set-up) needs no more than the standard library.
Each command imports what it runs.
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
from typing import TYPE_CHECKING, Any, Sequence

from ..dtypes import LOW_DTYPES
from ..errors import CLIError, PolicyError, did_you_mean

if TYPE_CHECKING:
    import torch

_TENSOR_DTYPES = {"float32": "float32", "float": "float32", "float64": "float64", "float16": "float16",
                  "bfloat16": "bfloat16", "int64": "int64", "long": "int64", "int32": "int32", "bool": "bool"}
"""``--input``'s dtype names -> the attribute of ``torch`` that is the dtype."""


def _dtype_arg(value: str) -> str:
    """An argparse type: a low-precision dtype's name -> torch's (``bf16`` -> ``bfloat16``), checked without
    torch; :func:`main` makes it the torch dtype once the arguments are parsed."""
    name = LOW_DTYPES.get(value.strip().lower())
    if name is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a low-precision dtype: give bf16, bfloat16, fp16, "
                                         "float16 or half")
    return name


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
    import torch

    shape_text, _, dtype_text = spec.partition(":")
    try:
        shape = tuple(int(s) for s in shape_text.split(","))
    except ValueError:
        raise CLIError(f"--input {spec!r}: the shape must be comma-separated integers, e.g. 8,3,32,32") from None
    if any(n < 1 for n in shape):
        raise CLIError(f"--input {spec!r}: sizes must be positive (a 0 or negative size), e.g. 8,3,32,32")
    name = _TENSOR_DTYPES.get(dtype_text or "float32")
    if name is None:
        raise CLIError(f"--input {spec!r}: unknown dtype {dtype_text!r}; use one of {', '.join(_TENSOR_DTYPES)}")
    dtype = getattr(torch, name)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(*int_range, shape, dtype=dtype)


def load_target(target: str) -> torch.nn.Module:
    """``pkg.mod:fn`` or ``file.py:fn`` -> the model it builds."""
    import torch

    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise CLIError(f"TARGET {target!r}: use module.path:callable or file.py:callable")
    if where.endswith(".py"):
        path = Path(where)
        if not path.exists():
            raise CLIError(f"TARGET {target!r}: no file {where}")
        if not path.is_file():
            raise CLIError(f"TARGET {target!r}: {where} is a directory, not a Python file")
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
    import torch

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


def _check_initialised(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Without ``--input`` the model is not run: lazy modules (``nn.LazyLinear``) keep their parameters
    uninitialised, which ``convert`` refuses; the advice is the command's (give ``--input``), not Python's."""
    from torch.nn.parameter import is_lazy

    lazy = [name or "<root>" for name, m in model.named_modules()
            if any(is_lazy(t) for t in (*m._parameters.values(), *m._buffers.values()))]
    if lazy:
        raise CLIError(f"TARGET {args.target!r}: lazy modules with uninitialised parameters ({', '.join(lazy[:5])}): "
                       "give --input, e.g. --input 8,16: the model is run once on it first, which initialises them")


def _check_writable(path: str | None, flag: str, *, directory: bool = False) -> None:
    """Fail before any work when ``path`` (given as ``flag``) cannot be written, as :func:`ampfx.paths.check_writable`
    finds by trying (permission bits do not tell, for root least of all): one line naming the flag."""
    from ..errors import PathError
    from ..paths import check_writable  # imports the standard library only

    if path is None:
        return
    try:
        check_writable(path, f"{flag} {path!r}", directory=directory)
    except PathError as e:
        raise CLIError(str(e)) from None


def _check_figure(path: str, flag: str) -> None:
    """Fail before any work when matplotlib cannot write a figure of ``path``'s extension (one it has)."""
    from .plots import check_figure_path

    if not Path(path).suffix:
        raise CLIError(f"{flag} {path!r}: matplotlib writes no extensionless figure; give a file name ending in "
                       ".png (or .pdf, .svg, ...)")
    check_figure_path(path, f"{flag} {path!r}")


def _write(path: str, text: str, flag: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise CLIError(f"{flag} {path!r}: cannot write there ({e.strerror or e})") from None


def cmd_lists(args: argparse.Namespace) -> int:
    from ..ops import LISTS
    from ..policy import Policy, from_env
    from ..policy.names import LIST_NAMES

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


def cmd_device(args: argparse.Namespace) -> int:
    import torch

    from ..ops import device_cost

    device = args.device
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise CLIError(f"--device {device!r}: not usable here ({str(e).splitlines()[0]})") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    table = device_cost.table(device, args.dtype, refresh=args.refresh,
                              say=lambda m: print(m, file=sys.stderr))
    print("\n".join(table.lines()))
    if not table.conclusive:
        print("  (too few sizes measured within the time budget, a busy machine?: conversions use the datasheet "
              "break-even; run `ampfx device --refresh` again on a quieter machine)")
    kind = torch.device(device).type
    measured = kind in device_cost.MEASURED_ON
    print(f"cache: {device_cost.cache_file()} ({'written' if table.conclusive else 'not written'}; "
          "AMPFX_CACHE_DIR moves it)")
    print("conversions on this device " + ("use this table by default" if measured else
                                           "use the datasheet by default; AMPFX_GEMM_MIN_FLOPS=measure uses this table")
          + "; AMPFX_GEMM_MIN_FLOPS=0 lowers every GEMM")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from ..api import convert

    inputs = _inputs(args) or None
    if args.tracer == "export" and inputs is None:
        raise CLIError("--tracer export runs the model on example inputs: give --input, e.g. --input 8,16")
    _check_writable(args.out, "--out", directory=True)
    _check_writable(args.html, "--html")
    options = _options(args)
    model = load_target(args.target)
    if inputs is not None:
        _check_runs(model, inputs, args)
    else:
        _check_initialised(model, args)
    amp = convert(model, args.dtype, example_inputs=inputs, tracer=args.tracer, **options)
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
    import torch

    from ..api import convert
    from ..tools.compare import compare

    if not args.input:
        raise CLIError("compare runs the model: give at least one --input, e.g. --input 8,16")
    _check_writable(args.json, "--json")
    options = _options(args)
    torch.manual_seed(args.seed)  # the model's initial weights and the random inputs, repeatable
    model = load_target(args.target)
    inputs = _inputs(args)
    _check_runs(model, inputs, args)
    amp = convert(model, args.dtype, example_inputs=inputs, tracer=args.tracer, **options)
    result = compare(model, amp, inputs, top=args.top)
    print(result.table(color=sys.stdout.isatty()))
    if args.json:
        _write(args.json, json.dumps(result.to_dict(), indent=2) + "\n", "--json")
        print(f"comparison written to {args.json}", file=sys.stderr)
    return 0


def check_demo(args: argparse.Namespace) -> None:
    """``ampfx demo``'s checks that need no torch: the paths it writes."""
    _check_writable(args.loss_scale_plot, "--loss-scale-plot")
    _check_writable(args.out, "--out", directory=True)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.loss_scale_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CLIError("--loss-scale-plot needs matplotlib: pip install 'ampfx[plots]'") from None
        _check_figure(args.loss_scale_plot, "--loss-scale-plot")
    from .demo import main as demo

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
    _check_figure(args.out, "--out")
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


def _options(args: argparse.Namespace) -> dict:
    """``convert``'s options from the command line (``fp8=`` when ``--fp8`` was given, else the environment's
    ``AMPFX_FP8`` holds), checked before any work with the ``AMPFX_*`` environment that convert reads again: a bad
    value is one line in the command's words (a recipe's name, not ``ampfx.policy.fp8.Recipe``), and an
    ``AMPFX_LOG_PATH`` where nothing can be written is named before the model is loaded."""
    from ..policy import Policy, fp8, from_env

    given = {}
    if args.fp8 is not None:
        word = args.fp8.strip().lower()
        if word not in (*fp8.RECIPES, "off", "none"):
            names = ", ".join(fp8.RECIPES)
            raise CLIError(f"--fp8 {args.fp8!r} is not an FP8 recipe: give one of {names}, or leave --fp8 out for "
                           f"no FP8.{did_you_mean(word, fp8.RECIPES)}")
        given["fp8"] = word
    policy = from_env(Policy(args.dtype, **given))
    if policy.log.log_path:
        _check_writable(str(policy.log.log_path), "AMPFX_LOG_PATH", directory=True)
    return given


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ampfx", description="Automatic mixed precision as a torch.fx graph rewrite.")
    p.set_defaults(check=None)  # a command's checks that need no torch (run before it, and by check())
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="convert the built-in example, show the report, train it side by side")
    d.add_argument("--dtype", type=_dtype_arg, default="bfloat16", help=_DTYPE_HELP)
    d.add_argument("--steps", type=_positive, default=200, help="training steps per run (default 200)")
    d.add_argument("--loss-scale-plot", metavar="PNG", help="with --dtype fp16: plot GradScaler's loss scale per step")
    d.add_argument("--out", metavar="DIR", default="ampfx-demo",
                   help="directory the full decision log and its HTML page are saved in (default ampfx-demo)")
    d.set_defaults(func=cmd_demo, check=check_demo)
    ls = sub.add_parser("lists", help="the effective allow/infer/clear/deny lists after AMPFX_* overrides")
    ls.add_argument("--dtype", type=_dtype_arg, default="bfloat16", help=_DTYPE_HELP)
    ls.set_defaults(func=cmd_lists)
    e = sub.add_parser("explain", help="convert a model and print the decision log")
    e.add_argument("target", help="module.path:callable or file.py:callable returning the model")
    e.add_argument("--dtype", type=_dtype_arg, default="bfloat16", help=_DTYPE_HELP)
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
    c.add_argument("--dtype", type=_dtype_arg, default="bfloat16", help=_DTYPE_HELP)
    _input_options(c, "an input of the batch")
    c.add_argument("--top", type=_positive, default=10, help="parameters listed, worst first (default 10)")
    c.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    c.add_argument("--seed", type=int, default=0,
                   help="torch's seed for the model's weights and the inputs (default 0)")
    _tracer_option(c)
    _fp8_option(c)
    c.set_defaults(func=cmd_compare)
    dv = sub.add_parser("device", help="the measured table of where low-precision GEMMs pay on this device (measured "
                                       "at first need, cached), and where it is cached")
    dv.add_argument("--dtype", type=_dtype_arg, default="bfloat16", help=_DTYPE_HELP)
    dv.add_argument("--device", default="cpu", help="the device to measure (default cpu; cuda, cuda:1, ...)")
    dv.add_argument("--threads", type=_positive, default=None,
                    help="torch's intra-op threads to measure with (default: torch's; the table is kept per count)")
    dv.add_argument("--refresh", action="store_true", help="measure again (a few seconds) and replace the cached table")
    dv.set_defaults(func=cmd_device)
    pl = sub.add_parser("plot", help="histogram activation and gradient magnitudes against the dtype's range "
                                     "(needs matplotlib)")
    pl.add_argument("target", help="module.path:callable or file.py:callable returning the float32 model")
    pl.add_argument("--dtype", type=_dtype_arg, default="bfloat16",
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
    args = _parse(argv)
    try:
        if args.check:
            args.check(args)
        _prepare(args)
        return args.func(args)
    except BrokenPipeError:  # `ampfx lists | head`
        sys.stderr.close()
        return 0
    except Exception as e:  # noqa: BLE001 - user errors become one line; anything else keeps its traceback
        if not _user_error(e):
            raise
        print(f"ampfx {args.command}: error: {e}", file=sys.stderr)
        return 2


def check(argv: Sequence[str] | None = None) -> int:
    """The arguments of ``ampfx ...`` checked as far as that needs no torch (parsed, and the paths the command
    writes), the command not run: 0 when it may run, 2 after naming a bad argument on stderr as :func:`main`
    does; ``--help`` prints the help (argparse's exits: ``SystemExit``). ``scripts/demo.sh`` runs it before its
    set-up, with the Python that will create the environment (only the standard library is imported).

    >>> check(["demo", "--steps", "3"])
    0
    """
    args = _parse(argv)
    try:
        if args.check:
            args.check(args)
    except CLIError as e:
        print(f"ampfx {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """``argv`` parsed (without torch); a misspelt option is named with the close options of its subcommand
    (argparse names it without a suggestion)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = _subparser(parser, args.command)
        known = [o for a in sub._actions for o in a.option_strings]
        hints = "".join(did_you_mean(u.split("=")[0], known) for u in unknown if u.startswith("-"))
        sub.error(f"unrecognized arguments: {' '.join(unknown)}.{hints}")
    return args


def _prepare(args: argparse.Namespace) -> None:
    """What every command needs once its arguments are checked, torch's first import: ``--dtype`` as a torch
    dtype, and other libraries' op tables registered (``ampfx lists`` shows them), as ampfx's public names do."""
    from .. import libraries  # noqa: F401 - registers other libraries' op tables
    from ..policy.names import parse_dtype

    args.dtype = parse_dtype(args.dtype, where="--dtype")


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
