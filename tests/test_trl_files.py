"""The files a run leaves and the keys it logs, against TRL 1.16 on identical tiny settings.

Each test runs TRL's GRPOTrainer and grpo-lab's on the shipped tiny model with the same options (two steps, a
checkpoint at step 2, `log_completions=True`) and compares names: the files in `output_dir`, in the checkpoint and in
a `save_model` folder, and the keys of each log entry. What differs on purpose is listed with its reason; anything else
that differs fails the test."""
import warnings

import pytest
import torch
from datasets import Dataset

from grpo_lab.models import tiny_model_path

OPTIONS = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=2, logging_steps=1,
               save_steps=2, report_to="none", disable_tqdm=True, log_completions=True, learning_rate=1e-3,
               gradient_checkpointing=False, use_cpu=True)

# grpo-lab's own files, each with why it exists
OURS_ONLY_IN_OUTPUT_DIR = {
    "metrics.jsonl": "grpo-lab writes each log entry as a JSON line too, so a run can be read without a tracker",
}
OURS_ONLY_IN_CHECKPOINT = {
    "grpo_lab_state.json": "grpo-lab's resume check: process count, batch options and the adaptive entropy state",
    "process_0.pt": "each process's resume point (stream position, an unfinished rollout, its random state)",
}
TRLS_ONLY_IN_CHECKPOINT = {
    "rng_state.pth": "grpo-lab keeps the random state in process_<rank>.pt beside the stream position",
}
OURS_ONLY_IN_SAVED_MODEL = {
    "README.md": "save_model writes a model card beside the weights, so a saved folder says what it holds",
}


def reward_len(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def names(folder) -> set[str]:
    "Every file and folder under `folder`, as paths relative to it."
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def run(module, out):
    "Train two steps with `module`'s GRPOConfig and GRPOTrainer; the trainer, the files after train() and save_model."
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = module.GRPOTrainer(model=str(tiny_model_path()), reward_funcs=reward_len,
                                     args=module.GRPOConfig(output_dir=str(out), **OPTIONS),
                                     train_dataset=Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(16)]))
        trainer.train()
        after_train = names(out)
        trainer.save_model(str(out.parent / f"{out.name}-model"))
    return trainer, after_train


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    trl = pytest.importorskip("trl")
    import grpo_lab
    base = tmp_path_factory.mktemp("files")
    theirs, theirs_files = run(trl, base / "trl")
    ours, ours_files = run(grpo_lab, base / "lab")
    return dict(trl=theirs, lab=ours, trl_files=theirs_files, lab_files=ours_files, base=base)


def test_a_checkpoint_holds_trls_files(runs):
    "checkpoint-2 holds TRL's files (weights, tokenizer, optimizer, scheduler, state, training_args.bin)."
    theirs, ours = names(runs["base"] / "trl" / "checkpoint-2"), names(runs["base"] / "lab" / "checkpoint-2")
    assert ours - theirs == set(OURS_ONLY_IN_CHECKPOINT)
    assert theirs - ours == set(TRLS_ONLY_IN_CHECKPOINT)
    assert "training_args.bin" in ours


def test_save_model_writes_trls_files(runs):
    "save_model(dir) writes what TRL's does, training_args.bin included, and the model card."
    theirs, ours = names(runs["base"] / "trl-model"), names(runs["base"] / "lab-model")
    assert ours - theirs == set(OURS_ONLY_IN_SAVED_MODEL) and theirs - ours == set()
    args = torch.load(runs["base"] / "lab-model" / "training_args.bin", weights_only=False)
    assert args.num_generations == 4 and args.output_dir == str(runs["base"] / "lab")


def test_each_step_logs_trls_keys(runs):
    "Each step's log entry has TRL's keys, step_time included; the summary entry too."
    theirs, ours = runs["trl"].state.log_history, runs["lab"].state.log_history
    assert len(theirs) == len(ours) == 3
    for mine, trls in zip(ours, theirs):
        assert set(mine) == set(trls), (set(mine) ^ set(trls))
    assert all(h["step_time"] > 0 for h in ours[:2])


def test_train_leaves_trls_files_in_output_dir(runs):
    "After train(): the checkpoint, the model card and the completions, and no final model (the caller saves it)."
    theirs, ours = runs["trl_files"], runs["lab_files"]
    ours_only = {n for n in ours - theirs if not n.startswith("checkpoint-2/")}
    theirs_only = {n for n in theirs - ours if not n.startswith("checkpoint-2/")}
    assert ours_only == set(OURS_ONLY_IN_OUTPUT_DIR) and theirs_only == set()
    assert "model.safetensors" not in ours and "README.md" in ours


def test_completions_are_trls_parquet_files(runs):
    "log_completions=True: completions/completions_00001.parquet ... with TRL's columns, one row per completion."
    pd = pytest.importorskip("pandas")
    folder = runs["base"] / "lab" / "completions"
    files = sorted(p.name for p in folder.iterdir())
    assert files == sorted(p.name for p in (runs["base"] / "trl" / "completions").iterdir())
    assert files == ["completions_00001.parquet", "completions_00002.parquet"]
    for name in files:
        ours, theirs = pd.read_parquet(folder / name), pd.read_parquet(runs["base"] / "trl" / "completions" / name)
        assert list(ours.columns) == list(theirs.columns) == ["step", "prompt", "completion", "reward_len", "advantage"]
        assert len(ours) == len(theirs) == 4 and set(ours["step"]) == {int(name[12:17])}
        assert ours["reward_len"].tolist() == pytest.approx([len(c) / 10 for c in ours["completion"]])


def test_the_summary_has_trls_types(runs):
    "The run's summary entry: each value of TRL's type (total_flos a float), and the checkpoint's state likewise."
    import json
    theirs, ours = runs["trl"].state.log_history[-1], runs["lab"].state.log_history[-1]
    assert {k: type(v) for k, v in ours.items()} == {k: type(v) for k, v in theirs.items()}
    assert isinstance(ours["total_flos"], float)
    saved = [json.loads((runs["base"] / who / "checkpoint-2" / "trainer_state.json").read_text()) for who in ("lab", "trl")]
    assert type(saved[0]["total_flos"]) is type(saved[1]["total_flos"]) is float
