"""grpo_lab.loss.grpo_loss against TRL's own GRPOTrainer._compute_loss: same tensors in, same loss and gradients out.

TRL's loss is a method that asks the model for log-probs and entropies. Its trainer is built with `__new__` (no
model, no data), given the attributes `_compute_loss` reads (from a real `trl.GRPOConfig`), and its
`_get_per_token_logps_and_entropies` returns fixed tensors: TRL's real loss code then runs on exactly the
tensors grpo-lab's gets. Skipped when TRL is not installed.
"""
import collections
import itertools

import pytest
import torch

trl = pytest.importorskip("trl")
from accelerate import Accelerator

from grpo_lab.loss import LOSS_TYPES, grpo_loss

B, T, MAX_LEN = 6, 9, 12


class ProcessView(Accelerator):
    "A one-process accelerator that reports `n` processes, to exercise the normalizers that divide by it."
    def __init__(self, n):
        super().__init__(cpu=True)
        self._n = n

    @property
    def num_processes(self):
        return self._n


def inputs(seed, mu_gt_1=True):
    "Random log-probs (current, old, reference, sampler), advantages, mask and entropies for one micro-batch."
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T) < lengths[:, None]).long()
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64) if mu_gt_1 else None
    return dict(logps=logps, old=old, ref=logps - 0.3 * torch.rand(B, T, generator=g, dtype=torch.float64),
                sampling=logps + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64),
                advantages=torch.randn(B, generator=g, dtype=torch.float64), mask=mask,
                entropies=torch.rand(B, T, generator=g, dtype=torch.float64) * 4,
                num_items=torch.tensor(int(mask.sum()) * 3 + 5))


def trl_loss(x, opts, tmp_path, ga=1, num_processes=1, steps_per_generation=None):
    "Loss, gradients wrt log-probs and entropies, and metrics from TRL's `_compute_loss`."
    entropy_coef = opts.get("entropy_coef", 0.0)
    args = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=B,
                          num_generations=2, gradient_accumulation_steps=ga,
                          steps_per_generation=steps_per_generation or ga, max_completion_length=MAX_LEN,
                          loss_type=opts["loss_type"], beta=opts.get("beta", 0.0), epsilon=opts.get("epsilon", 0.2),
                          epsilon_high=opts.get("epsilon_high"), delta=opts.get("delta"),
                          importance_sampling_level=opts.get("importance_sampling_level", "token"),
                          top_entropy_quantile=opts.get("top_entropy_quantile", 1.0),
                          off_policy_mask_threshold=opts.get("off_policy_mask_threshold"),
                          use_bias_correction_kl=opts.get("kl_bias_correction", True),
                          sapo_temperature_pos=opts.get("sapo_temperature_pos", 1.0),
                          sapo_temperature_neg=opts.get("sapo_temperature_neg", 1.05), entropy_coef=entropy_coef)
    trainer = trl.GRPOTrainer.__new__(trl.GRPOTrainer)
    logps, entropies = x["logps"].clone().requires_grad_(), x["entropies"].clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    vars(trainer).update(
        args=args, accelerator=ProcessView(num_processes), model=torch.nn.Module().train(),
        loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, max_completion_length=MAX_LEN,
        current_gradient_accumulation_steps=ga, aux_loss_enabled=False, use_vllm=False,
        vllm_importance_sampling_correction=False, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        _entropy_bonus_enabled=entropy_coef != 0.0, _metrics={"train": collections.defaultdict(list)})
    batch = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
             "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": x["mask"],
             "advantages": x["advantages"], "num_items_in_batch": x["num_items"]}
    if x["old"] is not None:
        batch["old_per_token_logps"] = x["old"]
    if args.beta != 0:
        batch["ref_per_token_logps"] = x["ref"]
    if "sampling" in opts:
        batch["sampling_per_token_logps"] = x["sampling"]
    loss = trainer._compute_loss(None, batch)
    grads = torch.autograd.grad(loss, (logps, entropies), allow_unused=True)
    return loss.detach(), grads, {k: v[0] for k, v in trainer._metrics["train"].items()}


def lab_loss(x, opts, ga=1, num_processes=1, steps_per_generation=None):
    "The same from grpo_lab's `grpo_loss`."
    logps, entropies = x["logps"].clone().requires_grad_(), x["entropies"].clone().requires_grad_()
    kwargs = {k: v for k, v in opts.items() if k not in ("epsilon", "sampling", "entropy_coef")}
    epsilon = opts.get("epsilon", 0.2)
    kwargs["epsilon_low"], kwargs["epsilon_high"] = epsilon, opts.get("epsilon_high") or epsilon
    if opts.get("entropy_coef"):
        kwargs["entropy_coef"] = opts["entropy_coef"]
    loss, stats = grpo_loss(logps, x["old"], x["advantages"], x["mask"], ref_per_token_logps=x["ref"],
                            entropies=entropies, max_completion_length=MAX_LEN, num_items_in_batch=x["num_items"],
                            sampling_per_token_logps=x["sampling"] if "sampling" in opts else None,
                            gradient_accumulation_steps=ga, num_processes=num_processes,
                            steps_per_generation=steps_per_generation, **kwargs)
    grads = torch.autograd.grad(loss, (logps, entropies), allow_unused=True)
    return loss.detach(), grads, stats


def assert_same(x, opts, tmp_path, **scale):
    theirs, ours = trl_loss(x, opts, tmp_path, **scale), lab_loss(x, opts, **scale)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=1e-5)
    for g_ours, g_theirs in zip(ours[1], theirs[1]):
        if g_theirs is None or g_ours is None:
            assert (g_ours is None or not g_ours.any()) and (g_theirs is None or not g_theirs.any())
        else:
            torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=1e-5)
    metrics = {k: v for k, v in theirs[2].items() if k != "entropy_coef"}
    assert set(metrics) <= set(ours[2]), set(metrics) - set(ours[2])
    for name, value in metrics.items():
        assert ours[2][name] == pytest.approx(value, abs=1e-5, nan_ok=True), name


OPTIONS = [
    {"beta": 0.04}, {"beta": 0.04, "kl_bias_correction": False}, {"delta": 1.3}, {"top_entropy_quantile": 0.3},
    {"off_policy_mask_threshold": 0.05}, {"off_policy_mask_threshold": 0.05, "sampling": True},
    {"epsilon": 0.1, "epsilon_high": 0.28}, {"entropy_coef": 0.01}, {"entropy_coef": 0.01, "top_entropy_quantile": 0.5},
    {"importance_sampling_level": "sequence", "epsilon": 3e-2}, {"importance_sampling_level": "sequence", "beta": 0.04},
    {"importance_sampling_level": "sequence", "beta": 0.04, "delta": 1.01, "top_entropy_quantile": 0.5},
    {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
    {"beta": 0.04, "delta": 1.5, "top_entropy_quantile": 0.4, "off_policy_mask_threshold": 0.05, "epsilon_high": 0.3},
]


@pytest.mark.parametrize("loss_type,opts", list(itertools.product(LOSS_TYPES, OPTIONS)))
def test_loss_and_gradients_match_trl(loss_type, opts, tmp_path):
    for seed, mu_gt_1 in ((0, True), (1, False)):
        assert_same(inputs(seed, mu_gt_1), {"loss_type": loss_type, **opts}, tmp_path)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("ga,num_processes,steps_per_generation", [(4, 1, None), (2, 3, None), (2, 2, 4)])
def test_accumulation_and_process_scaling_match_trl(loss_type, ga, num_processes, steps_per_generation, tmp_path):
    scale = dict(ga=ga, num_processes=num_processes, steps_per_generation=steps_per_generation)
    assert_same(inputs(2), {"loss_type": loss_type, "beta": 0.04, "entropy_coef": 0.02}, tmp_path, **scale)
