"""A Hugging Face Trainer script with a DeepSpeed config, unchanged for
dsrun: no ``import dsrun`` needed (dsrun's runtime answers for
``deepspeed`` in every rank).

    python -m dsrun --num_gpus 2 examples/hf_trainer/train_hf.py --stage 3 --out runs/hf

(run ``python -m dsrun`` with the interpreter that has transformers and
accelerate installed: the ranks run with the launcher's Python). A tiny
GPT-2 built from a config (no download) learns random tokens; rank 0
prints the logged losses as one JSON line.
"""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=0, help="ZeRO stage 0-3")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save_steps", type=int, default=0, help="0: no checkpoints")
parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
parser.add_argument("--out", default="runs/hf")
args = parser.parse_args()

# DeepSpeed's config as Hugging Face users write it: "auto" where the Trainer fills in
ds_config = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": args.stage, "stage3_gather_16bit_weights_on_model_save": True},
}
training = TrainingArguments(
    output_dir=args.out, deepspeed=ds_config, per_device_train_batch_size=2, max_steps=args.steps,
    learning_rate=1e-3, warmup_steps=2, logging_steps=1, seed=0, report_to=[],
    save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 1,
    disable_tqdm=True, dataloader_num_workers=0)

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128,
                                   n_positions=32))


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.tokens = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


losses = []


class KeepLosses(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            losses.append([state.global_step, logs["loss"]])


trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(),
                  callbacks=[KeepLosses()])
trainer.train(resume_from_checkpoint=True if args.resume else None)
trainer.save_model(os.path.join(args.out, "final"))
if int(os.environ.get("RANK", "0")) == 0:
    print("LOSSES", json.dumps(losses), flush=True)
