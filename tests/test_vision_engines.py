"""The shared prefill with pictures (issue 44): each group's prompt and pictures are read once, the vision tower runs
once per group, and the G completions carry on from that cache, sampling exactly what padded `generate` samples
(greedy and seeded, fp32), in the engine and through a short training run."""
import pytest
import torch
from PIL import Image

import grpo_lab.rollout as rollout_module
from grpo_lab import GRPOConfig, GRPOTrainer
from transformers import GenerationConfig

from grpo_lab.rollout import GenerateEngine, SamplingSettings, prefill_once_per_prompt, sample_completions
from grpo_lab.vision import image_token_ids, prepare_image_prompts, tiny_vlm_path

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}
QUESTIONS = ["Which colour?", "Name it", "What colour is this square, please?"]     # 3 lengths: left padding


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    path = tiny_vlm_path(cache_dir=tmp_path_factory.mktemp("vlm-cache"))
    return path, AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(path).eval()


def picture_rows(G: int = 4) -> list[dict]:
    "3 prompts of different lengths, each with its own colour square, repeated G times (a group each)."
    return [{"prompt": [{"role": "user", "content": q}], "image": Image.new("RGB", (32, 32), rgb)}
            for q, rgb in zip(QUESTIONS, COLOURS.values()) for _ in range(G)]


def picture_batch(processor, G: int = 4):
    group = torch.arange(3).repeat_interleave(G)
    _, ids, mask, images = prepare_image_prompts(picture_rows(G), group, processor)
    return ids, mask, images, group


def vision_tower_rows(model, run) -> list[int]:
    "The number of pictures each call of the vision tower saw while `run()` ran."
    seen = []
    hook = model.model.vision_tower.register_forward_hook(lambda m, inp, out: seen.append(inp[0].size(0)))
    try:
        run()
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("settings", [dict(do_sample=False), dict(do_sample=True, temperature=0.9, top_k=30)])
def test_shared_prefill_with_pictures_samples_what_padded_generate_samples(vlm, settings):
    "Same seed, same tokens; the pictures go through the vision tower once per group (3) instead of once per row (12)."
    _, processor, model = vlm
    ids, mask, images, group = picture_batch(processor)
    assert (mask == 0).any(1).sum() == 8                                  # two of the three prompts are left-padded
    config = GenerationConfig(max_new_tokens=10, eos_token_id=[], pad_token_id=processor.tokenizer.pad_token_id,
                              suppress_tokens=image_token_ids(processor), **settings)
    out = {}
    for share in (False, True):
        torch.manual_seed(0)
        seen = vision_tower_rows(model, lambda: out.__setitem__(
            share, sample_completions(model, ids, mask, config, [], share, group, images)[0]))
        assert seen == ([12] if not share else [3]), seen
    assert out[True].shape == (12, 10) and torch.equal(out[True], out[False])
    if settings["do_sample"]:
        assert len({tuple(r) for r in out[True][:4].tolist()}) > 1       # still G different samples of a prompt


def test_shared_cache_holds_the_pictures_and_its_logits_match_padded_generate(vlm):
    """Step by step, the logits from the shared cache equal padded generate's within 1e-4; a prefill that left the
    pictures out gives other logits, so the comparison would see a cache without them."""
    _, processor, model = vlm
    ids, mask, images, group = picture_batch(processor)
    width = ids.size(1)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=[], output_logits=True,
                              return_dict_in_generate=True, pad_token_id=processor.tokenizer.pad_token_id)
    with torch.no_grad():
        padded = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                **images.forward_kwargs(width, width))
        shared = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                cache=prefill_once_per_prompt(model, ids, mask, group, images))
        blind = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                               cache=prefill_once_per_prompt(model, ids, mask, group))
    assert torch.equal(padded.sequences, shared.sequences)
    for a, b in zip(padded.logits, shared.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert (padded.logits[0] - blind.logits[0]).abs().max() > 1e-2       # the pictures change what comes next


def test_the_engine_shares_the_prefill_with_pictures_and_samples_the_same_completions(vlm):
    "GenerateEngine with a processor: share_prefill=True and False give the same completions for a seed."
    _, processor, model = vlm
    rows, group = picture_rows(), torch.arange(3).repeat_interleave(4)
    settings = SamplingSettings(max_new_tokens=8, eos_token_ids=[processor.tokenizer.eos_token_id],
                                pad_token_id=processor.tokenizer.pad_token_id)
    out = {}
    for share in (False, True):
        torch.manual_seed(1)
        out[share] = GenerateEngine(processor, share_prefill=share).generate(rows, group, model, settings, 0)
    assert torch.equal(out[True].completion_ids, out[False].completion_ids)
    assert torch.equal(out[True].completion_mask, out[False].completion_mask)
    assert out[True].image_inputs.rows[0] is out[True].image_inputs.rows[3]     # the group's tensors, not copies


def test_a_model_whose_positions_follow_its_pictures_is_not_prefilled_apart(vlm):
    "Qwen2-VL's 3-D rotary positions come from the pictures' grids: such a model takes padded generate with pictures."
    _, processor, model = vlm
    ids = torch.ones(2, 5, dtype=torch.long)
    config = GenerationConfig(do_sample=False, max_new_tokens=2)
    assert not rollout_module.positions_follow_pictures(model)                  # LLaVA: 1-D positions
    assert rollout_module._can_share_prefill(model, config, ids, pictures=True)
    model.model.get_rope_index = lambda *a, **k: None                           # what Qwen2-VL's model has
    try:
        assert rollout_module.positions_follow_pictures(model)
        assert not rollout_module._can_share_prefill(model, config, ids, pictures=True)
        assert rollout_module._can_share_prefill(model, config, ids, pictures=False)   # text batches still share
    finally:
        del model.model.get_rope_index


def dataset(n: int = 8):
    from datasets import Dataset
    names = [list(COLOURS)[i % 3] for i in range(n)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": QUESTIONS[i % 3]}] for i in range(n)],
                              "image": [Image.new("RGB", (32, 32), COLOURS[c]) for c in names], "answer": names})


def distinct_characters(completions, **kwargs):
    return [float(len(set(c[0]["content"]))) for c in completions]


def test_training_with_pictures_is_the_same_with_the_shared_prefill(vlm, tmp_path, monkeypatch):
    """Two LoRA steps with pictures, shared prefill vs padded generate, same seed: the per-step logs agree to 1e-4
    (as the text engines' runs, test_static_engine) and the adapters end equal to 1e-5; the shared one really ran."""
    path, processor, _ = vlm
    prefilled, real = [], rollout_module.prefill_once_per_prompt
    monkeypatch.setattr(rollout_module, "prefill_once_per_prompt",
                        lambda *a: prefilled.append(len(a) == 5 and a[4] is not None) or real(*a))
    runs = {}
    for share in (False, True):
        args = GRPOConfig(output_dir=str(tmp_path / str(share)), per_device_train_batch_size=4, num_generations=4,
                          gradient_accumulation_steps=2, max_completion_length=6, max_steps=2, learning_rate=5e-3,
                          save_strategy="no", report_to="none", disable_tqdm=True, seed=0, logging_steps=1,
                          use_cpu=True, bf16=False, gradient_checkpointing=False, beta=0.04)
        trainer = GRPOTrainer(str(path), distinct_characters, args=args, train_dataset=dataset(), lora_r=4,
                              engine=GenerateEngine(processor, share_prefill=share))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.train()
        after = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert any(not torch.equal(before[n], after[n]) for n in after)     # the adapter learned something
        runs[share] = ([{k: v for k, v in h.items() if isinstance(v, float) and "time" not in k and "per_second" not in k}
                        for h in trainer.history], after)
    assert prefilled == [True, True]                    # each generation batch (one a step) prefilled with its pictures
    (plain_logs, plain_weights), (shared_logs, shared_weights) = runs[False], runs[True]
    assert len(plain_logs) == 2 and [set(h) for h in plain_logs] == [set(h) for h in shared_logs]
    for a, b in zip(plain_logs, shared_logs):
        assert b == pytest.approx(a, abs=1e-4), (a, b)
    assert any(h["reward_std"] > 0 for h in plain_logs)                   # the advantages were not all zero
    for name in plain_weights:
        torch.testing.assert_close(shared_weights[name], plain_weights[name], atol=1e-5, rtol=0)



# --- the other families TRL's VLM tests use: LLaVA-NeXT (tiles, `image_sizes`) and Gemma 3 (`token_type_ids`) ---

def _qwen_vocabulary():
    "Where tests/trl_suite.py keeps Qwen's vocabulary for its stand-ins (None: not there, and this test never fetches it)."
    from trl_suite import default_cache
    found = default_cache() / "qwen.tiktoken"
    return found if found.exists() else None


@pytest.mark.slow
@pytest.mark.skipif(_qwen_vocabulary() is None, reason="needs tests/trl_suite.py's Qwen vocabulary in its cache "
                    "(python tests/trl_suite.py --select vlm builds it once)")
@pytest.mark.parametrize("family", ["LlavaNextForConditionalGeneration", "Gemma3ForConditionalGeneration"])
def test_trl_stand_in_families_sample_the_same_with_the_shared_prefill(tmp_path, family):
    """TRL's tiny LLaVA-NeXT (pictures of 3 sizes: different tile counts and `image_sizes`) and Gemma 3 (per-token
    `token_type_ids`), built as tests/trl_suite.py builds them, in fp32: greedy and seeded sampling give the same tokens
    with the shared prefill as with padded generate."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl_suite import build_vlm, default_cache, hub_folder
    repo = f"trl-internal-testing/tiny-{family}"
    build_vlm(tmp_path, repo, default_cache())
    processor = AutoProcessor.from_pretrained(hub_folder(tmp_path, repo))
    model = AutoModelForImageTextToText.from_pretrained(hub_folder(tmp_path, repo), dtype=torch.float32).eval()
    sizes = [(40, 30), (90, 200), (250, 120)]
    rows = [{"prompt": [{"role": "user", "content": q}], "image": Image.new("RGB", size, (80 * i, 200 - 60 * i, 90))}
            for i, (q, size) in enumerate(zip(QUESTIONS, sizes)) for _ in range(4)]
    group = torch.arange(3).repeat_interleave(4)
    for do_sample in (False, True):
        settings = SamplingSettings(max_new_tokens=6, eos_token_ids=[], pad_token_id=processor.tokenizer.pad_token_id,
                                    generation_kwargs={"do_sample": do_sample})
        out = {}
        for share in (False, True):
            torch.manual_seed(0)
            out[share] = GenerateEngine(processor, share_prefill=share).generate(rows, group, model, settings, 0)
        assert torch.equal(out[True].completion_ids, out[False].completion_ids), (family, do_sample)
        assert len({tuple(r) for r in out[True].completion_ids.tolist()}) == (12 if do_sample else 3)
    keys = set(out[True].image_inputs.rows[0])
    assert keys >= ({"image_sizes"} if family.startswith("LlavaNext") else {"token_type_ids"}), keys


# --- the vision path on 2 processes (a CPU twin of a multi-GPU run) ---

TWO_PROCESS_SCRIPT = '''
import hashlib, json, sys
import torch
from datasets import Dataset
from PIL import Image
from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.scoring import model_tokens
out, model = sys.argv[1], MODEL
squares = [Image.new("RGB", (32, 32), rgb) for rgb in ((220, 30, 30), (30, 30, 220))]
data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Which colour?"}]] * 4,
                          "image": [squares[0], None, squares[1], None]})    # rows 0 and 2 have a picture, 1 and 3 none
distinct = lambda completions, **kw: [float(len(set(c[0]["content"]))) for c in completions]
args = GRPOConfig(output_dir=out + "/run", per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                  max_steps=2, learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                  disable_tqdm=True, shuffle_dataset=False, gradient_checkpointing=False, beta=0.04)
trainer = GRPOTrainer(model, distinct, args=args, train_dataset=data, lora_r=LORA_R)
seen, score = [], trainer.score_rollout
def scoring(rows, completions):
    seen.append({"pictures": sum(bool(r) for r in completions.image_inputs.rows),
                 "tokens": int(completions.prompt_mask.sum() + model_tokens(completions.completion_mask, completions.tool_mask).sum())})
    return score(rows, completions)
trainer.score_rollout = scoring
weights = lambda: hashlib.sha256(b"".join(p.detach().numpy().tobytes() for n, p in
                                          sorted(trainer.model.named_parameters()) if p.requires_grad)).hexdigest()
before = weights()
trainer.train()
acc = trainer.accelerator
json.dump({"world": acc.num_processes, "before": before, "after": weights(), "seen": seen,
           "num_tokens": [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h],
           "pictures_logged": [p is not None for p in trainer._logs["images"]]},
          open(out + f"/rank{acc.process_index}.json", "w"))
'''


@pytest.mark.parametrize("lora_r", [4, None], ids=["lora", "full"])
def test_two_processes_one_with_pictures_stay_in_sync(vlm, tmp_path, lora_r):
    """Under `accelerate launch` (2 CPU processes, gloo), rank 0's batches hold pictures and rank 1's none: both ranks
    end with the same trained weights (moved from the start), and the logged token counts and pictures cover both.
    Full fine-tuning leaves the vision tower without a gradient on rank 1: DDP needs `find_unused_parameters`, which
    grpo-lab sets by the HF Trainer's rule (`settle_ddp_options`); before it did, this run stopped with DDP's error."""
    from test_scale import TINY, run_two_cpu_processes
    path, _, _ = vlm
    script = TWO_PROCESS_SCRIPT.replace("MODEL", repr(str(path))).replace("LORA_R", repr(lora_r))
    ranks = run_two_cpu_processes(tmp_path, script, TINY)
    assert [r["world"] for r in ranks] == [2, 2]
    assert [s["pictures"] for s in ranks[0]["seen"]] == [4, 4] and [s["pictures"] for s in ranks[1]["seen"]] == [0, 0]
    assert ranks[0]["before"] == ranks[1]["before"] != ranks[0]["after"]
    assert ranks[0]["after"] == ranks[1]["after"]                    # gradients averaged over both ranks each step
    both = [a["tokens"] + b["tokens"] for a, b in zip(ranks[0]["seen"], ranks[1]["seen"])]
    for rank in ranks:                                               # num_tokens sums both ranks' tokens, step by step
        assert rank["num_tokens"] == [both[0], both[0] + both[1]], (rank["num_tokens"], both)
    assert ranks[0]["seen"][0]["tokens"] > ranks[1]["seen"][0]["tokens"]   # the picture tokens are counted too
    assert ranks[0]["pictures_logged"].count(True) == 4 and len(ranks[0]["pictures_logged"]) == 8   # the last step's 8 rows
