"""distill.ema_decay: the weight average's arithmetic, and a run that trains on its own weights, evaluates and
exports the average, and resumes it from a checkpoint. Tiny models, CPU."""

import pytest
import torch
from safetensors.torch import load_file

from common.config import ConfigError, load_config
from common.models import load_model
from decode.eval_results import training_recipe
from decode.report import recipe_lines
from distill.training.weight_average import WeightAverage
from tests.synthetic_shards import write_scored_shards
from tests.test_train import ROOT, run


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """24 train + 8 eval rows scored by tiny:target (top-8 cache), as tests/test_train.py's."""
    return write_scored_shards(tmp_path_factory.mktemp("data"), load_model("tiny:target"))


def test_the_average_is_the_plain_mean_then_exponential():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    frozen = model.bias.detach().clone()
    average = WeightAverage(model.parameters(), decay=0.75)  # 1 / (1 - 0.75) = 4 steps of plain mean
    seen = []
    for step in range(1, 8):
        with torch.no_grad():
            model.weight.copy_(torch.randn(2, 3))
        seen.append(model.weight.detach().clone())
        average.update(step)
        if step <= 4:
            expected = torch.stack(seen).mean(0)
        else:  # the mean of the first 4, then each later step weighted 0.25 · 0.75^(steps after it)
            later = len(seen) - 4
            expected = 0.75 ** later * torch.stack(seen[:4]).mean(0)
            expected += sum(0.25 * 0.75 ** (len(seen) - 1 - j) * seen[j] for j in range(4, len(seen)))
        torch.testing.assert_close(average.average[0], expected)
    assert len(average.average) == 1 and torch.equal(model.bias, frozen)

    trained, mean = model.weight.detach().clone(), average.average[0].clone()
    with average.swapped_in():
        assert torch.equal(model.weight, mean)
    assert torch.equal(model.weight, trained) and torch.equal(average.average[0], mean)


def trainable_names(folder):
    return [name for name, p in load_model(str(folder)).named_parameters() if p.requires_grad]


def averaged(checkpoint, names):
    saved = torch.load(checkpoint / "custom_checkpoint_1.pkl", weights_only=True)["average"]
    return dict(zip(names, saved, strict=True))


def test_a_run_trains_on_its_own_weights_and_exports_the_average_even_after_a_resume(data, tmp_path):
    steps = ["distill.max_steps=6", "distill.eval_every=6", "distill.save_every=3"]  # one evaluation: final = step 6
    run(data, tmp_path / "plain", *steps)
    run(data, tmp_path / "ema", *steps, "distill.ema_decay=0.5")
    summary = run(data, tmp_path / "resumed", *steps, "distill.ema_decay=0.5", "distill.stop_after=4")
    assert summary["stopped"] == "interrupted"
    run(data, tmp_path / "resumed", *steps, "distill.ema_decay=0.5")

    plain, ema = load_file(tmp_path / "plain/checkpoints/step-6/model.safetensors"), \
        load_file(tmp_path / "ema/checkpoints/step-6/model.safetensors")
    assert plain.keys() == ema.keys() and all(torch.equal(plain[k], ema[k]) for k in plain)  # training untouched

    names = trainable_names(tmp_path / "ema/final")
    average = averaged(tmp_path / "ema/checkpoints/step-6", names)
    exported = load_file(tmp_path / "ema/final/model.safetensors")
    assert all(torch.equal(exported[name], average[name]) for name in names)
    assert not all(torch.equal(ema[name], average[name]) for name in names)  # the average, not the last step
    resumed = averaged(tmp_path / "resumed/checkpoints/step-6", names)
    assert all(torch.equal(resumed[name], average[name]) for name in names)
    # eval-speedup's report says the draft it measured is an average
    line, = recipe_lines({"draft": {"recipe": training_recipe(tmp_path / "ema/final")}})
    assert "; weights averaged (ema_decay 0.5);" in line


def test_a_decay_outside_zero_to_one_is_refused():
    for value in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match=r"distill.ema_decay=.* must be in \[0, 1\)"):
            load_config(ROOT / "configs/tiny.yaml", [f"distill.ema_decay={value}"])
