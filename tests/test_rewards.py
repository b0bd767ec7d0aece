"""Reward functions as TRL 1.16 calls them, bad reward outputs, reward models, and the reward statistics."""
import asyncio
import functools
import logging
import math

import pytest
import torch

from grpo_lab.advantages import compute_advantages, nanstd
from grpo_lab.models import tiny_tokenizer
from grpo_lab.rewards import (RewardFunctionError, RewardLogs, RewardModel, as_reward_function, check_reward_arguments,
                              exact_answer, reward_model_text, reward_names, score)

PROMPTS, COMPLETIONS = ["2+2="] * 3, ["4", "five", "22"]


# --- signature-aware calling -------------------------------------------------------------------------------------

def test_quickstart_reward_without_kwargs():
    def reward_len(prompts, completions):
        return [len(c) for c in completions]
    rewards = score(reward_len, PROMPTS, COMPLETIONS, completion_ids=[[1], [2, 3], [4, 5]], answer=["4"] * 3,
                    trainer_state=object(), log_extra=RewardLogs().log_extra, log_metric=RewardLogs().log_metric)
    assert rewards[:, 0].tolist() == [1.0, 4.0, 2.0]


def test_each_function_gets_what_its_signature_names():
    seen = {}

    def only_answer(completions, answer):
        seen["only_answer"] = {"completions", "answer"}
        return [float(c == a) for c, a in zip(completions, answer)]

    def everything(prompts, completions, **kwargs):
        seen["everything"] = set(kwargs)
        return [0.0] * len(completions)

    def with_default(completions, scale=2.0, trainer_state=None):
        seen["with_default"] = (scale, trainer_state)
        return [scale] * len(completions)

    state = object()
    rewards = score([only_answer, everything, with_default], PROMPTS, COMPLETIONS, completion_ids=[[1]] * 3,
                    answer=["4", "4", "4"], trainer_state=state, log_extra=print, log_metric=print)
    assert rewards[:, 0].tolist() == [1.0, 0.0, 0.0]
    assert seen["everything"] == {"completion_ids", "answer", "trainer_state", "log_extra", "log_metric"}  # TRL's set
    assert seen["with_default"] == (2.0, state)


def test_missing_required_parameter_names_it_the_function_and_the_available_names():
    def by_solution(prompts, completions, solution, **kwargs):
        return [0.0] * len(completions)
    with pytest.raises(RewardFunctionError) as e:
        score([exact_answer, by_solution], PROMPTS, COMPLETIONS, completion_ids=[[1]] * 3, answer=["4"] * 3)
    msg = str(e.value)
    assert "'by_solution' requires an argument 'solution'" in msg
    assert "Available: answer, completion_ids, completions, prompts" in msg
    with pytest.raises(RewardFunctionError, match="'by_solution' requires an argument 'solution'.*log_metric"):
        check_reward_arguments([exact_answer, by_solution], ["prompt", "answer"])
    check_reward_arguments([exact_answer], ["prompt", "answer"])          # fine: nothing raised


def test_log_extra_and_log_metric_are_collected():
    def logging_reward(completions, log_extra, log_metric, **kwargs):
        log_extra("length", [len(c) for c in completions])
        log_metric("long_frac", sum(len(c) > 2 for c in completions) / len(completions))
        log_metric("long_frac", 0.0)
        return [0.0] * len(completions)
    logs = RewardLogs()
    score(logging_reward, PROMPTS, COMPLETIONS, log_extra=logs.log_extra, log_metric=logs.log_metric)
    assert logs.extra == {"length": [1, 4, 2]}
    assert logs.metric_values == {"long_frac": [1 / 3, 0.0]} and logs.metrics == {"long_frac": pytest.approx(1 / 6)}


# --- async reward functions ----------------------------------------------------------------------------------------

def test_async_reward_functions_run_concurrently():
    "Each judge waits for the other to have started: run one after the other, the first would time out."
    started = {"a": asyncio.Event(), "b": asyncio.Event()}

    async def judge(me, other, prompts, completions, **kwargs):
        started[me].set()
        await asyncio.wait_for(started[other].wait(), timeout=10)
        return [1.0 if me == "a" else 2.0] * len(completions)

    class Judge:                                                      # an object with an async __call__ counts too
        async def __call__(self, completions):
            return [3.0] * len(completions)

    rewards = score([functools.partial(judge, "a", "b"), exact_answer, functools.partial(judge, "b", "a"), Judge()],
                    PROMPTS, COMPLETIONS, answer=["4"] * 3)
    assert rewards[:, 0].tolist() == [1.0] * 3 and rewards[:, 2].tolist() == [2.0] * 3 and rewards[:, 3].tolist() == [3.0] * 3
    assert rewards[:, 1].tolist() == [1.0, 0.0, 0.0]


def test_async_works_while_an_event_loop_runs_in_this_thread():
    "Jupyter runs cells inside a running loop; score must not call asyncio.run there."
    async def judge(completions):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    async def cell():
        return score(judge, PROMPTS, COMPLETIONS)
    assert asyncio.run(cell()).tolist() == [[1.0]] * 3


def test_async_error_names_the_function():
    async def broken(completions):
        raise KeyError("judge offline")
    with pytest.raises(RewardFunctionError, match="'broken' raised KeyError"):
        score(broken, PROMPTS, COMPLETIONS)


# --- bad reward outputs --------------------------------------------------------------------------------------------

def test_nan_reward_is_unscored_with_a_logging_warning(caplog):
    def half_nan(completions, **kwargs):
        return [1.0, math.nan, math.nan]
    with caplog.at_level(logging.WARNING, logger="grpo_lab.rewards"):
        rewards = score([half_nan, exact_answer], PROMPTS, COMPLETIONS, answer=["4"] * 3)
    assert rewards[0, 0] == 1.0 and rewards[1:, 0].isnan().all()
    messages = [r.getMessage() for r in caplog.records if r.name == "grpo_lab.rewards"]
    assert any("'half_nan' returned NaN for 2 of 3 completions (first: completion 1)" in m for m in messages), messages


def test_rows_no_function_scored_warn_through_logging(caplog, recwarn):
    with caplog.at_level(logging.WARNING, logger="grpo_lab.rewards"):
        score(exact_answer, PROMPTS, COMPLETIONS, answer=["4", None, None])
    assert any("no reward function scored 2 of the 3 completions (first: completion 1" in r.getMessage()
               for r in caplog.records)
    assert not [w for w in recwarn if "scored" in str(w.message)]      # logging, not warnings.warn


@pytest.mark.parametrize("value", [math.inf, -math.inf, 1e39])
def test_values_outside_float32_are_refused(value):
    def big(completions, **kwargs):
        return [0.0, value, 1.0]
    with pytest.raises(RewardFunctionError, match=r"'big' returned .* for completion 1.*Rescale the reward"):
        score(big, PROMPTS, COMPLETIONS)


def test_weighted_sum_overflow_is_refused_before_training():
    rewards = score([lambda completions, **kw: [3e38] * 4, lambda completions, **kw: [3e38, 0.0, 0.0, 1.0]],
                    ["p"] * 4, ["a", "b", "c", "d"])
    with pytest.raises(RewardFunctionError, match="overflows float32.*'judge'.*3e\\+38.*Rescale the reward"):
        compute_advantages(rewards, 4, reward_names=["judge", "judge_2"])
    with pytest.raises(RewardFunctionError, match="overflows float32"):          # each fits; the group mean does not
        compute_advantages([1e38] * 4, 4, reward_names=["big"])


def test_every_row_is_checked_with_its_index():
    with pytest.raises(ValueError, match="completion 2 is None"):
        score(exact_answer, PROMPTS, ["4", "5", None], answer=["4"] * 3)
    with pytest.raises(ValueError, match="prompt 1 is 7"):
        score(exact_answer, ["a", 7, "c"], COMPLETIONS, answer=["4"] * 3)
    with pytest.raises(RewardFunctionError, match="returned 'x' \\(str\\) for completion 2"):
        score(lambda completions, **kw: [1.0, 0.0, "x"], PROMPTS, COMPLETIONS)


# --- reward models -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_reward_model():
    from transformers import LlamaConfig, LlamaForSequenceClassification
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    return LlamaForSequenceClassification(config), tok


def manual_scores(model, tok, texts):
    "One unpadded forward pass per text: the reward is the single logit."
    with torch.no_grad():
        return [model(**tok([t], return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts]


def test_reward_model_object_scores_like_a_manual_forward_pass(tiny_reward_model):
    model, tok = tiny_reward_model
    model.train()
    fn = as_reward_function(model, tok)
    assert isinstance(fn, RewardModel) and not model.training
    expected = manual_scores(model, tok, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert fn(PROMPTS, COMPLETIONS) == pytest.approx(expected, rel=1e-5, abs=1e-6)      # padded batch == one by one
    assert RewardModel(model, tok, batch_size=2)(PROMPTS, COMPLETIONS) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert score([fn, exact_answer], PROMPTS, COMPLETIONS, answer=["4"] * 3)[:, 0].tolist() == pytest.approx(expected, rel=1e-5)


def test_reward_model_by_path_and_its_name(tiny_reward_model, tmp_path):
    model, tok = tiny_reward_model
    folder = tmp_path / "my-reward-model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    for given in (str(folder), folder):
        by_path = as_reward_function(given)
        assert by_path(PROMPTS, COMPLETIONS) == pytest.approx(as_reward_function(model, tok)(PROMPTS, COMPLETIONS), rel=1e-5)
    # TRL names a reward model by the last part of config._name_or_path
    assert reward_names([by_path, exact_answer, str(folder)]) == ["my-reward-model", "exact_answer", "my-reward-model_2"]
    assert as_reward_function(exact_answer) is exact_answer
    with pytest.raises(ValueError, match="could not load the reward model"):
        as_reward_function(str(tmp_path / "missing"))


def test_reward_model_on_conversations_uses_its_chat_template_as_trl(tiny_reward_model):
    model, tok = tiny_reward_model
    prompts = [[{"role": "user", "content": "2+2="}]] * 2
    completions = [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    texts = [reward_model_text(p, c, tok) for p, c in zip(prompts, completions)]
    assert texts == ["2+2=4<|endoftext|>", "2+2=5<|endoftext|>"]
    trl_data = pytest.importorskip("trl.data_utils")
    assert texts == [trl_data.apply_chat_template({"messages": p + c}, tok)["text"] for p, c in zip(prompts, completions)]
    assert RewardModel(model, tok)(prompts, completions) == pytest.approx(manual_scores(model, tok, texts), rel=1e-5, abs=1e-6)


def test_model_without_path_needs_a_tokenizer(tiny_reward_model):
    model, _ = tiny_reward_model
    with pytest.raises(ValueError, match="reward_processing_classes"):
        as_reward_function(model)


# --- reward statistics with TRL's names and meanings ---------------------------------------------------------------

def test_stats_carry_trls_reward_metrics():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0],    # group 1: flat correctness
                            [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])   # group 2: all zero
    _, stats = compute_advantages(rewards, 4, reward_weights=[1.0, 0.5], reward_names=["correct", "fmt"])
    summed = torch.tensor([1.0, 1.5, 1.0, 1.5, 0, 0, 0, 0])
    assert stats["reward"] == pytest.approx(summed.mean().item())
    assert stats["reward_std"] == pytest.approx(summed.std().item())          # whole batch, not a mean of group stds
    assert stats["frac_reward_zero_std"] == 0.5
    assert stats["rewards/correct/mean"] == 0.5 and stats["rewards/correct/std"] == pytest.approx(rewards[:, 0].std().item())
    assert stats["rewards/fmt/mean"] == 0.25 and stats["rewards/fmt/std"] == pytest.approx(rewards[:, 1].std().item())


def test_nanstd_matches_trl():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    x = torch.tensor([[2.0, 0.0, math.nan, 1.0], [3.0, math.nan, math.nan, math.nan], [1.0, 1.0, 1.0, 1.0]])
    for kw in ({}, {"dim": 1}, {"dim": 0}):
        assert torch.allclose(nanstd(x, **kw), trl_utils.nanstd(x, **kw), equal_nan=True)
