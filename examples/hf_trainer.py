"""examples/hf_trainer.py: Hugging Face ``transformers.Trainer`` with offload.AdamW.

The Trainer takes a ready optimizer and scheduler through ``optimizers=(optimizer, scheduler)``.
The model is a tiny Llama built from a config with random weights (nothing is downloaded), trained
on synthetic counting sequences on the CPU in seconds.

    pip install transformers accelerate
    python examples/hf_trainer.py             # --tiny is the default
"""
from __future__ import annotations

import argparse

import torch

import offload


class Counting(torch.utils.data.Dataset):
    """Sequences that count upward modulo the vocabulary from a random start: easy to learn."""

    def __init__(self, n: int, vocab: int, ctx: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(ctx)) % vocab

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True, help="tiny model (default)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--output-dir", default="hf_trainer_out")
    args = ap.parse_args(argv)

    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments,
                              get_cosine_schedule_with_warmup)

    if args.tiny:
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                          num_attention_heads=16, num_key_value_heads=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)  # random init from the config: no download

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = offload.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.95))
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=args.steps // 10,
                                                num_training_steps=args.steps)
    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=16,
                              logging_steps=max(1, args.steps // 8), max_grad_norm=1.0, use_cpu=True,
                              report_to=[], save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=Counting(2048, cfg.vocab_size, 24),
                      optimizers=(optimizer, scheduler))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("losses:", " ".join(f"{x:.3f}" for x in losses))
    return losses


if __name__ == "__main__":
    main()
