"""The aids of 07c_aids driven as a learner would: the sampler's settings on the tiny model's next-token distribution,
the clip region computed by grpo_loss itself, and the memory estimate against a T4; each with a picture of its state."""
import io
import math

import pytest
import torch
from PIL import Image

from grpo_lab.aids import (ClipExplorer, MemoryExplorer, SamplingExplorer, T4_GIB, clip_curve, sampled_probabilities,
                           sampling_table, token_loss)
from grpo_lab.loss import clipped_surrogate
from grpo_lab.memory import estimate_memory


def picture(explorer) -> bytes:
    "The explorer's bundle PNG, decoded by PIL to prove it is one."
    png = explorer._repr_mimebundle_()["image/png"]
    Image.open(io.BytesIO(png)).load()
    return png


@pytest.fixture(scope="module")
def tiny_sampler():
    return SamplingExplorer()       # the shipped tiny model after "17+96=1", the right digit "1"


def test_sampling_matches_generates_processors_on_the_tiny_model(tiny_sampler):
    from transformers import GenerationConfig
    from grpo_lab.static_engine import logits_processors
    model, tokenizer = tiny_sampler.model, tiny_sampler.tokenizer
    ids = tokenizer("17+96=1", return_tensors="pt")
    for settings in (dict(temperature=0.7), dict(temperature=1.2, top_p=0.8, top_k=4, min_p=0.02), dict(top_k=1)):
        processors = logits_processors(model, GenerationConfig(do_sample=True, **settings), ids["input_ids"],
                                       ids["attention_mask"])
        expected = processors(ids["input_ids"], tiny_sampler.logits[None].clone())[0].double().softmax(-1)
        assert torch.allclose(sampled_probabilities(tiny_sampler.logits, **settings), expected, atol=1e-6), settings


def test_temperature_decides_how_often_a_group_has_no_spread(tiny_sampler):
    sx = tiny_sampler
    sx.temperature.value, sx.num_generations.value = 1.0, 8
    p = sx.state["sampled"][sx.tokens.index("1")].item()
    assert sx.state["zero_std"] == pytest.approx(p ** 8 + (1 - p) ** 8)
    at_one, png_at_one = sx.state["zero_std"], picture(sx)
    sx.temperature.value = 0.4                                     # colder: the favourite (wrong) digit every time
    assert sx.state["zero_std"] > at_one + 0.3 and sx.state["entropy_sampled"] < sx.state["entropy_model"]
    assert picture(sx) != png_at_one and "0.4" in sx.text().splitlines()[0]
    sx.temperature.value, sx.top_k.value = 1.0, 1                  # top_k=1 is greedy: every group the same token
    assert sx.state["kept"] == 1 and sx.state["all_same"] == pytest.approx(1.0) and sx.state["zero_std"] == pytest.approx(1.0)
    sx.top_k.value = 0


def test_sampling_rejects_what_trl_rejects():
    logits = torch.tensor([1.0, 0.0])
    for bad, words in [(dict(temperature=0), "temperature=0 must be > 0"), (dict(top_p=0), "top_p=0 must be in (0, 1]"),
                       (dict(top_k=-1), "top_k=-1 must be a whole number"), (dict(min_p=2), "min_p=2 must be None or in")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            sampling_table(logits, **bad)
    sx = SamplingExplorer(logits=[1.0, 0.0], tokens=["a", "b"], right="c")
    assert isinstance(sx.state, ValueError) and "'c' is not one token" in sx.text() and sx.picture_png() is None


@pytest.mark.parametrize("advantage", [1.0, -0.5])
@pytest.mark.parametrize("settings", [dict(), dict(epsilon_high=0.28), dict(epsilon=0.1, delta=1.6)])
def test_clip_curve_is_grpo_loss_and_agrees_with_the_surrogate(advantage, settings):
    curve = clip_curve(advantage, **settings)
    high = settings.get("epsilon_high", settings.get("epsilon", 0.2))
    ratios = torch.tensor(curve["ratio"], dtype=torch.float64)
    expected = -clipped_surrogate(ratios, torch.tensor(advantage, dtype=torch.float64), settings.get("epsilon", 0.2),
                                  high, settings.get("delta"))
    assert torch.allclose(torch.tensor(curve["loss"], dtype=torch.float64), expected, atol=1e-12)
    for r, g in zip(curve["ratio"], curve["grad"]):                # d loss / d log pi: -A r where not clipped, else 0
        clipped = (advantage > 0 and r > 1 + high) or (advantage < 0 and r < 1 - settings.get("epsilon", 0.2)) or \
                  (advantage < 0 and settings.get("delta") and r > settings["delta"])
        assert g == (0 if clipped else pytest.approx(-advantage * r)), (r, g)


def test_clip_explorer_moves_the_bounds_and_its_picture():
    cx = ClipExplorer()
    assert cx.state[0]["zero_grad"][0][0] == pytest.approx(1.2) and cx.state[1]["zero_grad"][0][1] == pytest.approx(0.8)
    before = picture(cx)
    cx.epsilon_high.value = 0.28
    assert cx.state[0]["zero_grad"][0][0] == pytest.approx(1.28) and picture(cx) != before
    cx.delta.value = 2.0
    assert [r[0] for r in cx.state[1]["zero_grad"]][1] == pytest.approx(2.0)
    assert token_loss(2.5, -1.0, delta=2.0) == (2.0, 0.0) and "from" not in cx.notes()[1]
    with pytest.raises(ValueError, match="loss_type='vespo'"):
        token_loss(1.0, 1.0, loss_type="vespo")


def test_memory_explorer_against_a_t4():
    mx = MemoryExplorer()
    assert mx.state.total < T4_GIB and "fits a T4" in mx.text()
    before = picture(mx)
    mx.controls["lora_r"].value, mx.controls["load_in_4bit"].value, mx.controls["precision"].value = 0, False, "fp32"
    assert mx.state.total > T4_GIB and mx.state.settings["lora_r"] is None and list(mx.bars()) == ["start", "now"]
    assert mx.state.total == estimate_memory("Qwen/Qwen2.5-1.5B-Instruct", load_in_4bit=False, lora_r=None,
                                             dtype_bytes=4).total             # the same settings, by estimate_memory's names
    assert picture(mx) != before and "more than a T4" in mx.text()
    mx.controls["load_in_4bit"].value = True                      # 4-bit without LoRA: refused, in words
    assert isinstance(mx.state, ValueError) and mx.picture_png() is None and "lora_r=0" in mx.text()
