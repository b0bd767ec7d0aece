"""Pictures in prompts (issue 44): a tiny vision-language model built offline trains through GRPOTrainer with TRL
1.16's data layout, each completion's forward passes get its own prompt's pictures, picture tokens stay out of the
loss, and one step matches TRL 1.16's on the same model, pictures and completions."""
import copy
import math

import pytest
import torch
from datasets import Dataset
from PIL import Image

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.loss import completion_logps
from grpo_lab.rollout import Completions, GenerateEngine, RolloutEngine, completion_mask
from grpo_lab.vision import (ImageInputs, forward_inputs, image_token_ids, prepare_image_prompts, tiny_vlm_path)

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30), "yellow": (230, 220, 40)}


def square(colour: str) -> Image.Image:
    return Image.new("RGB", (32, 32), COLOURS[colour])


def colour_dataset(n: int = 8, column: str = "image") -> Dataset:
    "TRL's layout: a conversational prompt without image parts, the picture in an `image` (or `images`) column."
    names = [list(COLOURS)[i % len(COLOURS)] for i in range(n)]
    pictures = [square(c) for c in names] if column == "image" else [[square(c)] for c in names]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "Which colour?"}]] * n, column: pictures,
                              "answer": names})


def distinct_characters(completions, **kwargs):
    "Varied within a group for a random model: the number of distinct characters of the completion."
    return [float(len(set(c[0]["content"] if isinstance(c, list) else c))) for c in completions]


def settings(tmp_path, **kw) -> dict:
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                max_steps=2, save_strategy="no", report_to="none", disable_tqdm=True, learning_rate=5e-3, seed=0,
                gradient_checkpointing=False, logging_steps=1, use_cpu=True, bf16=False)
    return {**base, **kw}


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return tiny_vlm_path(cache_dir=tmp_path_factory.mktemp("vlm-cache"))


def keep_rollouts(trainer) -> list:
    "The rollouts the trainer scores (its `score_rollout` hook, wrapped on the instance)."
    kept, score = [], trainer.score_rollout

    def scoring(rows, out):
        kept.append(score(rows, out))
        return kept[-1]

    trainer.score_rollout = scoring
    return kept


def test_two_steps_train_lora_on_the_language_model_with_pictures(vlm_path, tmp_path):
    trainer = GRPOTrainer(str(vlm_path), distinct_characters, args=GRPOConfig(**settings(tmp_path, beta=0.04)),
                          train_dataset=colour_dataset(), lora_r=4)
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("language_model" in n for n in trainable), "LoRA only on the language model by default"
    rollouts = keep_rollouts(trainer)
    trainer.train()
    losses = [h["loss"] for h in trainer.history]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert all(h["reward_std"] > 0 for h in trainer.history)          # the advantages were not all zero
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(trainable[n], p)]
    assert len(moved) == len(trainable), f"{len(trainable) - len(moved)} LoRA tensors did not move"
    picture_id = image_token_ids(trainer.processing_class)[0]
    for rollout in rollouts:
        assert len(rollout.image_inputs) == len(rollout) == 4
        assert ((rollout.prompt_ids == picture_id).sum(1) == 16).all()     # 16 picture tokens per prompt
        assert not (rollout.completion_ids == picture_id).any()             # never sampled
    assert len(trainer._logs["images"]) == 4 and isinstance(trainer._logs["images"][0][0], Image.Image)


def test_picture_tokens_are_never_sampled_nor_learned_from_even_by_a_model_that_prefers_them(vlm_path, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    processor = AutoProcessor.from_pretrained(vlm_path)
    model = AutoModelForImageTextToText.from_pretrained(vlm_path)
    picture_id = image_token_ids(processor)[0]
    with torch.no_grad():         # the LM head is tied to the embeddings: a long picture-token row wins the logits
        model.get_output_embeddings().weight[picture_id] *= 60
    rows = [dict(r) for r in colour_dataset(4)]
    texts, ids, mask, images = prepare_image_prompts(rows, torch.tensor([0, 1, 2, 3]), processor)
    plain = model.generate(input_ids=ids, attention_mask=mask, **images.forward_kwargs(ids.size(1), ids.size(1)),
                           max_new_tokens=6, do_sample=True)[:, ids.size(1):]
    assert (plain == picture_id).float().mean() > 0.3        # without suppression the model samples them
    engine = GenerateEngine(processor, share_prefill=False)
    trainer = GRPOTrainer(model, distinct_characters, args=GRPOConfig(**settings(tmp_path, max_steps=1)),
                          train_dataset=colour_dataset(), processing_class=processor, engine=engine)
    out = engine.generate(rows, torch.tensor([0, 0, 1, 1]), model, trainer.sampling, 0)
    assert not (out.completion_ids == picture_id).any()
    forced = torch.where(torch.rand(out.completion_ids.shape) < 0.5, torch.full_like(out.completion_ids, picture_id),
                         out.completion_ids)        # a sampler that let them through (a rollout_func, another engine)
    from grpo_lab.vision import mask_image_tokens
    loss_mask = mask_image_tokens(forced, out.completion_mask, [picture_id])
    assert (loss_mask[forced == picture_id] == 0).all() and torch.equal(loss_mask[forced != picture_id],
                                                                         out.completion_mask[forced != picture_id])


def test_each_completion_is_scored_with_its_own_prompts_pictures(vlm_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    processor = AutoProcessor.from_pretrained(vlm_path)
    model = AutoModelForImageTextToText.from_pretrained(vlm_path).eval()
    rows = [{"prompt": [{"role": "user", "content": "Which colour?"}], "image": square(c)}
            for c in ("red", "red", "blue", "blue")]
    texts, ids, mask, images = prepare_image_prompts(rows, torch.tensor([0, 0, 1, 1]), processor)
    completion = torch.tensor([[processor.tokenizer.convert_tokens_to_ids(ch) for ch in "blue"]] * 4)
    from grpo_lab.rollout import Rollout
    batch = Rollout(ids, mask, completion, torch.ones_like(completion), torch.zeros(4), image_inputs=images)
    full = torch.cat([ids, completion], 1), torch.cat([mask, torch.ones_like(completion)], 1)
    with torch.no_grad():
        logps, _ = completion_logps(model, *full, 4, model_inputs=forward_inputs(batch), batch_size=1)
        swapped = Rollout(ids, mask, completion, torch.ones_like(completion), torch.zeros(4),
                          image_inputs=ImageInputs([images.rows[i] for i in (2, 3, 0, 1)]))
        other, _ = completion_logps(model, *full, 4, model_inputs=forward_inputs(swapped))
        micro = batch.select(torch.tensor([1, 2]))
        part, _ = completion_logps(model, torch.cat([micro.prompt_ids, micro.completion_ids], 1),
                                   torch.cat([micro.prompt_mask, micro.completion_mask], 1), 4,
                                   model_inputs=forward_inputs(micro))
    torch.testing.assert_close(logps[0], logps[1]) and torch.testing.assert_close(logps[2], logps[3])
    assert (logps[0] - logps[2]).abs().max() > 1e-3          # a red and a blue picture give different log-probs
    torch.testing.assert_close(other, logps[[2, 3, 0, 1]])   # the pictures, not the row numbers, decide them
    torch.testing.assert_close(part, logps[1:3])              # a micro-batch keeps its rows' pictures



def test_a_plain_string_prompt_with_a_picture_is_refused_with_the_sentence_that_says_why(vlm_path):
    "A string prompt has no turn to put a picture in: the refusal names it (it used to fail inside with_images)."
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(vlm_path)
    for row in ({"prompt": "Which colour?", "image": square("red")}, {"prompt": "Which colour?"}):
        with pytest.raises(ValueError, match="row 0: pictures need a conversational prompt .* got str"):
            prepare_image_prompts([row], torch.tensor([0]), processor)

# --- parity with TRL 1.16: one step on the same model, pictures and completions ---

class ReplayEngine(RolloutEngine):
    "TRL's completions of the same prompts, with grpo-lab's own prompt ids and pictures (checked equal to TRL's ids)."
    def __init__(self, processor, batch: dict):
        self.processor, self.batch = processor, batch

    def generate(self, rows, group, policy, settings, step) -> Completions:
        texts, ids, mask, images = prepare_image_prompts(rows, group, self.processor, settings.chat_template_kwargs)
        pad = settings.pad_token_id
        theirs = [[pad] * (ids.size(1) - len(x)) + x for x in self.batch["prompt_ids"]]
        assert ids.tolist() == theirs, "grpo-lab's prompt ids with their picture tokens differ from TRL's"
        width = max(len(x) for x in self.batch["completion_ids"])
        completion_ids = torch.tensor([x + [pad] * (width - len(x)) for x in self.batch["completion_ids"]])
        c_mask, truncated = completion_mask(completion_ids, settings.eos_token_ids)
        return Completions(texts, ids, mask, completion_ids, c_mask, truncated, group, image_inputs=images)


def test_one_step_matches_trl_on_the_same_pictures_and_completions(vlm_path, tmp_path):
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    torch.manual_seed(0)
    base = AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                      exclude_modules=r".*vision_tower.*", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    processor = AutoProcessor.from_pretrained(vlm_path)

    class Grads(TrainerCallback):
        def __init__(self, model):
            self.model, self.grads = model, []

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.grads.append(torch.cat([p.grad.flatten() for n, p in sorted(self.model.named_parameters())
                                         if "lora_" in n and p.grad is not None]))

    common = settings(tmp_path, max_steps=1, shuffle_dataset=False, temperature=0.7, loss_type="dapo", beta=0.04,
                      per_device_train_batch_size=8)             # two prompts, a red and a blue picture
    data = colour_dataset(2)
    trl_model, lab_model = copy.deepcopy(model), copy.deepcopy(model)
    trl_grads = Grads(trl_model)
    trainer = trl.GRPOTrainer(model=trl_model, reward_funcs=distinct_characters, train_dataset=data,
                              args=trl.GRPOConfig(**{**common, "output_dir": str(tmp_path / "trl")}),
                              processing_class=copy.deepcopy(processor), callbacks=[trl_grads])
    batch, sample = {}, trainer._generate

    def recording(prompts):
        out = sample(prompts)
        batch.update(prompt_ids=[list(x) for x in out[0]], completion_ids=[list(x) for x in out[1]])
        return out

    trainer._generate = recording
    trainer.train()
    lab_grads = Grads(lab_model)
    lab = GRPOTrainer(lab_model, distinct_characters, train_dataset=data,
                      args=GRPOConfig(**{**common, "output_dir": str(tmp_path / "lab"), "log_multimodal": False}),
                      processing_class=copy.deepcopy(processor), callbacks=[lab_grads],
                      engine=ReplayEngine(processor, batch))
    lab.train()
    trl_log = next(h for h in trainer.state.log_history if "loss" in h)
    assert len(set(map(tuple, batch["completion_ids"]))) > 1
    assert lab.history[0]["loss"] == pytest.approx(trl_log["loss"], rel=1e-4, abs=1e-6)
    gap = (lab_grads.grads[0] - trl_grads.grads[0]).norm() / trl_grads.grads[0].norm()
    assert gap <= 1e-5, f"the step-1 gradients differ by {gap:.2e} of TRL's"
    assert len(trainer._logs["images"]) == 8 and len(lab._logs["images"]) == 0     # log_multimodal, True vs False


def test_dynamic_sampling_keeps_each_row_with_its_own_picture(vlm_path, tmp_path, monkeypatch):
    "DAPO's dynamic sampling with pictures: the groups kept from several rounds carry their own prompts' pictures."
    import grpo_lab.trainer as trainer_module
    from transformers import AutoProcessor

    def red_only(completions, answer, **kwargs):
        "A spread of rewards inside each red picture's group, none elsewhere: only red groups teach."
        return [float(i % 4) if a == "red" else 0.0 for i, a in enumerate(answer)]

    filled, fill = [], trainer_module._fill_with_informative_groups

    def keeping(*args, **kwargs):
        filled.append(fill(*args, **kwargs))
        return filled[-1]

    monkeypatch.setattr(trainer_module, "_fill_with_informative_groups", keeping)
    args = GRPOConfig(**settings(tmp_path, per_device_train_batch_size=8, dynamic_sampling=True,
                                 dynamic_sampling_max_rounds=4))
    trainer = GRPOTrainer(str(vlm_path), red_only, args=args, train_dataset=colour_dataset(8))   # 2 red of 8
    trainer.train()
    processor = AutoProcessor.from_pretrained(vlm_path)
    expected = {c: prepare_image_prompts([{"prompt": [{"role": "user", "content": "Which colour?"}], "image": square(c)}],
                                         torch.tensor([0]), processor)[3].rows[0]["pixel_values"] for c in COLOURS}
    colour_of = lambda row: [c for c, v in expected.items() if torch.equal(row["pixel_values"], v)]
    logged = [h for h in trainer.state.log_history if "dynamic_sampling/rounds" in h]
    assert len(filled) == len(logged) == 2 and any(h["dynamic_sampling/rounds"] > 1 for h in logged)  # rounds joined
    for (batch, _, _), h in zip(filled, logged):
        assert len(batch) == len(batch.image_inputs) == 8 and batch.group.unique().numel() == 2
        short = 0
        for g in batch.group.unique():
            rows = (batch.group == g).nonzero().flatten().tolist()
            colours = [colour_of(batch.image_inputs.rows[i]) for i in rows]
            assert all(c == colours[0] and len(c) == 1 for c in colours)      # one group, one picture
            teaches = bool((batch.advantages[rows] != 0).any())
            assert teaches == (colours[0] == ["red"]), (colours, batch.advantages[rows])  # kept groups are the red ones
            short += not teaches                  # a dropped group put back when the rounds ran out
        assert h["dynamic_sampling/groups_short"] == short
