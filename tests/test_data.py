"""grpo_lab.data reads prompts from every kind of local source, formats GSM8K-style rows, and fails clearly; all offline."""
import json

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from grpo_lab.data import (STREAM_CHECK_ROWS, check_prompt, check_prompts, format_gsm8k, load_prompts,
                           prompt_token_lengths, render_prompt)
from grpo_lab.rewards import numeric_answer, score, strict_format

ROWS = [{"prompt": "2+2=", "answer": "4", "level": "easy"},
        {"prompt": "12+30=", "answer": "42", "level": "easy"},
        {"prompt": "99-100=", "answer": "-1", "level": "hard"}]

# Invented word problems in GSM8K's format (question; worked answer ending in '#### n').
WORD_PROBLEMS = [
    {"question": "A farmer plants 8 rows of 15 cabbages and 7 of them fail. How many cabbages grow?",
     "answer": "8 * 15 = <<8*15=120>>120 cabbages are planted.\n120 - 7 = <<120-7=113>>113 grow.\n#### 113"},
    {"question": "A train ticket costs $18. How much do 4 adults and 2 children pay if children pay half?",
     "answer": "Adults pay 4 * 18 = <<4*18=72>>72.\nA child pays 18 / 2 = <<18/2=9>>9, so 2 * 9 = 18.\n"
               "72 + 18 = <<72+18=90>>90.\n#### 90"},
    {"question": "A printer makes 250 pages a minute. How many pages does it make in 2 hours?",
     "answer": "2 hours are 120 minutes.\n250 * 120 = <<250*120=30000>>30000 pages.\n#### 30,000"},
]

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>"
                 "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def char_tokenizer(chat_template=CHAT_TEMPLATE):
    "A character-level tokenizer built in memory, with an optional chat template."
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*=?.,:<>|/#\n"
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["[UNK]", *chars])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = chat_template
    return fast


def write_source(tmp_path, kind):
    "ROWS written to `tmp_path` as one kind of local source; returns its path."
    path = tmp_path / f"prompts{kind if kind.startswith('.') else ''}"
    if kind == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    elif kind == ".json":
        path.write_text(json.dumps(ROWS))
    elif kind == ".csv":
        Dataset.from_list(ROWS).to_csv(str(path), index=False)
    elif kind == ".parquet":
        Dataset.from_list(ROWS).to_parquet(str(path))
    elif kind == "saved":
        Dataset.from_list(ROWS).save_to_disk(str(path))
    elif kind == "saved_dict":
        DatasetDict(train=Dataset.from_list(ROWS[:1]), test=Dataset.from_list(ROWS)).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", [".jsonl", ".json", ".csv", ".parquet", "saved"])
def test_local_sources(tmp_path, kind):
    ds = load_prompts(write_source(tmp_path, kind))
    assert ds.column_names == ["prompt", "answer", "level"]
    assert [str(a) for a in ds["answer"]] == ["4", "42", "-1"]
    assert list(ds["prompt"]) == [r["prompt"] for r in ROWS]


def test_path_as_string_limit_and_split(tmp_path):
    assert list(load_prompts(str(write_source(tmp_path, ".jsonl")), limit=2)["prompt"]) == ["2+2=", "12+30="]
    saved = write_source(tmp_path, "saved_dict")
    assert len(load_prompts(saved, split="test")) == 3 and len(load_prompts(saved)) == 1
    with pytest.raises(ValueError, match=r"split='validation'.*\['train', 'test'\]"):
        load_prompts(saved, split="validation")


def test_json_dict_of_columns_and_python_sources(tmp_path):
    columns = {k: [r[k] for r in ROWS] for k in ROWS[0]}
    (tmp_path / "columns.json").write_text(json.dumps(columns))
    assert len(load_prompts(tmp_path / "columns.json")) == 3
    assert load_prompts(columns).to_list() == load_prompts(ROWS).to_list() == ROWS
    assert len(load_prompts(DatasetDict(train=Dataset.from_list(ROWS)))) == 3


def test_prompt_column_is_renamed_and_other_columns_kept(tmp_path):
    path = tmp_path / "questions.csv"
    path.write_text("question,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in ROWS))
    ds = load_prompts(path, prompt_column="question")
    assert ds.column_names == ["prompt", "answer"] and ds[0]["prompt"] == "2+2="


def test_missing_prompt_column_lists_columns(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"question": "2+2=", "answer": "4"}))
    with pytest.raises(ValueError, match=r"the columns are \['question', 'answer'\]: pass prompt_column="):
        load_prompts(path)


@pytest.mark.parametrize("source", [[], {"prompt": []}])
def test_empty_dataset_is_an_error(source):
    with pytest.raises(ValueError, match="has no rows"):
        load_prompts(source)


@pytest.mark.parametrize("name,text", [("empty.csv", "prompt,answer\n"), ("empty.jsonl", ""), ("empty.json", "[]")])
def test_empty_file_is_an_error(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match="has no rows"):
        load_prompts(tmp_path / name)


def test_bad_jsonl_line_is_reported_by_number(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "2+2="}\n\n{"prompt": "3+3="\n')
    with pytest.raises(ValueError, match="line 3: not valid JSON"):
        load_prompts(path)


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file or folder"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="no file or folder"):
        load_prompts(str(tmp_path / "nope.parquet"))
    (tmp_path / "prompts.txt").write_text("2+2=\n")
    with pytest.raises(ValueError, match=r"'\.txt'.*\.jsonl, \.json, \.csv, \.parquet"):
        load_prompts(tmp_path / "prompts.txt")


def test_hub_id_offline_says_how_to_use_a_local_copy():
    "conftest sets HF_HUB_OFFLINE=1, so a hub id fails at once with advice."
    with pytest.raises(ConnectionError, match="pass that file or folder as the source"):
        load_prompts("someone/some-prompts")


def test_conversational_prompts_render_with_a_chat_template(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]})
                              for r in ROWS))
    tok = char_tokenizer()
    ds = load_prompts(path, system_prompt="Be brief.", tokenizer=tok)
    assert ds[0]["prompt"] == "<|system|>Be brief.\n<|user|>2+2=\n<|assistant|>"
    assert ds.column_names == ["prompt", "answer"]
    raw = load_prompts(path)
    assert render_prompt(raw[1]["prompt"], tok) == "<|user|>12+30=\n<|assistant|>"
    with pytest.raises(ValueError, match="has none"):
        load_prompts(path, tokenizer=char_tokenizer(chat_template=None))


def test_string_prompts_with_system_prompt_become_conversations():
    ds = load_prompts(ROWS, system_prompt="Answer with a number.", tokenizer=char_tokenizer())
    assert ds[2]["prompt"] == "<|system|>Answer with a number.\n<|user|>99-100=\n<|assistant|>"
    assert load_prompts(ROWS, tokenizer=char_tokenizer())["prompt"][0] == "2+2="


def test_gsm8k_format_to_numeric_reward_end_to_end(tmp_path):
    path = tmp_path / "word_problems.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in WORD_PROBLEMS))
    ds = load_prompts(format_gsm8k(path), tokenizer=char_tokenizer())
    assert list(ds["answer"]) == ["113", "90", "30000"]
    assert ds[0]["prompt"].startswith("<|system|>") and ds[0]["prompt"].endswith("How many cabbages grow?\n<|assistant|>")
    conversations = format_gsm8k(path)["prompt"]
    completions = [[{"role": "assistant", "content": text}] for text in [
        "<think>\n8 * 15 - 7\n</think>\n<answer>\n113\n</answer>",
        "The family pays 90 dollars, or maybe 91.",
        "<think>\n250 * 120\n</think>\n<answer>\n30,001\n</answer>"]]
    rewards = score([numeric_answer, strict_format], conversations, completions, answer=format_gsm8k(path)["answer"])
    assert torch.equal(rewards, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]))


def test_gsm8k_rows_without_final_answer_are_rejected():
    with pytest.raises(ValueError, match=r"row 1: a GSM8K answer ends with '#### <number>'"):
        format_gsm8k([WORD_PROBLEMS[0], {"question": "?", "answer": "no marker here"}])
    with pytest.raises(ValueError, match=r"missing \['answer'\]"):
        format_gsm8k([{"question": "?"}])


# --- every row checked: the value, the rule and the fix (issue 14) ---

RULE = "but a prompt is a string or a list of {'role': ..., 'content': ...} messages"


def error(fn) -> str:
    "The message of the exception `fn()` raises, prefixed by its type; fails if it raises none."
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    return f"{info.type.__name__}: {info.value}"


def test_none_prompt_in_a_later_row_is_named_with_the_filter_that_drops_it(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(4999)]
                              + [json.dumps({"prompt": None, "answer": "0"})]))
    assert error(lambda: load_prompts(path)) == (
        f"TypeError: row 4999: 'prompt' is None (NoneType), {RULE}; "
        "drop such rows: ds = ds.filter(lambda row: row['prompt'] is not None).")
    assert len(load_prompts(path, limit=4999)) == 4999  # rows past the limit are not checked
    rows = [{"question": "2+2=", "answer": "4"}, {"question": None, "answer": "0"}]
    assert error(lambda: load_prompts(rows, prompt_column="question")).startswith(
        "TypeError: row 1: 'question' is None (NoneType)")
    assert "ds.filter(lambda row: row['question'] is not None)" in error(lambda: load_prompts(rows, prompt_column="question"))


@pytest.mark.parametrize("value,shown", [(42, "42 (int)"), (3.5, "3.5 (float)"), ({"text": "2+2="}, "{'text': '2+2='} (dict)")])
def test_prompt_of_another_type_is_named(value, shown):
    message = error(lambda: load_prompts(Dataset.from_list([{"prompt": value}, {"prompt": value}])))
    assert message == (f"TypeError: row 0: 'prompt' is {shown}, {RULE}; pass prompt_column= the column that holds "
                       "the prompts, or make them text: ds = ds.map(lambda row: {'prompt': str(row['prompt'])}).")


def test_numbers_from_a_csv_and_mixed_python_rows(tmp_path):
    (tmp_path / "numbers.csv").write_text("prompt,answer\n12,4\n13,5\n")
    assert error(lambda: load_prompts(tmp_path / "numbers.csv")).startswith("TypeError: row 0: 'prompt' is 12 (int)")
    mixed = [{"prompt": "2+2="}, {"prompt": "3+3="}, {"prompt": 7}]
    assert error(lambda: load_prompts(mixed)).startswith(f"TypeError: row 2: 'prompt' is 7 (int), {RULE}")
    assert error(lambda: load_prompts({"prompt": ["2+2=", "", ["3+3="]]})).startswith("TypeError: row 2: 'prompt' message 0 is '3+3=' (str)")
    assert error(lambda: load_prompts({"prompt": ["2+2=", None, ["3+3="]]})).startswith("TypeError: row 1: 'prompt' is None")
    other = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": 6}]
    assert error(lambda: load_prompts(other)) == (
        "TypeError: these rows cannot form a table (Expected bytes, got a 'int' object): each column must hold one type "
        "in every row, e.g. 'answer': '4' in all of them, not '4' in some and 4 in others.")


def chats(*conversations):
    "Rows with conversational prompts."
    return [{"prompt": c} for c in conversations]


def test_unknown_role_lists_the_allowed_roles():
    rows = chats([{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Beep."}])
    assert error(lambda: load_prompts(rows)) == (
        "ValueError: row 1: 'prompt' message 1 has role 'robot', but chat templates know only the roles system, user, "
        "assistant, tool, developer: use one of them (the model's own turns are 'assistant').")
    for role in ("system", "user", "assistant", "tool", "developer"):
        assert check_prompt([{"role": role, "content": "x"}], 0) is False
    assert "message 0 has no role, but chat templates know only the roles" in error(lambda: check_prompt([{"content": "Hi"}], 0))


def test_message_without_content(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in [
        [{"role": "user", "content": "Hi"}], [{"role": "system", "content": "Be brief."}, {"role": "user"}]]))
    assert error(lambda: load_prompts(path)) == (
        "ValueError: row 1: 'prompt' message 1 has no content ({'content': None, 'role': 'user'}); each message needs a "
        "'content' string (or a list of {'type': ...} parts): add it, with '' for a message that only carries tool_calls.")
    assert "message 0 has content 5 (int)" in error(lambda: check_prompt([{"role": "user", "content": 5}], 0))
    assert "message 0 is 'Hi' (str)" in error(lambda: check_prompt(["Hi"], 0))


def test_all_prompts_empty_is_an_error_before_generate():
    assert error(lambda: load_prompts([{"prompt": ""}, {"prompt": "  \n"}])) == (
        "ValueError: all 2 prompts in column 'prompt' are empty or whitespace only (row 0 is ''), so the model would "
        "have nothing to answer: check that prompt_column= names the column that holds the prompts, and that the data has them.")
    assert error(lambda: load_prompts(chats([{"role": "user", "content": ""}], []))).startswith(
        "ValueError: all 2 prompts in column 'prompt' are empty or whitespace only (row 0 is [{'content': '', 'role': 'user'}])")


def test_some_prompts_empty_are_counted_and_named_with_a_working_filter():
    ds = Dataset.from_dict({"prompt": [("" if i % 2 else f"{i}+1=") for i in range(20)], "answer": ["x"] * 20})
    message = error(lambda: load_prompts(ds))
    assert message == (
        "ValueError: 10 of 20 prompts are empty or whitespace only (rows 1, 3, 5, 7, 9 and 5 more); training on them "
        "is silently wrong: they get completions and rewards like the others, for answers to nothing. "
        "Drop them first: ds = ds.filter(lambda row: row['prompt'].strip() != '')")
    fix = message.split("Drop them first: ")[1]
    scope = {"ds": ds}
    exec(fix, scope)
    assert len(load_prompts(scope["ds"])) == 10
    conversations = Dataset.from_list(chats([{"role": "user", "content": "Hi"}], [{"role": "user", "content": " "}]))
    fix = error(lambda: load_prompts(conversations)).split("Drop them first: ")[1]
    assert fix == "ds = ds.filter(lambda row: any(m['content'].strip() for m in row['prompt']))"
    scope = {"ds": conversations}
    exec(fix, scope)
    assert list(load_prompts(scope["ds"])["prompt"]) == [[{"role": "user", "content": "Hi"}]]


def test_content_parts_and_tool_messages_are_accepted():
    "Text parts and tool messages; an image part is refused (tests/test_third_pass.py: no vision-language models yet)."
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": " this?"}]}]
    tool = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": ""},
            {"role": "tool", "content": "sunny"}]
    assert check_prompts(chats(parts, tool)) is None
    assert check_prompt([{"role": "user", "content": [{"type": "text", "text": " "}]}], 0) is True


def test_errors_never_format_an_unbounded_value():
    huge = "x" * 10**6
    for bad in [[{"role": huge, "content": "Hi"}], [{"role": "user", "content": 10**5000}], [huge], {"a": huge}]:
        assert len(error(lambda: check_prompt(bad, 0))) < 400
    assert len(error(lambda: check_prompts([{"prompt": ""}] * 10**5 + [{"prompt": "x"}]))) < 400


# --- chat templates as TRL 1.16 renders them ---

def test_render_prompt_continues_a_final_assistant_message_as_trl_does():
    from trl.data_utils import apply_chat_template
    tok = char_tokenizer()
    for prompt in ([{"role": "user", "content": "2+2="}],
                   [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
                   [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "<think>"}],
                   [{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny"}]):
        assert render_prompt(prompt, tok) == apply_chat_template({"prompt": prompt}, tok)["prompt"]
    assert render_prompt([{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "The answer is"}],
                         tok) == "<|user|>2+2=\n<|assistant|>The answer is"


def test_chat_template_kwargs_reach_the_template_and_match_trl():
    from trl.data_utils import apply_chat_template
    tok, prompt = char_tokenizer(), [{"role": "user", "content": "2+2="}]
    thinking_off = {"enable_thinking": False}
    assert render_prompt(prompt, tok, chat_template_kwargs=thinking_off) == "<|user|>2+2=\n<|assistant|><think></think>"
    assert render_prompt(prompt, tok, thinking_off) == apply_chat_template(
        {"prompt": prompt, "chat_template_kwargs": thinking_off}, tok)["prompt"]
    assert render_prompt(prompt, tok, None) == render_prompt(prompt, tok, {}) == "<|user|>2+2=\n<|assistant|>"
    assert error(lambda: render_prompt(prompt, tok, {"add_generation_prompt": False, "tokenize": True})) == (
        "ValueError: chat_template_kwargs sets ['tokenize', 'add_generation_prompt'], which render_prompt chooses itself "
        "(a generation prompt after a user, system or tool message; the final message continued after an assistant "
        "one): remove them from chat_template_kwargs.")
    assert error(lambda: render_prompt(prompt, tok, "enable_thinking=False")) == (
        "TypeError: chat_template_kwargs='enable_thinking=False' (str) must be a dict of extra variables for the chat "
        "template, e.g. {'enable_thinking': False}.")
    ds = load_prompts(chats(prompt), tokenizer=tok, chat_template_kwargs=thinking_off)
    assert ds[0]["prompt"].endswith("<|assistant|><think></think>")


# --- prompt lengths for the trainer's context check ---

def test_prompt_token_lengths_count_what_the_model_reads():
    tok = char_tokenizer()
    prompts = ["2+2=", [{"role": "user", "content": "2+2="}], [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]]
    expected = [4, len("<|user|>2+2=\n<|assistant|>"), len("<|user|>x\n<|assistant|>y")]
    assert prompt_token_lengths(prompts, tok) == expected
    assert prompt_token_lengths([prompts[1]], tok, {"enable_thinking": False}) == [expected[1] + len("<think></think>")]
    # the same count as the chat template's own tokenization (TRL tokenizes conversations this way)
    assert expected[1] == len(tok.apply_chat_template(prompts[1], add_generation_prompt=True, tokenize=True, return_dict=False))
    many = [f"{i}+{i}=" for i in range(2345)]
    assert prompt_token_lengths(many, tok, batch_size=100) == [len(p) for p in many]
    assert prompt_token_lengths(load_prompts(ROWS)["prompt"], tok) == [4, 6, 7]
    assert prompt_token_lengths(iter([]), tok) == []


# --- streams ---

def stream_of(rows):
    "An IterableDataset read from a generator (no features known in advance, as many streams are)."
    def generate():
        yield from rows
    return IterableDataset.from_generator(generate)


def test_stream_is_returned_lazily_with_its_columns_and_rendering():
    tok = char_tokenizer()
    stream = Dataset.from_list([{"question": r["prompt"], "answer": r["answer"]} for r in ROWS]).to_iterable_dataset()
    ds = load_prompts(stream, prompt_column="question", system_prompt="Be brief.", tokenizer=tok, limit=2)
    assert isinstance(ds, IterableDataset)
    rows = list(ds)
    assert [r["prompt"] for r in rows] == ["<|system|>Be brief.\n<|user|>2+2=\n<|assistant|>",
                                           "<|system|>Be brief.\n<|user|>12+30=\n<|assistant|>"]
    assert [r["answer"] for r in rows] == ["4", "42"]
    assert [r["prompt"] for r in load_prompts(IterableDatasetDict(test=stream_of(ROWS)), split="test")] == [r["prompt"] for r in ROWS]


def test_stream_first_rows_are_checked_at_load():
    assert error(lambda: load_prompts(stream_of([*ROWS, {"prompt": None}]))).startswith("TypeError: row 3: 'prompt' is None")
    assert error(lambda: load_prompts(stream_of([{"prompt": "2+2="}, {"prompt": ""}]))).startswith(
        "ValueError: 1 of 2 prompts are empty or whitespace only (rows 1)")
    assert error(lambda: load_prompts(stream_of([{"question": "2+2="}]))).startswith(
        "ValueError: no prompt column 'prompt'; the columns are ['question']")
    assert error(lambda: load_prompts(stream_of([]))) == "ValueError: the stream has no rows; GRPO needs at least one prompt."


def test_stream_rows_past_the_first_are_checked_as_they_are_read():
    good = [{"prompt": f"{i}+1="} for i in range(STREAM_CHECK_ROWS + 5)]
    late_none = load_prompts(stream_of([*good, {"prompt": None}]))
    assert error(lambda: list(late_none)).startswith(f"TypeError: row {STREAM_CHECK_ROWS + 5}: 'prompt' is None (NoneType)")
    late_robot = load_prompts(stream_of([*good, {"prompt": [{"role": "robot", "content": "Beep."}]}]))
    assert "has role 'robot'" in error(lambda: list(late_robot))
    late_empty = load_prompts(stream_of([*good, {"prompt": " "}]))
    assert error(lambda: list(late_empty)) == (
        f"ValueError: row {STREAM_CHECK_ROWS + 5} read from the stream has an empty prompt (' '); training on it is "
        "silently wrong (completions and rewards for answers to nothing). "
        "Drop empty prompts first: ds = ds.filter(lambda row: row['prompt'].strip() != '')")
    assert len(list(load_prompts(stream_of(good)))) == STREAM_CHECK_ROWS + 5
