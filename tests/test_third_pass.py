"""Issue 41, third pass: what people write as they write it. An async script with no main guard trains (its reward a
generator, as TRL takes it); a worker that dies at its start says why; images, an empty output_dir, rewards that
cannot be one per completion in order and a missing tracker are met before training."""
import json
import subprocess
import sys

import pytest

from grpo_lab.models import tiny_model_path

TINY = str(tiny_model_path())

ASYNC_SCRIPT = """\
from grpo_lab.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from grpo_lab.data import arithmetic_task
{extra_imports}

def shorter(prompts, completions, **kwargs):
    return (-float(len(c)) for c in completions)     # a generator, as TRL takes it
{extra_code}
args = AsyncGRPOConfig(output_dir={out!r}, per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                       max_steps=3, max_staleness=1, save_strategy="no", gradient_checkpointing=False,
                       disable_tqdm=True, report_to=[])
trainer = AsyncGRPOTrainer({model}, shorter, args=args, train_dataset=arithmetic_task(32))
trainer.train()
print("steps done:", trainer.state.global_step)
"""


def _run_script(tmp_path, **parts):
    "Write an async training script as TRL's docs write them (no main guard) and run it as a user would."
    script = tmp_path / "train.py"
    parts = {"extra_imports": "", "extra_code": "", "model": repr(TINY), **parts}
    script.write_text(ASYNC_SCRIPT.format(out=str(tmp_path / "out"), **parts))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_an_async_script_without_a_main_guard_trains(tmp_path):
    """The worker does not run the user's script again: the script's three steps are trained and logged once (its
    reward function returns a generator, which TRL takes too)."""
    run = _run_script(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "steps done: 3" in run.stdout
    assert run.stdout.count("steps done") == 1                   # the script ran once, not again in the worker
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [h["step"] for h in logged if "sample/staleness_max" in h]
    assert steps == [1, 2, 3], steps


CUSTOM_MODEL = """
class MyModel(Qwen2ForCausalLM):
    "A model class of the script's own: the worker can only get it by running the script again."

model = MyModel.from_pretrained({tiny!r})
"""


def test_a_worker_that_dies_at_its_start_says_why_with_its_own_last_line(tmp_path):
    """A model class defined in the script must be imported from it by the worker, which runs the unguarded script
    again: the worker's start fails there, and the error quotes the worker's own last words and says what to do."""
    run = _run_script(tmp_path, extra_imports="from transformers import Qwen2ForCausalLM",
                      extra_code=CUSTOM_MODEL.format(tiny=TINY), model="model")
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo_lab.async_grpo.AsyncWorkerError: the generation worker (pid "), last
    assert "exited with code 1 before it started" in last
    assert ("its stderr ended with: RuntimeError: the user's script, run again inside the generation worker, "
            "started a trainer there") in last
    assert "MyModel" in last and 'if __name__ == "__main__":' in last


# --- images in prompts (TRL 1.16's vision-language layout), given to a text model (a VLM trains: test_vision.py) ---

def _text_args(tmp_path, **kw):
    from grpo_lab import GRPOConfig
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=4, max_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
    return GRPOConfig(**{**base, **kw})


def _length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


PICTURE_TURN = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
TEXT_TURN = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


@pytest.mark.parametrize("rows,names", [
    ({"prompt": [PICTURE_TURN] * 4, "image": ["cat.png"] * 4}, "'image' column"),
    ({"prompt": ["Describe it."] * 4, "images": [["a.png", "b.png"]] * 4}, "'images' column"),
    ({"prompt": [TEXT_TURN] * 3 + [PICTURE_TURN]}, "row 3: 'prompt' message 0 holds an {'type': 'image'} part")])
def test_images_in_prompts_are_refused_before_training(tmp_path, rows, names):
    "A text model would train on the text alone without a word: refused at construction, in one sentence."
    from datasets import Dataset
    from grpo_lab import GRPOTrainer
    with pytest.raises(ValueError) as raised:
        GRPOTrainer(TINY, _length, args=_text_args(tmp_path), train_dataset=Dataset.from_dict(rows))
    said = str(raised.value)
    assert names in said and "this model is a text model" in said and "AutoProcessor" in said, said
    assert "\n" not in said and said.endswith(".")


def test_images_in_a_streamed_row_past_the_first_checked_ones_are_refused_when_read():
    from datasets import Dataset
    from grpo_lab.data import STREAM_CHECK_ROWS, load_prompts
    rows = [TEXT_TURN] * STREAM_CHECK_ROWS + [PICTURE_TURN]
    stream = load_prompts(Dataset.from_dict({"prompt": rows}).to_iterable_dataset())
    with pytest.raises(ValueError, match=f"row {STREAM_CHECK_ROWS}: 'prompt' message 0 holds an {{'type': 'image'}}"):
        list(stream)


# --- output_dir="" ---

def test_an_empty_output_dir_is_refused_and_none_is_trls_trainer_output(tmp_path, monkeypatch):
    "output_dir='' would write checkpoints and metrics.jsonl among the user's files; None is TRL's 'trainer_output'."
    from grpo_lab import GRPOTrainer
    from grpo_lab.data import arithmetic_task
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^output_dir='' names no folder") as raised:
        GRPOTrainer(TINY, _length, args=_text_args(tmp_path, output_dir=""), train_dataset=arithmetic_task(8))
    assert "\n" not in str(raised.value)
    assert list(tmp_path.iterdir()) == []                     # nothing written into the current folder
    trainer = GRPOTrainer(TINY, _length, args=_text_args(tmp_path, output_dir=None), train_dataset=arithmetic_task(8))
    assert trainer.args.output_dir == "trainer_output" and (tmp_path / "trainer_output").is_dir()


# --- what a reward function returns: any iterable, as TRL takes it ---

def test_a_reward_function_may_return_any_ordered_iterable_as_in_trl():
    import numpy as np
    import torch
    from grpo_lab.rewards import score
    prompts, completions = ["a", "b", "c"], ["x", "yy", "zzz"]
    shapes = {"generator": lambda prompts, completions, **kw: (float(len(c)) for c in completions),
              "map": lambda prompts, completions, **kw: map(lambda c: float(len(c)), completions),
              "tuple": lambda prompts, completions, **kw: tuple(float(len(c)) for c in completions),
              "numpy": lambda prompts, completions, **kw: np.array([len(c) for c in completions], dtype=np.float32),
              "tensor": lambda prompts, completions, **kw: torch.tensor([1.0, 2.0, 3.0]),
              "with None": lambda prompts, completions, **kw: iter([1.0, None, 3.0])}
    for name, fn in shapes.items():
        got = score(fn, prompts, completions)[:, 0]
        expected = torch.tensor([1.0, float("nan") if name == "with None" else 2.0, 3.0])
        assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num()), name


@pytest.mark.parametrize("returned,why", [("1.0", "a str"), ({0: 1.0}, "a dict"), ({1.0, 2.0, 3.0}, "a set"),
                                         (1.0, "a float is not a sequence")])
def test_what_cannot_be_one_reward_per_completion_in_order_is_refused(returned, why):
    from grpo_lab.rewards import RewardFunctionError, score
    with pytest.raises(RewardFunctionError, match=why):
        score(lambda prompts, completions, **kw: returned, ["a", "b", "c"], ["x", "y", "z"])


# --- a tracker named in report_to that is not installed ---

def test_a_tracker_that_is_not_installed_is_named_with_its_install_line(tmp_path):
    from transformers.integrations import integration_utils
    from grpo_lab import GRPOTrainer
    from grpo_lab.data import arithmetic_task
    missing = [n for n in ("neptune", "swanlab", "dvclive", "clearml") if not getattr(integration_utils, f"is_{n}_available")()]
    assert missing, "every tracker of the test is installed here"
    name = missing[0]
    with pytest.raises(ValueError, match=rf"^report_to names '{name}', which is not available here: .*pip install {name}") as raised:
        GRPOTrainer(TINY, _length, args=_text_args(tmp_path, report_to=[name]), train_dataset=arithmetic_task(8))
    assert "\n" not in str(raised.value)
