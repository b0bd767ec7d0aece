"""The batch plan with dynamic sampling (issue 43): the generation a step may cost, at worst and expected, in the
plan, its text, `plan_for` and the BatchExplorer; and the plan with dynamic sampling off unchanged, row for row."""
import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from grpo_lab import GRPOConfig
from grpo_lab.batching import DYNAMIC_FIELDS, BatchConfigError, expected_rounds, plan_batches, plan_for
from grpo_lab.widgets import BatchExplorer, plan_tables

DEMO = dict(per_device_train_batch_size=128, gradient_accumulation_steps=1, num_generations=8, dataset_size=6000,
            max_steps=700)


def test_demo_batch_worst_and_expected_generation():
    "16 prompts x 8 completions per step, 4 rounds at most, 40% of groups without a spread."
    plan = plan_batches(**DEMO, dynamic_sampling=True, dynamic_sampling_max_rounds=4, zero_std_share=0.4)
    assert plan.completions_per_optimizer_step == 128 and plan.total_optimizer_steps == 700    # what is trained
    assert plan.max_generated_per_optimizer_step == 4 * 128
    # 16 groups a round, each teaching with probability 0.6: the first round is full only when all 16 teach
    assert plan.expected_generation_rounds == pytest.approx(2.0917, abs=1e-4)
    assert plan.expected_generated_per_optimizer_step == pytest.approx(128 * 2.0917, abs=0.02)
    text = plan.explain()
    assert "4 x 128 = 512 at worst" in text and "267.7 completions generated per optimizer step" in text
    assert "between ceil(375 / 4) = 94 and 375 optimizer steps" in text
    assert "expected_generated_per_optimizer_step  267.7" in repr(plan)


def test_accumulation_iterations_and_processes():
    "Generated per optimizer step = pd x P x GA / num_iterations x rounds."
    plan = plan_batches(4, 3, num_processes=2, num_generations=4, num_iterations=2, dynamic_sampling=True,
                        dynamic_sampling_max_rounds=3, zero_std_share=0.5)
    assert plan.max_generated_per_optimizer_step == 4 * 2 * 3 / 2 * 3
    # 3 groups per process a round: 1 + P(Bin(3, 1/2) < 3) + P(Bin(6, 1/2) < 3) = 1 + 7/8 + 22/64 rounds
    assert plan.expected_generated_per_optimizer_step == pytest.approx(12 * (1 + 7 / 8 + 22 / 64))
    with pytest.raises(BatchConfigError, match="whole groups"):
        plan_batches(2, 3, num_processes=4, num_generations=4, dynamic_sampling=True)    # 6 groups over 4 processes
    no_share = plan_batches(4, 3, num_processes=2, num_generations=4, dynamic_sampling=True)
    assert no_share.zero_std_share is None and no_share.expected_generated_per_optimizer_step is None
    assert no_share.max_generated_per_optimizer_step == 24 * 4 and "expected" not in repr(no_share)


def test_expected_rounds_counts_whole_rounds():
    "One group: a geometric count; many groups: whole rounds, ceil(1 / (1 - z)) in the limit, not 1 / (1 - z)."
    assert expected_rounds(0.0, 4, 16) == 1 and expected_rounds(0.56, 200, 1) == pytest.approx(1 / 0.44)
    assert expected_rounds(0.9, 4, 1) == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    assert expected_rounds(0.5, 1, 16) == 1                  # one round: no refill, whatever the share
    assert expected_rounds(0.37, 2, 16) == pytest.approx(2 - 0.63 ** 16)
    assert expected_rounds(0.37, 4, 100_000) == pytest.approx(2, abs=1e-6)          # the normal approximation's side
    assert expected_rounds(0.56, 8, 100_000) == pytest.approx(3, abs=1e-6)


@settings(max_examples=200, deadline=1000)
@given(pd=st.integers(1, 64), ga=st.integers(1, 8), procs=st.integers(1, 8), g=st.sampled_from([2, 4, 8]),
       n=st.one_of(st.none(), st.integers(64, 10**5)), mu=st.integers(1, 3), steps=st.one_of(st.none(), st.integers(1, 500)))
def test_off_is_the_plain_plan(pd, ga, procs, g, n, mu, steps):
    "With dynamic sampling off every field, the repr and the text are the plan's without the new arguments."
    kw = dict(per_device_train_batch_size=pd, gradient_accumulation_steps=ga, num_processes=procs, num_generations=g,
              dataset_size=n, num_iterations=mu, max_steps=steps)
    try:
        plain = plan_batches(**kw)
    except BatchConfigError as e:
        with pytest.raises(BatchConfigError) as again:
            plan_batches(**kw, dynamic_sampling=False, dynamic_sampling_max_rounds=7)
        assert str(again.value) == str(e) and again.value.suggestions == e.suggestions
        return
    off = plan_batches(**kw, dynamic_sampling=False, dynamic_sampling_max_rounds=7)
    assert off == plain and repr(off) == repr(plain) and off.explain() == plain.explain()
    assert all(getattr(off, name) is None for name in DYNAMIC_FIELDS) and "dynamic" not in repr(off)
    if plain.unique_prompts_per_generation % procs:
        with pytest.raises(BatchConfigError, match="whole groups"):
            plan_batches(**kw, dynamic_sampling=True)
        return
    on = plan_batches(**kw, dynamic_sampling=True, dynamic_sampling_max_rounds=3, zero_std_share=0.25)
    common = [f.name for f in dataclasses.fields(on) if f.name not in DYNAMIC_FIELDS]
    assert all(getattr(on, name) == getattr(plain, name) for name in common)       # what is trained stays
    assert on.max_generated_per_optimizer_step == pytest.approx(pd * procs * ga / mu * 3)


def test_bad_values_are_refused_with_their_rule():
    for bad, words in [(dict(dynamic_sampling="yes"), "must be True or False"),
                       (dict(dynamic_sampling=True, dynamic_sampling_max_rounds=0), "whole number >= 1"),
                       (dict(dynamic_sampling=True, zero_std_share=1.0), "below 1"),
                       (dict(dynamic_sampling=True, zero_std_share=-0.1), "below 1")]:
        with pytest.raises(BatchConfigError, match=words):
            plan_batches(8, 1, **bad)
    with pytest.raises(BatchConfigError, match="only counts with dynamic_sampling=True") as e:
        plan_batches(8, 1, zero_std_share=0.3)
    assert e.value.suggestions == [{"dynamic_sampling": True}, {"zero_std_share": None}]


def test_plan_for_reads_the_config(tmp_path):
    on = GRPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=32, num_generations=8,
                    max_steps=10, dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    plan = plan_for(on, dataset_size=400, zero_std_share=0.5)
    assert plan.max_generated_per_optimizer_step == 96                       # 32 completions x 3 rounds
    assert plan.expected_generated_per_optimizer_step == pytest.approx(32 * (1 + 15 / 16 + 93 / 256))   # 4 groups a round
    off = GRPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=32, num_generations=8,
                     max_steps=10)
    assert plan_for(off, dataset_size=400) == plan_batches(32, 1, num_generations=8, dataset_size=400, max_steps=10,
                                                          num_train_epochs=3)     # GRPOConfig: 3 epochs
    assert plan_for({"per_device_train_batch_size": 32, "gradient_accumulation_steps": 1, "dynamic_sampling": True},
                    zero_std_share=0.5).expected_generated_per_optimizer_step == 32 * expected_rounds(0.5, 4, 4)


def test_batch_explorer_counts_and_restores():
    explorer = BatchExplorer(**DEMO)
    plain_text = explorer.text()
    explorer.apply({"dynamic_sampling": True, "zero_std_share": 0.5, "dynamic_sampling_max_rounds": 2})
    rows = {row[0]: row[1] for row in plan_tables(explorer.state)[0]}
    assert rows["generated per optimizer step, worst (2 rounds)"] == 256
    assert rows["generated per optimizer step, expected (0.5 without a spread)"] == pytest.approx(128 * (2 - 0.5 ** 16))
    assert "256 at worst" in explorer.text()
    explorer.controls["dynamic_sampling"].value = False
    assert explorer.text() == plain_text and explorer.arguments["zero_std_share"] is None
    assert explorer.controls["dynamic_sampling_max_rounds"].disabled
