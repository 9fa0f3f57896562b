"""``ampfx.ops.device_cost``: the break-even of low-precision GEMMs measured on the device, cached per device, and
the plans it gives. Every test feeds recorded tables (nothing here depends on the machine's speed)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.ops import device_cost, gemm_cost
from ampfx.ops.device_cost import Point, Table
from ampfx.report.records import Rule

# a CPU with native bfloat16: small GEMMs lose, large ones pay
NATIVE = (Point(64, 64, 1.0, 2.8), Point(16, 256, 1.0, 1.6), Point(64, 256, 1.0, 1.1), Point(256, 256, 1.0, 0.5),
          Point(64, 1024, 1.0, 0.55), Point(1024, 1024, 1.0, 0.45))
# an AVX2-only CPU: bfloat16 emulated, tens of times slower at every size
EMULATED = (Point(64, 64, 1.0, 9.0), Point(16, 256, 1.0, 30.0), Point(64, 256, 1.0, 41.0),
            Point(256, 256, 1.0, 50.0), Point(64, 1024, 1.0, 55.0), Point(1024, 1024, 1.0, None))


def _table(points, dtype="bfloat16"):
    return Table(device=device_cost.device_name("cpu"), torch=torch.__version__.split("+")[0], dtype=dtype,
                 points=tuple(points), seconds=0.5)


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Measuring on, the cache in a fresh directory, and ``measure`` replaced by a recorded table (the list
    returned counts its calls; ``use(points)`` sets the table)."""
    monkeypatch.setenv("AMPFX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(device_cost, "MEASURED_ON", ("cpu",))
    class Calls(list):
        def use(self, points):
            chosen["points"] = points

    calls, chosen = Calls(), {"points": NATIVE}

    def fake(device, dtype, budget_s=None):
        calls.append((str(device), dtype))
        return _table(chosen["points"], str(dtype).split(".")[-1])

    monkeypatch.setattr(device_cost, "measure", fake)
    device_cost.forget()
    yield calls
    device_cost.forget()


class Mlp(nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _rules(amp):
    return {r.module: r.rule for r in amp.ampfx_report.compute if r.op == "linear"}


def test_a_recorded_table_gives_its_break_even_pays_never_or_only_large():
    """Rule: the break-even is the (FLOPs, rows) that separates the sizes that pay by the margin from those slower
    than float32 with the fewest mistakes (rows only where FLOPs alone do not); a table where no size pays never
    pays; sizes within the margin go either way."""
    assert _table(NATIVE).break_even() == gemm_cost.BreakEven(2 * 256 * 256 * 256, 0)
    assert _table(EMULATED).break_even().never
    every = _table([Point(64, 64, 1.0, 0.8), Point(1024, 1024, 1.0, 0.5)]).break_even()
    assert every == gemm_cost.BreakEven(0, 0)
    noisy = _table([Point(64, 64, 1.0, 1.05), Point(256, 256, 1.0, 0.95), Point(1024, 1024, 1.0, 0.5)])
    assert noisy.break_even() == gemm_cost.BreakEven(2 * 1024 ** 3, 0)  # 0.95: within the margin, either way
    rows = _table([Point(16, 1024, 1.0, 1.3), Point(256, 256, 1.0, 0.6), Point(1024, 1024, 1.0, 0.5)])
    assert rows.break_even() == gemm_cost.BreakEven(0, 256)  # a weight used for 16 rows loses at any size


def test_the_measured_table_decides_which_gemms_stay_float32(measuring):
    """Rule: by default the CPU's break-even is measured at first need and each reason names it; GEMMs under it
    stay float32, those above run low."""
    small = ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),))
    large = ampfx.convert(Mlp(256), "bf16", example_inputs=(torch.randn(512, 256),))
    assert set(_rules(small).values()) == {Rule.COST_SMALL_GEMM}
    assert set(_rules(large).values()) == {Rule.TABLE}
    reason = next(r.reason for r in small.ampfx_report.compute if r.op == "linear")
    assert "measured on cpu:" in reason and ("(measured)" in reason or "(cached)" in reason), reason
    assert len(measuring) == 1  # measured once for both conversions


def test_a_device_where_the_low_dtype_never_pays_plans_float32_and_says_so_once(measuring):
    """Rule: where the low dtype is slower at every size measured (bfloat16 emulated on an AVX2-only CPU), every
    GEMM stays float32 (rule cost:low-slower), with or without example inputs; a warning and the summary say so
    with the switch, and gemm_min_flops=0 lowers them anyway."""
    measuring.use(EMULATED)
    model = Mlp(256)
    with pytest.warns(UserWarning, match="no GEMM runs in bfloat16.*measured slower than float32.*"
                                         "AMPFX_GEMM_MIN_FLOPS=0") as said:
        amp = ampfx.convert(model, "bf16", example_inputs=(torch.randn(512, 256),))
    assert set(_rules(amp).values()) == {Rule.COST_LOW_SLOWER}
    assert {w.filename for w in said} == {__file__}  # the warning points at the line that called convert
    assert "no GEMM runs in bfloat16" in amp.ampfx_report.summary()
    reasons = {r.reason for r in amp.ampfx_report.compute if r.op == "linear"}
    assert all("slower than float32 at every size measured on cpu:" in r for r in reasons), reasons
    with pytest.warns(UserWarning, match="no GEMM runs"):
        blind = ampfx.convert(Mlp(256), "bf16")  # no example inputs: nothing to count, still float32
    assert set(_rules(blind).values()) == {Rule.COST_LOW_SLOWER}
    x = torch.randn(8, 256)
    torch.testing.assert_close(amp(x), model(x), rtol=0, atol=0)  # float32's plan: float32's numbers
    forced = ampfx.convert(Mlp(256), "bf16", example_inputs=(torch.randn(512, 256),), gemm_min_flops=0)
    assert set(_rules(forced).values()) == {Rule.TABLE}


def test_a_second_conversion_reads_the_cache_and_measures_nothing(measuring, tmp_path):
    """Rule: a table measured once is cached on disk per device, torch version and dtype; another process (this
    one with its memory cleared) reads it and measures nothing; the same cached table gives the same plan."""
    first = _rules(ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),)))
    data = json.loads((tmp_path / "device-cost.json").read_text())
    assert list(data["tables"]) == [_table(NATIVE).key]
    device_cost.forget()
    second = _rules(ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),)))
    assert len(measuring) == 1 and first == second
    ampfx.convert(Mlp(64), "fp16", example_inputs=(torch.randn(32, 64),))
    assert len(measuring) == 2 and measuring[-1][1] is torch.float16  # a dtype of its own


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 0, "tables": {}}),
                                     json.dumps([1, 2, 3])])
def test_a_corrupt_or_foreign_cache_is_measured_again_with_a_message(measuring, tmp_path, content):
    """Rule: a cache file that cannot be read, or is of another version, is measured again with a one-line
    message naming the file, and written anew."""
    (tmp_path / "device-cost.json").write_text(content)
    with pytest.warns(UserWarning, match="device-cost.json.*measuring again"):
        ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),))
    assert len(measuring) == 1
    assert json.loads((tmp_path / "device-cost.json").read_text())["version"] == device_cost.CACHE_VERSION


def test_a_broken_entry_is_measured_again(measuring, tmp_path):
    key = _table(NATIVE).key
    (tmp_path / "device-cost.json").write_text(json.dumps({"version": device_cost.CACHE_VERSION,
                                                           "tables": {key: {"device": "x"}}}))
    with pytest.warns(UserWarning, match="broken entry.*measuring again"):
        ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),))
    assert len(measuring) == 1


def test_an_unwritable_cache_directory_keeps_the_table_in_memory_with_a_message(measuring, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("AMPFX_CACHE_DIR", str(blocker / "below"))  # under a file: cannot be made
    with pytest.warns(UserWarning, match="cannot write the device-cost cache.*AMPFX_CACHE_DIR"):
        ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # from memory now: no second message, no second measurement
        ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),))
    assert not [w for w in said if "device-cost" in str(w.message)]
    assert len(measuring) == 1


def test_a_measurement_that_fails_or_is_cut_short_uses_the_datasheet_and_says_so(measuring, monkeypatch):
    """Rule: where measuring raises (no kernel for the dtype) or ends with too few sizes (a busy machine), the
    datasheet break-even is used (the reasons say so) with a one-line warning, and nothing is cached."""
    def broken(device, dtype, budget_s=None):
        raise RuntimeError("no kernel for this dtype\nmore lines")

    monkeypatch.setattr(device_cost, "measure", broken)
    monkeypatch.setitem(gemm_cost.BREAK_EVEN, "cpu", gemm_cost.BreakEven(10 ** 12, 0))
    with pytest.warns(UserWarning, match=r"measuring torch.bfloat16 GEMMs on cpu failed \(no kernel for this dtype\)"):
        amp = ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),))
    assert "(datasheet)" in next(r.reason for r in amp.ampfx_report.compute if r.op == "linear")

    monkeypatch.setattr(device_cost, "measure", lambda device, dtype, budget_s=None: _table(NATIVE[:2]))
    device_cost.forget()
    with pytest.warns(UserWarning, match="ran out of its time budget"):
        ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),))
    assert not device_cost.cache_file().exists()


def test_gemm_min_flops_table_measures_nothing_and_a_device_without_an_entry_lowers_every_gemm(measuring):
    """Rule: gemm_min_flops="table" (AMPFX_GEMM_MIN_FLOPS=table) uses the datasheet without measuring; a device type
    neither measured nor in the datasheet has no break-even (every GEMM low)."""
    ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),), gemm_min_flops="table")
    assert measuring == []
    assert device_cost.limits(None, None, "mps", dtype=torch.bfloat16)[0] == gemm_cost.NONE
    assert measuring == []
    assert device_cost.limits("measure", None, "cpu", dtype=torch.bfloat16)[1]["flops"].startswith("measured on cpu")


def test_the_variable_takes_measure_and_table_and_refuses_other_words(monkeypatch):
    monkeypatch.setenv("AMPFX_GEMM_MIN_FLOPS", "tabel")
    with pytest.raises(ampfx.errors.PolicyError, match="AMPFX_GEMM_MIN_FLOPS='tabel'.*auto, measure, table"):
        ampfx.convert(Mlp(8), "bf16", example_inputs=(torch.randn(2, 8),))
    with pytest.raises(ampfx.errors.PolicyError, match="gemm_min_flops='sometimes'"):
        ampfx.Policy(gemm_min_flops="sometimes")
    assert ampfx.Policy(gemm_min_flops="Table").gemm_min_flops == "table"


def test_the_measurement_itself_runs_and_gives_a_table_within_its_budget():
    """The real microbenchmark on this machine, tiny budget: it returns a table whose measured sizes have times,
    skips what does not fit, and prints (the figures are the machine's; nothing is asserted of them)."""
    table = device_cost.measure("cpu", torch.bfloat16, budget_s=0.3)
    seen = [p for p in table.points if p.ratio is not None]
    assert seen and all(p.float32_s > 0 and p.low_s > 0 for p in seen)
    assert table.device.startswith("cpu: ") and table.dtype == "bfloat16"
    assert "break-even" in "\n".join(table.lines())
    again = Table.from_json(json.loads(json.dumps(table.to_json())))
    assert [(p.rows, p.width, p.low_s) for p in again.points] == [(p.rows, p.width, p.low_s) for p in table.points]


def test_ampfx_device_prints_the_table_and_its_cache_and_measures_again_on_request(measuring, tmp_path, capsys):
    """`ampfx device` prints the measured table, the break-even and where it is cached; a second run reads the
    cache; `--refresh` measures again; a device that cannot be used is one line, exit 2."""
    from ampfx.ui.cli import main
    assert main(["device"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16 against float32 (measured now" in out and "break-even: GEMMs of at least 33,554,432" in out
    assert str(tmp_path / "device-cost.json") in out
    device_cost.forget()
    assert main(["device"]) == 0 and len(measuring) == 1
    assert "(cached; measuring took" in capsys.readouterr().out
    assert main(["device", "--refresh"]) == 0 and len(measuring) == 2
    capsys.readouterr()
    assert main(["device", "--device", "nodevice"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device 'nodevice'" in err[0]


def test_a_break_even_given_whole_measures_nothing(measuring):
    """Rule: with both gemm_min_flops and gemm_min_rows given, nothing is measured (and nothing said of it)."""
    ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),), gemm_min_flops=10, gemm_min_rows=0)
    assert measuring == []


# between low neighbours (input and gradient arrive low): a small linear pays where its weight serves 64 rows
BETWEEN_LOW = (Point(64, 64, 1.0, 2.8, 1, (1.0, 0.8)), Point(16, 256, 1.0, 1.6, 1, (1.0, 1.2)),
               Point(64, 256, 1.0, 1.1, 1, (1.0, 0.7)), *NATIVE[3:])
# 3x3 convolutions: alone they pay from 2 * 512 * 64**2 * 9 FLOPs, between low neighbours at every size measured
CONVS = (Point(512, 16, 1.0, 1.3, 9, (1.0, 0.8)), Point(128, 64, 1.0, 1.1, 9, (1.0, 0.85)),
         Point(512, 64, 1.0, 0.6, 9), Point(512, 128, 1.0, 0.5, 9))


def test_convolutions_and_gemms_between_low_neighbours_have_break_evens_of_their_own():
    """Rule: convolutions are fitted on the convolutions measured, GEMMs between low neighbours on the sizes measured
    there (a size that pays alone pays there too); a table without them (too few convolutions, nothing measured
    between low neighbours: one cached by an older version) gives the linear layers' break-even alone for all.
    The cache keeps both."""
    table = _table((*BETWEEN_LOW, *CONVS))
    alone = gemm_cost.BreakEven(2 * 256 ** 3, 0)
    assert table.break_even() == alone
    assert table.break_even(between_low=True) == gemm_cost.BreakEven(2 * 64 ** 3, 64)
    assert table.break_even(conv=True) == gemm_cost.BreakEven(2 * 512 * 64 ** 2 * 9, 0)
    # every convolution measured pays between low neighbours: from the smallest measured, none is known below it
    assert table.break_even(conv=True, between_low=True) == gemm_cost.BreakEven(2 * 512 * 16 ** 2 * 9, 0)
    older = _table(NATIVE)
    assert {older.break_even(conv=c, between_low=b) for c in (False, True) for b in (False, True)} == {alone}
    again = Table.from_json(json.loads(json.dumps(table.to_json())))
    assert again.points == table.points
    text = "\n".join(table.lines())
    assert "conv3x3" in text and "convolutions' break-even" in text and "between low neighbours:" in text


def test_a_lone_small_size_that_pays_amid_larger_ones_that_lose_is_noise_not_a_break_even():
    """Rule: a threshold is kept only where it tells fewer measured sizes wrong than "never" does. The table is the
    shape of one measured on an AVX2-only CPU (bfloat16 emulated): the smallest convolution read 0.85x between low
    neighbours, every larger one 2-7x slower; that is no break-even from 589,824 FLOPs up. Each kind's "never" line
    names the largest size of its own kind measured."""
    convs = (Point(128, 16, 1.0, 1.01, 9, (1.0, 0.85)), Point(512, 16, 1.0, 2.97, 9, (1.0, 2.15)),
             Point(128, 64, 1.0, 6.0, 9, (1.0, 6.75)), Point(512, 32, 1.0, 5.8, 9, (1.0, 6.8)))
    table = _table((*EMULATED, *convs))
    assert {table.break_even(conv=c, between_low=b).never for c in (False, True) for b in (False, True)} == {True}
    text = "\n".join(table.lines())
    assert f"convolutions' break-even: the low dtype is slower than float32 at every size measured (up to " \
           f"{2 * 512 * 32 ** 2 * 9:,} FLOPs)" in text
    assert f"break-even: the low dtype is slower than float32 at every size measured (up to {2 * 64 * 1024 ** 2:,} " \
           "FLOPs)" in text
    # a lone paying size that is the largest measured still gives a break-even (nothing larger says otherwise)
    assert _table((Point(64, 64, 1.0, 3.0), Point(256, 256, 1.0, 2.0), Point(1024, 1024, 1.0, 0.6))).break_even() \
        == gemm_cost.BreakEven(2 * 1024 ** 3, 0)


class Widening(nn.Module):
    """A linear that pays alone (256 -> 256 over 512 rows) feeding a small one (256 -> 8)."""

    def __init__(self):
        super().__init__()
        self.big, self.small = nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x):
        return self.small(torch.relu(self.big(x)))


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.big, self.bn, self.small = nn.Conv2d(16, 64, 3, padding=1), nn.BatchNorm2d(64), nn.Conv2d(64, 16, 1)

    def forward(self, x):
        return self.small(torch.relu(self.bn(self.big(x))))


def test_a_small_gemm_between_low_neighbours_is_decided_by_that_break_even(measuring):
    """Rule: a GEMM kept float32 by its size alone, joined through infer and clear ops to one that runs low, sits
    between low neighbours: the break-even measured there decides it (it runs low where that casts fewer activation
    elements), and its reason names that break-even and the low GEMM. One whose region runs float32 (every GEMM
    small) stays float32; a table measured without it (the datasheet, an older cache) changes nothing."""
    measuring.use((*BETWEEN_LOW, *CONVS))
    x, model = torch.randn(512, 256), Widening()
    want = model(x)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    assert _rules(amp) == {"big": Rule.TABLE, "small": Rule.TABLE}
    reason = next(r.reason for r in amp.ampfx_report.compute if r.module == "small")
    assert "between low neighbours (linear runs low" in reason and "measured between low neighbours" in reason

    assert next(r for r in amp.ampfx_report.compute if r.module == "small").dtype == torch.bfloat16
    torch.testing.assert_close(amp(x), want, rtol=0.05, atol=0.05)

    alone = ampfx.convert(Mlp(64), "bf16", example_inputs=(torch.randn(32, 64),))  # no GEMM of it runs low
    assert set(_rules(alone).values()) == {Rule.COST_SMALL_GEMM}

    conv = ampfx.convert(ConvBlock(), "bf16", example_inputs=(torch.randn(2, 16, 32, 32),))
    decided = {r.module: r for r in conv.ampfx_report.compute if r.op == "conv2d"}
    assert decided["big"].rule is Rule.TABLE and decided["small"].dtype == torch.bfloat16
    assert "measured for convolutions between low neighbours" in decided["small"].reason

    measuring.use(NATIVE)
    device_cost.forget()
    device_cost.cache_file().unlink()
    before = ampfx.convert(Widening(), "bf16", example_inputs=(x,))
    assert _rules(before) == {"big": Rule.TABLE, "small": Rule.COST_SMALL_GEMM}
    from ampfx.tools.measure import measure_step
    moved = [measure_step(lambda m=m: m(x).float().sum().backward()).bytes for m in (amp, before)]
    assert moved[0] < moved[1] * 0.6  # relu's output reaches small low, uncast: its weight is cast instead


def test_a_region_that_would_cast_more_keeps_its_small_gemms_float32_and_says_why(measuring, monkeypatch):
    """Rule: where painting the region with its small GEMMs low casts more activation elements (a value of it stays
    float32 for another reason), they stay float32, and the reason says what lowering them would cast."""
    from ampfx.passes import between_low
    measuring.use((*BETWEEN_LOW, *CONVS))
    painted = between_low._painted_casts
    seen = []

    def more_when_lowered(gm, ctx, records, paint):
        seen.append(painted(gm, ctx, records, paint))
        return 1000 * len(seen)  # each trial casts more than the plan before it
    monkeypatch.setattr(between_low, "_painted_casts", more_when_lowered)
    amp = ampfx.convert(Widening(), "bf16", example_inputs=(torch.randn(512, 256),))
    assert len(seen) == 2 and seen[1] < seen[0]  # really fewer: the refusal comes from the patched count alone
    small = next(r for r in amp.ampfx_report.compute if r.module == "small")
    assert small.rule is Rule.COST_SMALL_GEMM and small.dtype == torch.float32
    assert "would pay, but lowering it with its region casts 1,000 more activation elements" in small.reason


def test_calibration_and_tuning_keep_a_small_gemm_float32_between_low_neighbours_too(measuring):
    """Rule: a GEMM kept float32 by its size is given the low dtype back between low neighbours only where a GEMM
    free to be low would be: calibration that saw it overflow the low dtype, or a tuned policy naming it, keeps it
    float32."""
    measuring.use((*BETWEEN_LOW, *CONVS))
    x = torch.randn(512, 256)
    small = next(r for r in ampfx.convert(Widening(), "bf16", example_inputs=(x,)).ampfx_report.compute
                 if r.module == "small")
    assert small.dtype == torch.bfloat16
    tuned = ampfx.convert(Widening(), "bf16", example_inputs=(x,), tuned=((small.key, "metric 1 -> 2"),))
    assert _rules(tuned) == {"big": Rule.TABLE, "small": Rule.COST_SMALL_GEMM}

    loud = Widening()
    with torch.no_grad():
        loud.small.weight.mul_(1e5)  # its output overflows float16
    amp = ampfx.convert(loud, "fp16", example_inputs=(x,), calibrate=[x])
    assert _rules(amp)["small"] is Rule.COST_SMALL_GEMM
    quiet = ampfx.convert(Widening(), "fp16", example_inputs=(x,), calibrate=[x])
    assert _rules(quiet)["small"] is Rule.TABLE  # the same without the overflow: low
