"""Property-based tests of the batch arithmetic: any input answers quickly, and every suggested fix is valid."""
import pytest
from hypothesis import given, settings, strategies as st

from grpo_lab.batching import BatchConfigError, plan_batches, plan_for, suggest_fixes

# Counts as people type them, as they mistype them, and far beyond (10**12 and more): each call must
# answer within the deadline (hypothesis fails an example that runs longer than `deadline` ms).
count = st.one_of(st.integers(-3, 40), st.integers(1, 10**6), st.integers(1, 10**12), st.integers(10**12, 10**20))
optional = st.one_of(st.none(), count)
ARGS = dict(per_device_train_batch_size=count, gradient_accumulation_steps=count, num_processes=count,
            num_generations=count, dataset_size=optional, num_train_epochs=st.integers(-1, 5),
            num_iterations=st.integers(-1, 5), steps_per_generation=optional, generation_batch_size=optional,
            max_steps=st.one_of(st.none(), st.integers(-2, 10**6)))
FAST = settings(max_examples=300, deadline=1000)


def args_of(**kw):
    return {name: kw[name] for name in ARGS}


@FAST
@given(**ARGS)
def test_plan_batches_answers_fast_and_every_suggestion_is_valid(**kw):
    try:
        plan = plan_batches(**kw)
    except BatchConfigError as e:
        assert len(str(e)) < 1000
        for fix in e.suggestions:
            plan_batches(**{**kw, **fix})              # raises if a suggestion were invalid
            assert len(fix) == 1 and list(fix.values())[0] != kw[list(fix)[0]]
    else:
        assert plan.generation_batch_size % plan.num_generations == 0
        assert plan.unique_prompts_per_generation * plan.num_generations == plan.generation_batch_size


@FAST
@given(st.integers(1, 10**12), st.integers(1, 10**12), st.integers(1, 10**12), st.integers(2, 10**12),
       st.one_of(st.none(), st.integers(1, 10**12)))
def test_huge_counts_answer_fast(pd, ga, processes, group, dataset_size):
    kw = args_of(per_device_train_batch_size=pd, gradient_accumulation_steps=ga, num_processes=processes,
                 num_generations=group, dataset_size=dataset_size, num_train_epochs=1, num_iterations=1,
                 steps_per_generation=None, generation_batch_size=None, max_steps=None)
    for fix in suggest_fixes(kw):
        plan_batches(**{**kw, **fix})


def brute_nearest(kw, name, limit):
    "The nearest valid values of `name` below and above its value, by trying every value up to `limit`."
    def ok(v):
        try:
            plan_batches(**{**kw, name: v})
            return True
        except BatchConfigError:
            return False
    value = kw[name]
    below = next((v for v in range(value - 1, 0, -1) if ok(v)), None)
    above = next((v for v in range(value + 1, limit) if ok(v)), None)
    return sorted((v for v in (below, above) if v is not None), key=lambda v: (abs(v - value), v))


small = st.integers(1, 12)


@settings(max_examples=150, deadline=None)
@given(pd=small, ga=small, processes=small, group=st.integers(2, 16), dataset_size=st.one_of(st.none(), st.integers(1, 60)))
def test_the_arithmetic_finds_the_same_nearest_values_as_a_search(pd, ga, processes, group, dataset_size):
    kw = args_of(per_device_train_batch_size=pd, gradient_accumulation_steps=ga, num_processes=processes,
                 num_generations=group, dataset_size=dataset_size, num_train_epochs=1, num_iterations=1,
                 steps_per_generation=None, generation_batch_size=None, max_steps=None)
    try:
        plan_batches(**kw)
        return
    except BatchConfigError as e:
        fixes = e.suggestions
    limit = pd * ga * processes * group + 2
    for name in ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "num_processes"):
        assert [f[name] for f in fixes if name in f] == brute_nearest(kw, name, limit), name


@settings(max_examples=100, deadline=1000)
@given(epochs=st.one_of(st.integers(1, 4), st.floats(0.5, 4.5, allow_nan=False)), max_steps=st.integers(-3, 50))
def test_plan_for_follows_trl_conventions(epochs, max_steps):
    options = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=8,
                   num_train_epochs=epochs, max_steps=max_steps)
    whole = float(epochs).is_integer()
    if max_steps == 0 or not whole:
        with pytest.raises(BatchConfigError, match="max_steps=0 would train nothing|must be a whole number"):
            plan_for(options, dataset_size=100)
        return
    plan = plan_for(options, dataset_size=100)
    expected = max_steps if max_steps > 0 else int(epochs) * plan.optimizer_steps_per_epoch
    assert plan.total_optimizer_steps == expected
