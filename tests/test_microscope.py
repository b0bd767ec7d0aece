"""The step microscope on real steps of the tiny model, and its diagnosis of a real run's completion logs."""
import contextlib
import io
import json

import pytest
import torch
from datasets import Dataset

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.cli import demo_problems
from grpo_lab.loss import grpo_loss
from grpo_lab.microscope import StepMicroscope, diagnose_completions, read_completions, step_table
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer


def _tiny_trainer(output_dir, dataset, **overrides):
    settings = dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=5, learning_rate=3e-5,
                    max_steps=1, seed=0, report_to="none")
    return GRPOTrainer(str(tiny_model_path()), exact_answer, args=GRPOConfig(output_dir=str(output_dir),
                                                                             **{**settings, **overrides}),
                       train_dataset=dataset)


@pytest.fixture(scope="module")
def train_set():
    return demo_problems("tiny", seed=0, eval_size=10)[1]


@pytest.fixture(scope="module")
def scope(tmp_path_factory, train_set):
    "A microscope over the first batch of a run on the demo task: 2 prompts x 8 completions (07b_microscope's)."
    trainer = _tiny_trainer(tmp_path_factory.mktemp("scope"), train_set.select(range(64)))
    microscope = StepMicroscope(trainer)
    microscope.trainer_model = trainer.model
    return microscope


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, train_set):
    """A microscope over a batch of two prompts whose answers have 2 and 3 characters, so completion lengths differ;
    its completion 0 is called right in the steps below, so that its group's advantages are not all 0."""
    rows = train_set.select(range(200)).to_list()
    two, three = (next(r for r in rows if len(r["answer"]) == n) for n in (2, 3))
    return StepMicroscope(_tiny_trainer(tmp_path_factory.mktemp("mixed"), Dataset.from_list([two, three])))


def test_the_update_moves_positive_advantage_tokens_up(scope):
    base = scope.base
    mask = base.mask.bool()
    adv = base.advantages[:, None].expand_as(base.moved)
    up, down = base.moved[mask & (adv > 0)], base.moved[mask & (adv < 0)]
    assert len(up) and len(down), "the batch must hold right and wrong completions"
    assert up.mean() > 0.01 and down.mean() < -0.01, (up.mean(), down.mean())
    with torch.no_grad():       # the step ran on a copy: the trainer's weights are where they were
        for kept, trained in zip(scope.model.parameters(), scope.trainer_model.parameters()):
            assert torch.equal(kept, trained)


def test_the_explorer_pictures_the_counterfactual_for_the_site(scope):
    "MicroscopeExplorer's bundle carries the changed step's plot (`picture_png`), and a new change draws a new one."
    from grpo_lab.microscope import MicroscopeExplorer
    explorer = MicroscopeExplorer(scope)
    first = explorer._repr_mimebundle_()["image/png"]
    assert first.startswith(b"\x89PNG") and first == bytes(explorer.picture.value)
    explorer.controls["epsilon"].value = 0.05
    assert explorer._repr_mimebundle_()["image/png"] != first
    explorer.reward.value = "one"                                     # a bad value: words, no picture
    assert explorer.picture_png() is None and "image/png" not in explorer._repr_mimebundle_()


def test_a_flipped_reward_turns_the_completion_around(scope):
    texts, rewards = scope.texts, scope.rewards.tolist()
    unique_wrong = [i for i, t in enumerate(texts) if texts.count(t) == 1 and rewards[i] == 0]
    assert unique_wrong, texts
    flipped_sign = []
    for i in unique_wrong:
        what_if = scope.counterfactual(rewards={i: 1.0})
        assert what_if.base.advantages[i] < 0 < what_if.changed.advantages[i]
        assert what_if.changed.sequence_moved[i] > what_if.base.sequence_moved[i], i
        if what_if.base.sequence_moved[i] < 0 < what_if.changed.sequence_moved[i]:
            flipped_sign.append(i)
            assert i in what_if.flipped()
    assert flipped_sign, "no wrong answer called right moved the other way"


def _loss_of(logps, scope, result, loss_type):
    "grpo_loss of the batch at `logps (N, T)`, with the step's old log-probs and advantages, in float64."
    return grpo_loss(logps, result.before.double(), result.advantages.double(), result.mask.double(),
                     loss_type=loss_type, max_completion_length=scope.args.max_completion_length)[0]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_gradient_weights_are_the_loss_types_coefficients(mixed, loss_type):
    scope = mixed
    result = scope.step(rewards={0: 1.0}, loss_type=loss_type)
    w, mask, adv = result.weights, result.mask, result.advantages
    lengths, n = mask.sum(-1), len(mask)
    assert len(set(lengths[adv != 0].tolist())) > 1, "completions of different lengths tell the loss types apart"
    expected = {"dapo": adv[:, None] / mask.sum(), "bnpo": adv[:, None] / mask.sum(),
                "grpo": adv[:, None] / (n * lengths[:, None]),
                "dr_grpo": adv[:, None] / (n * scope.args.max_completion_length)}[loss_type] * mask
    torch.testing.assert_close(w, expected, rtol=1e-4, atol=1e-8)
    if loss_type == "grpo":       # each completion's weights sum to A_i / N
        torch.testing.assert_close(w.sum(-1), adv / n, rtol=1e-4, atol=1e-8)
    # against grpo_lab's loss on the same tensors: a central difference along a random direction is -sum(w * d)
    direction = torch.randn(w.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * mask
    x, h = result.before.double(), 1e-4
    slope = (_loss_of(x + h * direction, scope, result, loss_type)
             - _loss_of(x - h * direction, scope, result, loss_type)) / (2 * h)
    torch.testing.assert_close(slope.item(), -(w.double() * direction).sum().item(), rtol=1e-3, atol=1e-7)


def test_loss_types_differ_on_completions_of_different_lengths(mixed):
    grpo, dapo = (mixed.step(rewards={0: 1.0}, loss_type=t) for t in ("grpo", "dapo"))
    assert not torch.allclose(grpo.weights, dapo.weights)
    assert not torch.allclose(grpo.after, dapo.after)


def test_diagnosis_of_a_real_run(tmp_path, train_set):
    trainer = _tiny_trainer(tmp_path, train_set.select(range(200)), per_device_train_batch_size=32,
                            max_completion_length=3, learning_rate=3e-4, max_steps=3, logging_steps=1,
                            log_completions=True, disable_tqdm=True)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    files = sorted((tmp_path / "completions").glob("completions_*.parquet"))
    assert [f.name for f in files] == [f"completions_{s:05d}.parquet" for s in (1, 2, 3)]
    logged = read_completions(tmp_path)
    assert list(logged.columns[:3]) == ["step", "prompt", "completion"] and "exact_answer" in logged.columns
    assert logged.groupby("step").group.nunique().tolist() == [4, 4, 4]
    diagnosis = diagnose_completions(tmp_path, tokenizer=trainer.processing_class, max_completion_length=3)
    history = {h["step"]: h for h in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
               if "reward" in h}
    table = diagnosis.table
    for step in (1, 2, 3):      # the trainer's own metrics for the same batches
        assert table.zero_variance[step] == pytest.approx(history[step]["frac_reward_zero_std"], abs=1e-6)
        assert table.reward[step] == pytest.approx(history[step]["reward"], abs=1e-5)
        assert table.truncated[step] == pytest.approx(history[step]["completions/clipped_ratio"], abs=1e-6)
    estimated = step_table(logged, trainer.processing_class, max_completion_length=3).truncated
    assert (estimated - table.truncated).abs().max() < 0.05, "the text-only estimate of truncation"
    assert table.truncated.mean() > 0.2, "3 tokens are too few for a 3-digit answer and its end-of-text token"
    zero = f"{table.zero_variance.mean():.0%} of the groups had zero reward variance"
    assert diagnosis.findings[0].startswith(zero)
    assert diagnosis.findings[1].startswith(f"{table.truncated.mean():.0%} of completions were cut at the length limit")
    assert "raise max_completion_length" in diagnosis.findings[1]
    assert any(f.startswith("The mean reward") for f in diagnosis.findings)
    files_only = diagnose_completions(files)
    assert files_only.findings[1].startswith("The truncation rate is unknown")
    assert files_only.table.zero_variance.tolist() == table.zero_variance.tolist()


def test_diagnosis_reads_conversational_logs(tmp_path):
    "TRL's conversational rows (lists of messages) are grouped by conversation and measured by their text."
    import pandas as pd
    (tmp_path / "completions").mkdir()
    prompt = lambda q: [{"role": "user", "content": q}]
    reply = lambda a: [{"role": "assistant", "content": a}]
    pd.DataFrame({"step": [2] * 4, "prompt": [prompt("1+1?")] * 2 + [prompt("2+2?")] * 2,
                  "completion": [reply("2"), reply("3"), reply("4"), reply("4")],
                  "correct": [1.0, 0.0, 1.0, 1.0], "advantage": [0.7, -0.7, 0.0, 0.0]}
                 ).to_parquet(tmp_path / "completions" / "completions_00002.parquet")
    diagnosis = diagnose_completions(tmp_path)
    row = diagnosis.table.loc[2]
    assert (row.groups, row.zero_variance, row.all_best, row.length) == (2, 0.5, 0.5, 1.0)
    with pytest.raises(FileNotFoundError, match="log_completions=True"):
        read_completions(tmp_path / "nothing")


@pytest.mark.slow
def test_diagnosis_of_a_real_trl_run(tmp_path, train_set):
    "TRL 1.16's own completion files (log_completions=True) read the same way, and agree with TRL's logged metrics."
    trl = pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM
    from grpo_lab.models import tiny_tokenizer
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=8,
                          max_completion_length=3, learning_rate=3e-4, max_steps=2, logging_steps=1,
                          log_completions=True, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                          seed=0)
    trainer = trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(tiny_model_path())),
                              reward_funcs=exact_answer, args=args, train_dataset=train_set.select(range(64)),
                              processing_class=tiny_tokenizer())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    assert sorted(p.name for p in (tmp_path / "completions").glob("*.parquet")) == \
        ["completions_00001.parquet", "completions_00002.parquet"]
    diagnosis = diagnose_completions(tmp_path, tokenizer=tiny_tokenizer(), max_completion_length=3)
    logged = {h["step"]: h for h in trainer.state.log_history if "reward" in h}
    for step in (1, 2):     # no metrics.jsonl in a TRL run: the truncation rate is the estimate from the text
        assert diagnosis.table.zero_variance[step] == pytest.approx(logged[step]["frac_reward_zero_std"], abs=1e-6)
        assert diagnosis.table.reward[step] == pytest.approx(logged[step]["reward"], abs=1e-5)
        assert diagnosis.table.truncated[step] == pytest.approx(logged[step]["completions/clipped_ratio"], abs=0.07)
