"""ampfx.tools.tune: the nodes a metric needs kept float32, found in O(log n) metric evaluations; policy files."""
import datetime
import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.errors import ArgumentError
from ampfx.report.records import Rule
from support.models import Offsets  # tests/support/models.py: a deep MLP with precision-critical (y + c) - c adds


class Counted:
    """A metric (minus the mean squared error to the float32 model's output) that counts its calls."""

    def __init__(self, model, x):
        self.x, self.calls = x, 0
        with torch.no_grad():
            self.want = model(x)

    def __call__(self, module):
        self.calls += 1
        with torch.no_grad():
            return -float((module(self.x).float() - self.want).pow(2).mean())


def _setup(**kw):
    torch.manual_seed(0)
    model, x = Offsets(**kw), torch.randn(32, 16)
    return model, x, Counted(model, x)


def _bound(n, k):
    """float32 model + default plan + all-float32 check + bisection + shrinking k needed nodes."""
    log = math.ceil(math.log2(max(n, 2)))
    return 3 + log + 2 * k * log


def test_one_critical_accumulation_is_the_one_node_kept_float32():
    model, x, metric = _setup()
    amp = ampfx.tune(model, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-4, progress=False)
    t = amp.ampfx_tune
    assert t.evaluations == metric.calls and t.complete
    assert t.metric_default < -1e-3  # the default plan is far off: the test has something to tune
    assert t.metric_tuned >= t.metric_float32 - 1e-4 and metric(amp) == pytest.approx(t.metric_tuned)
    assert t.kept == ("add",)
    assert [r.key for r in amp.ampfx_report.records if r.rule == Rule.TUNE] == ["add"]
    assert t.evaluations <= _bound(t.candidates, 1) and t.evaluations < t.candidates  # not one per node
    reason = amp.ampfx_report.by_node("add").reason
    assert f"{t.metric_default:.6g} with the default plan -> {t.metric_tuned:.6g}" in reason


def test_two_critical_accumulations_both_kept_and_nothing_else():
    model, x, metric = _setup(offsets=(512.0, 1024.0))
    amp = ampfx.tune(model, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-4, progress=False)
    t = amp.ampfx_tune
    assert sorted(t.kept) == ["add", "add_1"]
    assert t.evaluations == metric.calls <= _bound(t.candidates, 2)
    assert t.metric_tuned >= t.metric_float32 - 1e-4


def test_a_default_plan_within_tolerance_is_returned_as_it_is():
    model, x, metric = _setup()
    amp = ampfx.tune(model, "bf16", example_inputs=(x,), metric=metric, tolerance=10.0, progress=False)
    assert amp.ampfx_tune.kept == () and amp.ampfx_tune.evaluations == metric.calls == 2
    assert not any(r.rule == Rule.TUNE for r in amp.ampfx_report.records)


def test_the_budget_is_respected_and_the_plan_returned_still_meets_the_tolerance():
    model, x, metric = _setup()
    amp = ampfx.tune(model, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-4, budget=4, progress=False)
    t = amp.ampfx_tune
    assert metric.calls == t.evaluations == 4 and not t.complete
    assert t.metric_tuned >= t.metric_float32 - 1e-4 and "budget spent" in str(t)
    timed = ampfx.tune(model, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-4,
                       budget=datetime.timedelta(microseconds=1), progress=False)
    assert timed.ampfx_tune.evaluations == 3 and not timed.ampfx_tune.complete


def test_progress_is_printed_per_evaluation(capsys):
    model, x, metric = _setup()
    ampfx.tune(model, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-4)
    err = capsys.readouterr().err
    assert err.count("ampfx.tools.tune evaluation") == metric.calls and "meets" in err and "below" in err


def test_a_metric_no_plan_can_meet_is_a_tune_error():
    model, x, _ = _setup()
    draws = iter(range(1000))
    with pytest.raises(ampfx.TuneError, match="even with all .* deterministic"):
        ampfx.tune(model, "bf16", example_inputs=(x,), metric=lambda m: -float(next(draws)), tolerance=0.5,
                   progress=False)


def test_the_model_its_buffers_modes_and_the_random_state_are_left_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(16, 8)
    stats = model[1].running_mean.clone()
    rng = torch.get_rng_state()

    def metric(m):  # a train-mode metric: dropout draws and batch-norm updates; then eval
        out = m(x)
        m.eval()
        return -float(out.detach().pow(2).mean())

    amp = ampfx.tune(model, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-2, progress=False)
    assert torch.equal(model[1].running_mean, stats) and model.training and amp.training
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_tuned_policy_saves_and_loads_in_code_and_from_the_environment(tmp_path):
    model, x, metric = _setup()
    amp = ampfx.tune(model, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-4, progress=False)
    path = amp.ampfx_policy.save(tmp_path / "tuned.json")
    assert json.loads(path.read_text())["tuned"].keys() == {"add"}
    for again in (ampfx.convert(model, example_inputs=(x,), policy=ampfx.Policy.from_file(path)),
                  ampfx.convert(model, example_inputs=(x,), environ={"AMPFX_POLICY_FILE": str(path)})):
        d = again.ampfx_report.by_node("add")
        assert (d.rule, d.reason) == (Rule.TUNE, amp.ampfx_report.by_node("add").reason)
        assert torch.equal(again(x), amp(x))


@pytest.mark.parametrize("kw, match", [
    (dict(metric="loss"), "metric="),
    (dict(tolerance=-1.0), "tolerance="),
    (dict(tolerance=float("nan")), "tolerance="),
    (dict(tolerance=True), "tolerance="),
    (dict(budget=2), "budget="),
    (dict(budget="10"), "budget="),
    (dict(candidates=0), "candidates="),
    (dict(metric=lambda m: "good"), "return a number"),
])
def test_bad_arguments_name_themselves(kw, match):
    model, x, metric = _setup(depth=1)
    args = dict(example_inputs=(x,), metric=metric, tolerance=1e-4, progress=False) | kw
    with pytest.raises(ArgumentError, match=match):
        ampfx.tune(model, "bf16", **args)


def test_a_metric_not_finite_on_the_float32_model_is_an_error():
    model, x, _ = _setup(depth=1)
    with pytest.raises(ampfx.TuneError, match="float32 model is -inf"):
        ampfx.tune(model, "bf16", example_inputs=(x,), metric=lambda m: float("nan"), tolerance=1.0, progress=False)


# ---------------------------------------------------------------------- policy files
def test_a_policy_file_round_trips_every_field_it_holds(tmp_path):
    p = ampfx.Policy("fp16", denylist_add=("gelu",), inferlist_remove=("gelu",), fp32_modules=("head",),
                     reduction_threshold=4096, pad="never", float32_stream=False, sensitivity_threshold=None,
                     tuned={"head:linear": "tuned"})
    back = ampfx.Policy.from_file(p.save(tmp_path / "p.json"))
    assert back == p


def test_merging_a_file_adds_list_edits_and_takes_unset_fields(tmp_path):
    path = ampfx.Policy("fp16", denylist_add=("gelu",), inferlist_remove=("gelu",), pad="never").save(tmp_path / "p.json")
    net = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    amp = ampfx.convert(net, denylist_add=("tanh",), inferlist_remove=("tanh",),
                        environ={"AMPFX_POLICY_FILE": str(path)})
    rep = amp.ampfx_report
    assert rep.dtype == torch.float16 and rep.policy["pad"] == "never"
    assert rep.by_node("_1").rule == "env:AMPFX_POLICY_FILE"
    assert set(rep.policy["edits"]["denylist_add"]) == {"gelu", "tanh"}


@pytest.mark.parametrize("content, match", [
    ("{not json", "invalid JSON"),
    ('{"dtype": "bfloat16"}', "not an ampfx policy file"),
    ('{"format": "ampfx-policy/1", "dtype": "bfloat16", "reduction_treshold": 5}', "Did you mean 'reduction_threshold'"),
    ('{"format": "ampfx-policy/1", "dtype": "float64"}', "not a low-precision dtype"),
    ('{"format": "ampfx-policy/1", "dtype": "bfloat16", "denylist_add": ["softmx"]}', "Did you mean 'softmax'"),
])
def test_a_bad_policy_file_is_named(tmp_path, content, match):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ampfx.PolicyError, match=match):
        ampfx.Policy.from_file(path)
    with pytest.raises(ampfx.PolicyError, match="AMPFX_POLICY_FILE"):
        ampfx.convert(nn.Linear(2, 2), environ={"AMPFX_POLICY_FILE": str(path)})


def test_conflicts_between_the_call_and_the_file_are_errors(tmp_path):
    path = ampfx.Policy("fp16", reduction_threshold=100).save(tmp_path / "p.json")
    env = {"AMPFX_POLICY_FILE": str(path)}
    with pytest.raises(ampfx.PolicyError, match="saved for float16, but convert.. was given bfloat16"):
        ampfx.convert(nn.Linear(2, 2), "bf16", environ=env)
    with pytest.raises(ampfx.PolicyError, match="reduction_threshold=100, but convert.. was given reduction_threshold=5"):
        ampfx.convert(nn.Linear(2, 2), reduction_threshold=5, environ=env)
    with pytest.raises(ampfx.PolicyError, match="cannot read the policy file"):
        ampfx.convert(nn.Linear(2, 2), environ={"AMPFX_POLICY_FILE": str(tmp_path / "missing.json")})


def test_what_a_file_cannot_name_is_refused_when_saving(tmp_path):
    def local_op(x):
        return x

    with pytest.raises(ampfx.PolicyError, match="module_filter_fn"):
        ampfx.Policy(module_filter_fn=lambda m, fqn: True).save(tmp_path / "p.json")
    with pytest.raises(ampfx.PolicyError, match="cannot save denylist_add"):
        ampfx.Policy(denylist_add=(local_op,)).save(tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


def test_nodes_of_a_model_converted_region_by_region_are_tuned_by_their_module_key():
    class Branchy(nn.Module):  # data-dependent control flow: the root runs eagerly, children are graphs
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.out(self.fc(x).relu() if x.sum() > 0 else self.fc(x))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, h):
            return (self.lin(h) + 300.0) - 300.0

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = Branchy(), Head()

        def forward(self, x):
            h = self.enc(x)
            return self.head(h * 2 if h.mean() > 100 else h)

    torch.manual_seed(0)
    net, x = Net(), torch.randn(16, 8) + 0.5
    metric = Counted(net, x)
    amp = ampfx.tune(net, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-3, progress=False)
    assert amp.ampfx_tune.kept == ("head:add",)
    assert {r.key: r.rule for r in amp.ampfx_report.compute}["head:add"] == Rule.TUNE
    assert amp.ampfx_tune.metric_tuned >= -1e-3


@pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="torch.library.custom_op needs torch >= 2.4")
def test_a_custom_op_on_a_list_is_saved_by_its_name_and_found_again(tmp_path):
    @torch.library.custom_op("ampfx_tune_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    twice.register_fake(lambda x: torch.empty_like(x))
    path = ampfx.Policy(allowlist_add=(twice,)).save(tmp_path / "p.json")
    assert json.loads(path.read_text())["allowlist_add"] == ["ampfx_tune_test::twice"]
    assert ampfx.Policy.from_file(path).category_of("ampfx_tune_test::twice")[0] is ampfx.Category.ALLOW


# ------------------------------------------------------------------ metrics that train or return numpy
class Offset(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return (self.fc(x) + 300.0) - 300.0


def _offset():
    torch.manual_seed(0)
    net, x = Offset(), torch.randn(16, 8)
    with torch.no_grad():
        want = net(x)
    return net, x, want


@pytest.mark.usefixtures("one_thread")
def test_a_metric_that_trains_the_model_sees_the_same_weights_each_time_and_leaves_them():
    """A metric that takes an optimizer step (fine-tune, then measure) changed the user's float32 weights
    for good, and each evaluation started from other weights (the search then blamed determinism)."""
    net, x, want = _offset()
    before = {k: v.clone() for k, v in net.state_dict().items()}

    def metric(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        (m(x).float() - want).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            return -float((m(x).float() - want).pow(2).mean())

    amp = ampfx.tune(net, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-4, progress=False)
    assert amp.ampfx_tune.kept == ("add",)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.usefixtures("one_thread")
def test_a_numpy_float_metric_is_a_number():
    """np.float32 (np.mean of a float32 array) was rejected as 'not a number'."""
    net, x, want = _offset()
    amp = ampfx.tune(net, "bf16", example_inputs=(x,), tolerance=1e-4, progress=False,
                     metric=lambda m: np.float32(-(m(x).detach().float() - want).pow(2).mean().item()))
    assert amp.ampfx_tune.kept == ("add",)
