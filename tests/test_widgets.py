"""The widgets driven as a learner would, without a browser: set control values, click buttons, read what they show."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lab import widgets
from grpo_lab.batching import BatchConfigError, BatchPlan
from grpo_lab.widgets import AdvantageExplorer, BatchExplorer, NormalizationExplorer, TrainingDashboard

ROOT = Path(__file__).resolve().parents[1]

PNG = b"\x89PNG"


def shown_count(html: str, row: str) -> str:
    "The value a widget's HTML table shows in the row named `row`."
    return re.search(rf"{re.escape(row)}</td><td[^>]*>([^<]*)<", html).group(1)


def seven_gpus():
    "TRL 0.15's famous refusal: 7 GPUs x 1 completion each, 8 completions per prompt."
    return BatchExplorer(per_device_train_batch_size=1, num_processes=7, num_generations=8)


def test_batch_explorer_starts_from_an_invalid_configuration():
    bx = seven_gpus()
    assert isinstance(bx.state, BatchConfigError)
    assert "must be divisible by num_generations 8" in bx.summary.value
    assert [b.description for b in bx.suggestion_buttons] == [
        "num_generations=7", "per_device_train_batch_size=8", "gradient_accumulation_steps=8", "num_processes=8"]
    assert list(bx.fixes.children) == bx.suggestion_buttons and bx.picture.layout.display == "none"
    assert repr(bx).startswith("error: generation_batch_size 7") and "num_processes=8" in repr(bx)


@pytest.mark.parametrize("index", range(4))
def test_each_suggestion_button_gives_a_valid_plan(index):
    bx = seven_gpus()
    button = bx.suggestion_buttons[index]
    (name, value), = bx.state.suggestions[index].items()
    button.click()
    assert isinstance(bx.state, BatchPlan) and bx.controls[name].value == value
    assert bx.fixes.children == () and bx.picture.layout.display is None
    assert bytes(bx.picture.value).startswith(PNG)
    assert "one generation batch" in bx.summary.value and "error" not in repr(bx)
    assert bx.state.generation_batch_size % bx.state.num_generations == 0


def test_changing_a_control_updates_the_plan():
    bx = BatchExplorer(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_processes=3,
                       num_generations=6, dataset_size=8000)
    assert bx.state.optimizer_steps_per_epoch == 2000
    assert shown_count(bx.summary.value, "optimizer steps per epoch") == "2000"
    bx.controls["num_processes"].value = 6                       # 48 completions = 8 prompts per step
    assert bx.state.prompts_per_optimizer_step == 8 and bx.state.optimizer_steps_per_epoch == 1000
    assert shown_count(bx.summary.value, "optimizer steps per epoch") == "1000"
    bx.controls["dataset_size"].value = 0                        # 0: unknown
    assert bx.arguments["dataset_size"] is None
    assert shown_count(bx.summary.value, "optimizer steps in all") == "? (set dataset size)"
    bx.controls["num_generations"].value = 7                     # 24 x 2 = 48 completions: 48 % 7 != 0
    assert isinstance(bx.state, BatchConfigError) and bx.suggestion_buttons
    bx.suggestion_buttons[0].click()
    assert isinstance(bx.state, BatchPlan)


def test_batch_explorer_rejects_what_plan_batches_does_not_take():
    with pytest.raises(TypeError, match="num_processes"):
        BatchExplorer(num_gpus=8)
    with pytest.raises(TypeError, match="must be a whole number"):
        BatchExplorer(num_generations=2.5)


def test_normalization_explorer_shows_the_length_bias_and_zero_loss():
    nx = NormalizationExplorer()
    nx.lengths.value, nx.values.value = "4, 16, 4, 16", "1, 0, 0, 1"    # wrong answers: 16 and 4 tokens
    grpo, dr = nx.state["grpo"]["token_weights"], nx.state["dr_grpo"]["token_weights"]
    assert grpo[1] < 0 and grpo[2] < 0 and abs(grpo[1]) < abs(grpo[2])      # long wrong: pushed down less per token
    assert dr[1] == pytest.approx(dr[2])                                     # dr_grpo: the same
    assert nx.state["grpo"]["completion_weights"][1] == pytest.approx(nx.state["grpo"]["completion_weights"][2])
    assert nx.beta.value == 0 and nx.ratio.value == 1
    assert abs(nx.state["grpo"]["loss"]) < 1e-6 and nx.state["grpo"]["grad_norm"] > 0.1
    assert "grpo: the loss is 0 but the gradient norm" in nx.summary.value
    assert "(4x as much)" in nx.text() and bytes(nx.picture.value).startswith(PNG)


def test_normalization_explorer_beta_and_clipping():
    nx = NormalizationExplorer()
    before = nx.state["bnpo"]["token_weights"]
    nx.beta.value = 0.1                                                     # reference below current: pulls down
    assert all(w < v for w, v in zip(nx.state["bnpo"]["token_weights"], before))
    assert "loss is 0" not in nx.summary.value
    nx.beta.value, nx.ratio.value = 0.0, 1.3                                # right answers already moved too far
    assert [w for w, a in zip(nx.state["grpo"]["token_weights"], nx.advantages) if a > 0] == [0, 0]


def test_normalization_explorer_reports_bad_input():
    nx = NormalizationExplorer()
    nx.values.value = "1, 0, 1"
    assert isinstance(nx.state, ValueError) and "4 lengths and 3 rewards/advantages" in nx.summary.value
    assert nx.picture.layout.display == "none" and repr(nx).startswith("NormalizationExplorer: 4 lengths")
    nx.values.value = "1, 0, 1, 0"
    assert isinstance(nx.state, dict)


def test_advantage_explorer_zero_variance_and_unscorable():
    ax = AdvantageExplorer(rewards="correct: 1, 1, 1, 1 | 1, 0, None, 0\nformat: 0, 0, 0, 0 | 0.5, 0, None, 1",
                           reward_weights="1, 1")
    assert ax.num_generations == 4 and ax.state["zero_std_groups"] == [0]
    for mode in ("group", "batch", "none"):
        assert ax.state["advantages"][mode][:4] == [0, 0, 0, 0]               # zero variance: nothing to learn
        assert ax.state["advantages"][mode][6] == 0                           # unscorable: 0
    assert ax.state["scorable"][6] is False and ax.state["rewards"][6] is None
    assert ax.state["group_mean"][1] == pytest.approx((1.5 + 0 + 1) / 3)       # unscorable left out of the mean
    assert "zero-variance group" in ax.summary.value and "unscorable" in ax.summary.value
    assert "unscorable 1 of 8" in ax.text() and bytes(ax.picture.value).startswith(PNG)


def test_advantage_explorer_reacts_to_edits():
    ax = AdvantageExplorer()
    ax.rewards.value = "1, 0, 0, 0 | 1, 1, 0, 0"                           # one function, but two weights
    assert isinstance(ax.state, ValueError) and "2 values for 1 reward functions" in ax.summary.value
    ax.reward_weights.value = ""                                            # blank: all 1
    assert ax.names == ["reward 1"] and ax.state["zero_std_groups"] == []
    assert ax.state["advantages"]["none"][:4] == pytest.approx([0.75, -0.25, -0.25, -0.25])
    ax.rewards.value = "1, 0 | 1"
    assert isinstance(ax.state, ValueError) and "groups of sizes [1, 2]" in ax.summary.value


SAMPLES = [{"prompt": "12+7=", "completion": "<answer>19</answer>", "reward": 1.0},
           {"prompt": "12+7=", "completion": "18", "reward": 0.0}]


def feed(dash, steps=3):
    "What a GRPOTrainer sends a callback: HF's (args, state, control) and, on on_log, the step's completions."
    from transformers import TrainerControl, TrainerState
    state, control = TrainerState(max_steps=steps), TrainerControl()
    dash.on_train_begin(None, state, control)
    for step in range(1, steps + 1):
        state.global_step = step
        logs = {"epoch": step / 10, "loss": 0.0, "reward": 0.1 * step, "rewards/exact/mean": 0.1 * step,
                "kl": 0.01 * step, "completions/mean_length": 5.0, "clip_ratio/region_mean": 0.0, "grad_norm": 1.0}
        dash.on_log(None, state, control, logs=logs, completions=SAMPLES)
        state.log_history.append({**logs, "step": step})
    dash.on_train_end(None, state, control)


def test_dashboard_outside_a_notebook_records_and_prints_nothing(capsys):
    dash = TrainingDashboard()
    feed(dash)
    assert capsys.readouterr() == ("", "")
    assert dash.curves["reward"] == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3))]
    assert set(dash.curves) == {"loss", "reward", "rewards/exact/mean", "kl", "completions/mean_length",
                                "clip_ratio/region_mean"}                   # grad_norm is not drawn
    assert dash.samples[0]["completion"] == "<answer>19</answer>"
    assert dash.picture.value == b"" and dash.table.value == ""            # nothing drawn
    assert "step 3" in repr(dash) and "'<answer>19</answer>'" in repr(dash)


def test_dashboard_in_a_notebook_draws_curves_and_samples(monkeypatch):
    monkeypatch.setattr(widgets, "in_notebook", lambda: True)
    shown = []
    monkeypatch.setattr(widgets, "display", shown.append)
    dash = TrainingDashboard(min_interval=0)
    feed(dash)
    assert shown == [dash]                                                  # shown once, at on_train_begin
    assert bytes(dash.picture.value).startswith(PNG)
    assert "&lt;answer&gt;19&lt;/answer&gt;" in dash.table.value and "step 3" in dash.title.value
    bundle = dash._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["text/plain"].startswith("step 3")


def test_explorers_show_text_without_a_kernel_and_the_widget_with_one(monkeypatch):
    bx = seven_gpus()
    assert set(bx._repr_mimebundle_()) == {"text/plain"}
    monkeypatch.setattr(widgets, "in_notebook", lambda: True)
    bundle = bx._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == bx.widget.model_id
    assert bundle["text/plain"] == repr(bx)


def test_importing_the_explorers_does_not_import_the_trainer():
    code = "import sys, grpo_lab.widgets; assert 'grpo_lab.trainer' not in sys.modules, 'trainer imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_training_dashboard_is_a_trainer_callback_in_a_real_run(tmp_path):
    from transformers import TrainerCallback
    from grpo_lab.data import arithmetic_task
    from grpo_lab.models import tiny_model_path
    from grpo_lab.rewards import exact_answer
    from grpo_lab.trainer import GRPOConfig, GRPOTrainer
    dashboard = TrainingDashboard()
    assert isinstance(dashboard, TrainerCallback)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, beta=0.04,
                      max_completion_length=4, max_steps=2, logging_steps=1, disable_tqdm=True,
                      gradient_checkpointing=False, save_strategy="no")
    trainer = GRPOTrainer(tiny_model_path(), exact_answer, args=args, train_dataset=arithmetic_task(16),
                          callbacks=[dashboard])
    trainer.train()
    assert [step for step, _ in dashboard.curves["reward"]] == [1, 2] and len(dashboard.curves["kl"]) == 2
    assert len(dashboard.samples) == 8 and dashboard.total_steps == 2


IPYWIDGETS_7 = ROOT / ".cache" / "ipywidgets-7.7.1"


def test_the_widgets_work_under_colabs_ipywidgets_7(tmp_path):
    "Colab ships ipywidgets 7.7.1: the same tests pass with it first on the path (installed once, without dependencies)."
    if not (IPYWIDGETS_7 / "ipywidgets").exists():
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(IPYWIDGETS_7),
                            "ipywidgets==7.7.1", "widgetsnbextension~=3.6.0", "jupyterlab_widgets>=1.0.0,<3",
                            "ipython_genutils"], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"could not install ipywidgets 7.7.1 from the package registry: {r.stderr[-300:]}")
    env = {**os.environ, "PYTHONPATH": str(IPYWIDGETS_7), "MPLBACKEND": "Agg"}
    check = subprocess.run([sys.executable, "-c", "import ipywidgets; print(ipywidgets.__version__)"], env=env,
                           capture_output=True, text=True)
    assert check.stdout.strip() == "7.7.1"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                        "-k", "not ipywidgets_7"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
