"""Run TRL's own GRPO trainer tests offline, against TRL or against grpo-lab with only the import changed.

    python tests/trl_suite.py --against grpo-lab --select tools      # TRL's tool and environment tests
    python tests/trl_suite.py --against trl --select tools           # the same tests on the installed TRL
    python tests/trl_suite.py --against grpo-lab --select earlier    # the rollout_func, dataloader, training_step ones
    python tests/trl_suite.py --against grpo-lab -k "tool and not async"   # any pytest -k expression

TRL's test file is not in TRL's package, so it is read at run time from a clone of TRL's repository (a git dir:
`--trl-repo`, default `$TRL_REPO` or /work/.mirror/huggingface+trl/repo, at `--rev`, default HEAD) or from a folder
holding `test_grpo_trainer.py` and `testing_utils.py` (`--trl-tests`). Nothing of it is copied into this repository:
the files are written to a scratch folder and, for grpo-lab, the one line `from trl import GRPOConfig, GRPOTrainer`
becomes `from grpo_lab import GRPOConfig, GRPOTrainer`.

The tests load hub ids (`trl-internal-testing/tiny-*` models, the `trl-internal-testing/zen` dataset). With no hub,
this script builds local stand-ins once (in `--cache`, default `$GRPO_LAB_CACHE/trl-suite` or
~/.cache/grpo-lab/trl-suite) and serves them through a local Hugging Face cache with `HF_HUB_OFFLINE=1`:
- models: random weights in the shapes TRL's tiny models have (hidden size 8 or 16, 2 layers), same architectures;
- tokenizer: Qwen's own byte-level BPE vocabulary (the `qwen.tiktoken` file the `dashscope` package ships,
  downloaded once with `pip download`, never installed) plus the Qwen2.5/Qwen3 special tokens, so the token ids
  that TRL's tool tests hard-code decode to the text their comments say (checked when it is built);
  chat templates: the Qwen2.5 and Qwen3 templates the installed TRL ships (`trl/chat_templates/*.jinja`);
- dataset: TRL's own `scripts/generate_zen_dataset.py` from the same clone, run with its upload replaced by a
  write into the local datasets cache.
The tests' results are counted from pytest's junit report; `--json PATH` keeps them.
"""
import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REPO = Path("/work/.mirror/huggingface+trl/repo")
TEST_FILES = ("test_grpo_trainer.py", "testing_utils.py", "conftest.py")
TRL_IMPORT = "from trl import GRPOConfig, GRPOTrainer\n"
GRPO_LAB_IMPORT = "from grpo_lab import GRPOConfig, GRPOTrainer\n"

# Named selections (pytest -k expressions over TestGRPOTrainer / TestGRPORolloutDispatch).
SELECTIONS = {
    # every tool / environment_factory test of the text-only trainer class (the multimodal one is a VLM test)
    "tools": "TestGRPOTrainer and not VLM and (tool or environment or reward_source)",
    # the tools tests that build a trainer and check it (or fail at the first rollout), without training: quick
    "tools-quick": "TestGRPOTrainer and not VLM and (coexists or mixed_environments or reward_source or "
                   "dataset_required or requires_max_steps or without_dataset or unknown_environment)",
    # the tools tests that train (15 to 51 steps of a 152k-vocabulary model each: minutes each on a busy 2-core CPU)
    "tools-train": "TestGRPOTrainer and not VLM and (test_train_with_tools or test_train_with_multiple_environments"
                   " or test_train_with_environment_factory or test_train_with_environment_owned"
                   " or test_train_with_malformed_tool_calls)",
    # the three that grpo-lab failed in earlier rounds for want of rollout_func, get_*_dataloader, training_step,
    # with the rest of the rollout_func dispatch class
    "earlier": "TestGRPORolloutDispatch or test_iterable_eval_keeps_map_style_train_workers"
               " or test_prepare_input_called_with_correct_data",
    # the vision-language class (issue 44): images in prompts, on the tiny VLM stand-ins below
    "vlm": "TestGRPOTrainerVLM",
}

# Qwen's tokenizer: the dashscope wheel that ships qwen.tiktoken (151,643 byte-level BPE ranks).
DASHSCOPE = "dashscope==2.0.2"
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Added tokens after the ranks, in Qwen's order: special ones (skipped by decode(skip_special_tokens=True)) and
# plain added ones (<tool_call> and friends are not special in Qwen's tokenizers: decoded text keeps them).
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN2_5_ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                 "<|repo_name|>", "<|file_sep|>"]                                       # Qwen2.5: 151,665 tokens
QWEN3_ADDED = QWEN2_5_ADDED + ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # Qwen3: 151,669
# A tool call as TRL's tests spell it in token ids, and its text: the built tokenizer must agree both ways.
PROBE_TEXT = '<tool_call>\n{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
PROBE_IDS = [151657, 198, 4913, 606, 788, 330, 64648, 22785, 497, 330, 16370, 788, 5212, 64, 788, 220, 18, 11, 330,
             65, 788, 220, 19, 11248, 151658, 151645]

# hub id -> (architecture, template, config overrides); shapes as TRL's generate_tiny_models scripts make them.
SMALL = dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
QWEN_IDS = dict(bos_token_id=151643, eos_token_id=151645)
MODELS = {
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": (
        "Qwen3MoeForCausalLM", "qwen3",
        dict(vocab_size=151936, hidden_size=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
             head_dim=128, **SMALL, **QWEN_IDS)),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": (
        "Qwen3ForCausalLM", "qwen3", dict(vocab_size=151669, hidden_size=8, **SMALL, **QWEN_IDS)),
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": (
        "Qwen2ForCausalLM", "qwen2_5", dict(vocab_size=151665, hidden_size=8, **SMALL, **QWEN_IDS)),
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": (
        "Qwen2ForSequenceClassification", "qwen2_5",
        dict(vocab_size=152064, hidden_size=16, num_labels=1, **SMALL, **QWEN_IDS)),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": (
        "Qwen3ForSequenceClassification", "qwen3",
        dict(vocab_size=151936, hidden_size=16, num_labels=1, **SMALL, **QWEN_IDS)),
}
SNAPSHOT_SHA = "0" * 40  # the local cache's one revision of every stand-in

# Vision-language stand-ins (TestGRPOTrainerVLM): random weights in the shapes of TRL's tiny VLMs (hidden size 16, 2
# layers; smaller pictures than the originals' so that a test trains in seconds on a CPU: 112-pixel LLaVA tiles, 224
# pixels and 64 soft tokens for Gemma 3, where the originals have 336 and 896 pixels), Qwen's tokenizer with the family's picture tokens, and a processor
# assembled from it and the family's image processor (the PIL backend: this machine has no torchvision). Qwen2-VL and
# Qwen2.5-VL are not built: their processors need a video processor, which transformers builds only with torchvision.
VLM_TINY_TEXT = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                     intermediate_size=32, vocab_size=None, **QWEN_IDS)
VLM_TINY_VISION = dict(hidden_size=16, num_attention_heads=4, num_hidden_layers=2, intermediate_size=32)
VLM_MODELS = ("trl-internal-testing/tiny-LlavaForConditionalGeneration",
              "trl-internal-testing/tiny-LlavaNextForConditionalGeneration",
              "trl-internal-testing/tiny-Gemma3ForConditionalGeneration")
# the image datasets TRL's VLM tests load, made by TRL's own scripts (random pictures, Zen of Python prompts)
IMAGE_DATASETS = {"trl-internal-testing/zen-image": "scripts/generate_zen_image_dataset.py",
                  "trl-internal-testing/zen-multi-image": "scripts/generate_zen_multi_image_dataset.py"}
# A ChatML template whose image parts become `picture` (each family's placeholder), as the originals place them.
VLM_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
                "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
                "PICTURE{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def default_cache() -> Path:
    base = os.environ.get("GRPO_LAB_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "grpo-lab") / "trl-suite"


# --- TRL's test files ------------------------------------------------------------------------------------------

def read_trl_tests(trl_repo: Path | None, rev: str, trl_tests: Path | None) -> dict[str, str]:
    "The texts of TRL's test files, from a folder or from a git clone of TRL at `rev`."
    if trl_tests is not None:
        return {name: (trl_tests / name).read_text() for name in TEST_FILES if (trl_tests / name).exists()}
    if trl_repo is None or not trl_repo.exists():
        raise SystemExit(f"no TRL clone at {trl_repo}: pass --trl-repo (a git dir of huggingface/trl) or --trl-tests "
                         "(a folder with test_grpo_trainer.py and testing_utils.py)")
    files = {}
    for name in TEST_FILES:
        out = subprocess.run(["git", f"--git-dir={trl_repo}", "show", f"{rev}:tests/{name}"],
                             capture_output=True, text=True)
        if out.returncode == 0:
            files[name] = out.stdout
    if "test_grpo_trainer.py" not in files:
        raise SystemExit(f"{trl_repo} has no tests/test_grpo_trainer.py at {rev}")
    return files


def trl_repo_file(trl_repo: Path, rev: str, path: str) -> str:
    return subprocess.run(["git", f"--git-dir={trl_repo}", "show", f"{rev}:{path}"],
                          capture_output=True, text=True, check=True).stdout


# TRL's testing_utils.py of a given revision may import an `is_<package>_available` helper that the installed TRL
# no longer has (e.g. is_joblib_available): this conftest answers such names from the installed packages.
SHIM_CONFTEST = '''"""Written by grpo-lab's tests/trl_suite.py: is_<package>_available helpers the installed TRL lacks."""
import importlib.util

from trl import import_utils


def _is_available(name):
    if name.startswith("is_") and name.endswith("_available"):
        package = name[len("is_"):-len("_available")]
        return lambda: importlib.util.find_spec(package) is not None
    raise AttributeError(name)


import_utils.__getattr__ = _is_available
'''


def write_suite(files: dict[str, str], against: str, dest: Path) -> Path:
    "TRL's test files as a package in `dest`; for grpo-lab the trainer import is the only line changed."
    package = dest / "trl_tests"
    package.mkdir(parents=True, exist_ok=True)
    (dest / "conftest.py").write_text(SHIM_CONFTEST)
    (package / "__init__.py").write_text("")
    for name, text in files.items():
        if name == "test_grpo_trainer.py" and against == "grpo-lab":
            if text.count(TRL_IMPORT) != 1:
                raise SystemExit(f"expected the line {TRL_IMPORT.strip()!r} once in TRL's test file")
            text = text.replace(TRL_IMPORT, GRPO_LAB_IMPORT)
        (package / name).write_text(text)
    return package


# --- the tokenizer ---------------------------------------------------------------------------------------------

def qwen_tiktoken(cache: Path) -> Path:
    "qwen.tiktoken from the dashscope wheel (downloaded once into the cache with pip, never installed)."
    target = cache / "qwen.tiktoken"
    if target.exists():
        return target
    wheels = cache / "wheels"
    found = sorted(wheels.glob("dashscope-*.whl")) if wheels.exists() else []
    if not found:
        print(f"trl_suite: downloading {DASHSCOPE} (no dependencies) for Qwen's tokenizer vocabulary", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", DASHSCOPE, "-d", str(wheels)],
                       check=True)
        found = sorted(wheels.glob("dashscope-*.whl"))
    import zipfile
    with zipfile.ZipFile(found[-1]) as wheel:
        target.write_bytes(wheel.read("dashscope/resources/qwen.tiktoken"))
    return target


def qwen_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != 151643:
        raise SystemExit(f"{path} has {len(ranks)} tokens, Qwen's vocabulary has 151,643")
    return ranks


def build_tokenizer(cache: Path, added: list[str], template: str):
    "A Qwen tokenizer (fast): the BPE ranks, the special tokens, the `added` plain tokens, TRL's copy of `template`."
    import trl
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = qwen_tiktoken(cache)

    class QwenConverter(TikTokenConverter):
        def load_tiktoken_bpe(self, path):  # the converter's own reader needs the tiktoken package
            return qwen_ranks(Path(path))

    backend = QwenConverter(vocab_file=str(ranks_file), pattern=QWEN_PATTERN,
                            extra_special_tokens=QWEN_SPECIAL).converted()
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    backend.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token=None, unk_token=None, model_max_length=131072)
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    expected_size = 151643 + len(QWEN_SPECIAL) + len(added)
    if ids != PROBE_IDS or tokenizer.decode(PROBE_IDS) != PROBE_TEXT or len(tokenizer) != expected_size \
            or "<tool_call>" not in tokenizer.decode(PROBE_IDS, skip_special_tokens=True):
        raise SystemExit(f"the built tokenizer does not spell TRL's probe tool call as Qwen does: {ids}")
    return tokenizer


# --- the models ------------------------------------------------------------------------------------------------

def hub_folder(hub: Path, repo_id: str, kind: str = "models") -> Path:
    "The snapshot folder of `repo_id` in a Hugging Face hub cache, with refs/main pointing at it."
    root = hub / f"{kind}--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(SNAPSHOT_SHA)
    folder = root / "snapshots" / SNAPSHOT_SHA
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def tiny_random_model(model_cls, config, seed: int):
    "A model as TRL's tiny test models are made: bf16, Xavier-initialised linears, small embeddings (no NaNs in bf16)."
    import torch
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=0.02)
    return model


def build_model(hub: Path, repo_id: str, tokenizers: dict, seed: int = 0):
    import torch
    import transformers
    from transformers import GenerationConfig

    architecture, template, overrides = MODELS[repo_id]
    folder = hub_folder(hub, repo_id)
    if (folder / "config.json").exists():
        return
    model_cls = getattr(transformers, architecture)
    config = model_cls.config_class(**overrides)
    tiny_random_model(model_cls, config, seed).save_pretrained(folder)
    tokenizers[template].save_pretrained(folder)
    GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(folder)


def vlm_tokenizer(cache: Path, pictures: list[str], extra: dict | None = None):
    "Qwen2.5's tokenizer with a family's picture tokens added (special) and `extra` named special tokens."
    tokenizer = build_tokenizer(cache, QWEN2_5_ADDED, "qwen2_5")
    tokenizer.add_special_tokens({"additional_special_tokens": pictures}, replace_extra_special_tokens=False)
    if extra:
        tokenizer._set_model_specific_special_tokens(special_tokens=extra)   # boi_token, boi_token_id, ... (Gemma 3)
    return tokenizer


def build_vlm(hub: Path, repo_id: str, cache: Path, seed: int = 0):
    "A tiny random VLM of `repo_id`'s family and its processor, in the local hub cache."
    import torch
    import transformers
    from transformers import GenerationConfig
    folder = hub_folder(hub, repo_id)
    if (folder / "config.json").exists():
        return
    family = repo_id.rsplit("tiny-", 1)[1]
    if family.startswith("Llava"):
        tokenizer = vlm_tokenizer(cache, ["<image>"])
        template = VLM_TEMPLATE.replace("PICTURE", "<image>")
        text = transformers.LlamaConfig(**{**VLM_TINY_TEXT, "vocab_size": len(tokenizer)})
        vision = transformers.CLIPVisionConfig(**VLM_TINY_VISION, image_size=112, patch_size=14, projection_dim=16)
        image_id = tokenizer.convert_tokens_to_ids("<image>")
        size = {"shortest_edge": 112}, {"height": 112, "width": 112}
        if family.startswith("LlavaNext"):   # llava-v1.6's anyres tiling: tiles on a grid of pinpoints (its, / 3)
            pinpoints = [[112, 224], [224, 112], [224, 224], [336, 112], [112, 336]]
            config = transformers.LlavaNextConfig(text_config=text, vision_config=vision, image_token_id=image_id,
                                                  image_grid_pinpoints=pinpoints, vision_feature_layer=-2,
                                                  vision_feature_select_strategy="default")
            images = transformers.LlavaNextImageProcessorPil(size=size[0], crop_size=size[1],
                                                             image_grid_pinpoints=pinpoints)
            processor = transformers.LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                                                        vision_feature_select_strategy="default",
                                                        image_token="<image>", num_additional_image_tokens=1,
                                                        chat_template=template)
            model_cls = transformers.LlavaNextForConditionalGeneration
        else:
            config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_id=image_id,
                                              vision_feature_layer=-2, vision_feature_select_strategy="default")
            images = transformers.CLIPImageProcessorPil(size=size[0], crop_size=size[1])
            processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                                                    vision_feature_select_strategy="default", image_token="<image>",
                                                    num_additional_image_tokens=1, chat_template=template)
            model_cls = transformers.LlavaForConditionalGeneration
    else:                                    # Gemma 3: SigLIP (896 pixels, 256 soft tokens in the original)
        marks = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
        tokenizer = vlm_tokenizer(cache, list(marks.values()), marks)
        template = VLM_TEMPLATE.replace("PICTURE", "<start_of_image>")
        ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in marks.items()}
        text = transformers.Gemma3TextConfig(**{**VLM_TINY_TEXT, "vocab_size": len(tokenizer)}, head_dim=8)
        vision = transformers.SiglipVisionConfig(**VLM_TINY_VISION, image_size=224, patch_size=14,
                                                 vision_use_head=False)       # as Gemma 3's own: no pooling head
        config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=64,
                                           boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                                           image_token_index=ids["image_token"])
        images = transformers.Gemma3ImageProcessorPil(size={"height": 224, "width": 224})
        processor = transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=64,
                                                 chat_template=template)
        model_cls = transformers.Gemma3ForConditionalGeneration
    tiny_random_model(model_cls, config, seed).save_pretrained(folder)
    processor.save_pretrained(folder)
    GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(folder)


# --- the zen dataset -------------------------------------------------------------------------------------------

def build_zen(datasets_cache: Path, trl_repo: Path, rev: str, repo_id: str = "trl-internal-testing/zen",
              script: str = "scripts/generate_zen_dataset.py"):
    "TRL's dataset script (generate_zen_dataset.py by default), its push_to_hub replaced by a write into the local cache."
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    name = repo_id.split("/")[1]
    final = datasets_cache / f"trl-internal-testing___{name}"
    if final.exists():
        return
    source = trl_repo_file(trl_repo, rev, script)
    configs = {}

    def capture(self, repo_id, config_name="default", **kwargs):
        configs[config_name] = self

    module = types.ModuleType("generate_zen_dataset")
    exec(compile(source, "generate_zen_dataset.py", "exec"), module.__dict__)
    original = datasets.DatasetDict.push_to_hub
    datasets.DatasetDict.push_to_hub = capture
    try:
        module.main(test_size=0.1, push_to_hub=True, repo_id=repo_id)
    finally:
        datasets.DatasetDict.push_to_hub = original
    building = datasets_cache / name
    shutil.rmtree(building, ignore_errors=True)
    with tempfile.TemporaryDirectory() as scratch:
        for config, splits in configs.items():
            files = {}
            for split, dataset in splits.items():
                files[split] = str(Path(scratch) / f"{config}-{split}.parquet")
                dataset.to_parquet(files[split])
            builder = Parquet(cache_dir=str(datasets_cache), dataset_name=name, config_name=config,
                              hash=SNAPSHOT_SHA, data_files=files)
            builder.download_and_prepare()
            config_dir = Path(builder.cache_dir).parents[1]  # zen/<name>-<data files hash>/0.0.0/<sha>
            config_dir.rename(building / config)
    building.rename(final)  # where datasets looks for trl-internal-testing/<name> when offline


def build_cache(cache: Path, trl_repo: Path, rev: str) -> dict[str, str]:
    "Build what is missing; return the environment that serves it."
    hub, datasets_cache = cache / "hub", cache / "datasets"
    env = {"HF_HUB_CACHE": str(hub), "HF_DATASETS_CACHE": str(datasets_cache), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    os.environ.update(env)
    missing = [r for r in MODELS if not (hub_folder(hub, r) / "config.json").exists()]
    if missing:
        tokenizers = {"qwen3": build_tokenizer(cache, QWEN3_ADDED, "qwen3"),
                      "qwen2_5": build_tokenizer(cache, QWEN2_5_ADDED, "qwen2_5")}
        for repo_id in missing:
            print(f"trl_suite: building {repo_id}", flush=True)
            build_model(hub, repo_id, tokenizers)
    build_zen(datasets_cache, trl_repo, rev)
    for repo_id in VLM_MODELS:
        if not (hub_folder(hub, repo_id) / "config.json").exists():
            print(f"trl_suite: building {repo_id}", flush=True)
            build_vlm(hub, repo_id, cache)
    for repo_id, script in IMAGE_DATASETS.items():
        build_zen(datasets_cache, trl_repo, rev, repo_id, script)
    return env


# --- running and counting --------------------------------------------------------------------------------------

def count(junit: Path) -> dict:
    "Outcome of every test case in pytest's junit report: passed, failed, error, skipped (xfail counts as skipped)."
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
                break
        results[name] = {"outcome": outcome, "message": message}
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", choices=["trl", "grpo-lab"], default="grpo-lab")
    parser.add_argument("--select", choices=sorted(SELECTIONS), help="a named selection (see SELECTIONS)")
    parser.add_argument("-k", dest="keyword", help="a pytest -k expression (with --select: both must match)")
    parser.add_argument("--trl-repo", type=Path, default=Path(os.environ.get("TRL_REPO", DEFAULT_REPO)))
    parser.add_argument("--rev", default="HEAD", help="the revision of TRL's repository to read the tests from")
    parser.add_argument("--trl-tests", type=Path, help="a folder with TRL's test_grpo_trainer.py and testing_utils.py")
    parser.add_argument("--cache", type=Path, default=default_cache())
    parser.add_argument("--json", type=Path, help="write the per-test outcomes here")
    parser.add_argument("--keep", type=Path, help="write the suite here (kept) instead of a temporary folder")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)

    files = read_trl_tests(None if args.trl_tests else args.trl_repo, args.rev, args.trl_tests)
    env = build_cache(args.cache, args.trl_repo, args.rev)
    keyword = " and ".join(f"({k})" for k in (SELECTIONS.get(args.select), args.keyword) if k)
    with tempfile.TemporaryDirectory() as scratch:
        dest = args.keep or Path(scratch)
        package = write_suite(files, args.against, dest)
        junit = dest / "junit.xml"
        command = [sys.executable, "-m", "pytest", str(package / "test_grpo_trainer.py"), "-p", "no:cacheprovider",
                   f"--rootdir={dest}", "-o", "addopts=", "-v", "--durations=0", f"--junitxml={junit}", *(["-k", keyword] if keyword else []),
                   *args.pytest_args]
        run_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TRL_EXPERIMENTAL_SILENCE": "1"}
        status = subprocess.run(command, cwd=dest, env=run_env).returncode
        results = count(junit) if junit.exists() else {}
    totals = {o: sum(r["outcome"] == o for r in results.values()) for o in ("passed", "failed", "error", "skipped")}
    print(f"\ntrl_suite against {args.against} ({args.select or 'all'}{' -k ' + args.keyword if args.keyword else ''}): "
          + ", ".join(f"{n} {o}" for o, n in totals.items()))
    for name, result in results.items():
        if result["outcome"] != "passed":
            print(f"  {result['outcome']:7} {name}: {result['message']}")
    if args.json:
        args.json.write_text(json.dumps({"against": args.against, "select": args.select, "keyword": args.keyword,
                                         "totals": totals, "tests": results}, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
