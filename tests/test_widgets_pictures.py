"""Every explorer carries a picture of its state (`picture_png`, `image/png` in its display bundle) for the docs site,
which cannot run widgets: the PNG decodes, is drawn at 72 dpi (small), and changes when the state does."""
import io

import pytest
from PIL import Image

from grpo_lab import widgets
from grpo_lab.async_grpo import StalenessExplorer
from grpo_lab.widgets import AdvantageExplorer, BatchExplorer, NormalizationExplorer, TrainingDashboard


def decoded(png: bytes) -> Image.Image:
    "The PNG decoded by PIL (raises on a broken one)."
    image = Image.open(io.BytesIO(png))
    image.load()
    return image


def bundle_png(explorer) -> bytes:
    bundle = explorer._repr_mimebundle_()
    assert bundle["text/plain"] == explorer.text()
    return bundle["image/png"]


def logs(steps):
    "What a trainer sends a callback, for `steps` steps."
    from transformers import TrainerControl, TrainerState
    state, control = TrainerState(max_steps=len(steps)), TrainerControl()
    return state, control, [{"loss": 0.1 * s, "reward": 0.2 * s, "kl": 0.01 * s} for s in steps]


def feed(dashboard, steps):
    state, control, entries = logs(steps)
    for step, entry in zip(steps, entries):
        state.global_step = step
        dashboard.on_log(None, state, control, logs=entry)


def change_batch(bx): bx.controls["num_processes"].value = 2
def change_normalization(nx): nx.lengths.value = "3, 30, 4, 8"
def change_advantages(ax): ax.rewards.value = "correct: 1, 0, 0, 0 | 1, 1, 0, 1"; ax.reward_weights.value = ""
def change_dashboard(dash): feed(dash, [3, 4])
def change_staleness(sx): sx.slider.value = 0


def staleness_records():
    "Two recorded async runs (as `run_record` writes them), one synchronous and one at max_staleness=2."
    def record(s, dropped, ratio):
        return {"max_staleness": s, "reward": [-6.0, -5.0, -4.0, -3.0 + s], "staleness": [0.0, min(s, 1.0), s, s],
                "ratio_min": [1.0, ratio, ratio, ratio], "ratio_mean": [1.0, 1.0, 0.98, 0.97], "dropped": dropped,
                "length": [6.0, 5.0, 4.0, 3.0], "completions_per_s": 100.0 + 20 * s}
    return [record(0, [0.0] * 4, 1.0), record(2, [0.0, 0.0, 8.0, 0.0], 0.8)]


EXPLORERS = {
    "BatchExplorer": (lambda: BatchExplorer(per_device_train_batch_size=4, num_generations=4, num_processes=1), change_batch),
    "NormalizationExplorer": (NormalizationExplorer, change_normalization),
    "AdvantageExplorer": (AdvantageExplorer, change_advantages),
    "TrainingDashboard": (lambda: _fed_dashboard(), change_dashboard),
    "StalenessExplorer": (lambda: StalenessExplorer(staleness_records()), change_staleness),
}


def _fed_dashboard():
    dash = TrainingDashboard()
    feed(dash, [1, 2])
    return dash


@pytest.mark.parametrize("name", EXPLORERS)
def test_each_explorer_carries_a_picture_that_follows_its_state(name):
    make, change = EXPLORERS[name]
    explorer = make()
    before = bundle_png(explorer)
    image = decoded(before)
    assert image.format == "PNG" and image.width <= 10 * 72 and image.height <= 5 * 72      # 72 dpi, at most 10 x 5 in
    assert before == explorer.picture_png()
    change(explorer)
    after = bundle_png(explorer)
    decoded(after)
    assert after != before, f"{name}: the picture did not change with the state"


def test_the_picture_sits_beside_the_widget_in_a_kernel(monkeypatch):
    monkeypatch.setattr(widgets, "in_notebook", lambda: True)
    nx = NormalizationExplorer()
    bundle = nx._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "image/png", "application/vnd.jupyter.widget-view+json"}
    assert bundle["image/png"] == bytes(nx.picture.value)           # the same PNG the widget shows


def test_no_picture_for_an_error_or_before_the_first_log():
    bx = BatchExplorer(per_device_train_batch_size=1, num_processes=7, num_generations=8)     # TRL refuses it
    assert bx.picture_png() is None and "image/png" not in bx._repr_mimebundle_()
    nx = NormalizationExplorer(values="1, 0")                                               # 4 lengths, 2 rewards
    assert isinstance(nx.state, ValueError) and nx.picture_png() is None
    assert TrainingDashboard().picture_png() is None


def test_the_docs_page_shows_a_widgets_text_and_its_picture():
    "docs/build.py splits a widget cell's bundle in two outputs: a page would show only the picture of one holding both."
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("docs_build", Path(__file__).resolve().parents[1] / "docs" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    nx = NormalizationExplorer()
    cell = {"cell_type": "code", "source": "nx", "metadata": {}, "outputs": [
        {"output_type": "execute_result", "execution_count": None, "metadata": {},
         "data": {k: v for k, v in nx._repr_mimebundle_().items() if k in ("text/plain", "image/png")}}]}
    split = build.text_and_picture(cell)["outputs"]
    assert [sorted(o["data"]) for o in split] == [["text/plain"], ["image/png"]]
    assert split[0]["output_type"] == "execute_result" and split[1]["data"]["image/png"] == nx.picture_png()
    stream = {"cell_type": "code", "source": "print(1)", "metadata": {}, "outputs": [{"output_type": "stream", "text": "1"}]}
    assert build.text_and_picture(stream) == stream
