"""grpo_lab.data reads prompts from every kind of local source, formats GSM8K-style rows, and fails clearly; all offline."""
import json

import pytest
import torch
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from grpo_lab.data import format_gsm8k, load_prompts, render_prompt
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
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


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
