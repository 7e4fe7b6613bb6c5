#!/usr/bin/env python
"""Train the demo's four LoRA adapters on SmolLM2-135M-Instruct and measure them.

Each adapter learns one task of ``manylora.demo.tasks`` from examples this script draws
(seeded), with the loss on the answer tokens and the end-of-turn token only, AdamW and a
linear warm-up then linear decay of the learning rate. The base weights are the GGUF file's,
dequantized by transformers into float32 (bf16 autocast on CUDA). The adapters are saved
in PEFT's layout (``save_pretrained``) with their tensors cast to float16, then every adapter
and the base model are scored by exact match on the tasks' held-out prompts (greedy,
batched, left padding), and ``README.md`` is written beside the adapters.

Run from the repository root with manylora and peft installed (``pip install -e .[demo]``);
all four take about 45 minutes on two CPU cores (~3.7-4.5 s per step), minutes on a GPU::

    python scripts/train_demo_adapters.py
    python scripts/train_demo_adapters.py --tasks sentiment --steps 30 --eval-n 20 --out /tmp/a
"""

from __future__ import annotations

import argparse
import copy
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from manylora.demo import tasks as demo_tasks
from manylora.demo.model import fetch_smollm2

#: The model the GGUF file quantizes, recorded in each ``adapter_config.json``.
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_SEVEN = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Recipe:
    """How one task's adapter is shaped (peft ``LoraConfig`` fields)."""

    rank: int
    targets: list[str]
    use_dora: bool = False

    def config(self) -> LoraConfig:
        return LoraConfig(r=self.rank, lora_alpha=2 * self.rank, lora_dropout=0.0,
                          target_modules=list(self.targets), use_dora=self.use_dora,
                          bias="none", task_type="CAUSAL_LM")

    def describe(self) -> str:
        where = ("all seven projections" if self.targets == ALL_SEVEN else
                 "attention (q, k, v, o)" if self.targets == ATTENTION else
                 ", ".join(t.removesuffix("_proj") for t in self.targets))
        return f"rank {self.rank}, {where}" + (", DoRA" if self.use_dora else "")


#: Rank and targets per task: heterogeneous on purpose, so that one served batch mixes
#: ranks, target sets and DoRA.
RECIPES = {
    "sql": Recipe(4, ALL_SEVEN),
    "json": Recipe(8, ATTENTION),
    "sentiment": Recipe(16, ["q_proj", "v_proj"]),
    "date": Recipe(4, ATTENTION, use_dora=True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=demo_tasks.adapters_root(),
                   help="folder that receives one adapter folder per task and README.md")
    p.add_argument("--tasks", nargs="+", choices=list(demo_tasks.TASKS),
                   default=list(demo_tasks.TASKS), help="the tasks to train")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per task")
    p.add_argument("--batch-size", type=int, default=16, help="examples per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--seed", type=int, default=0, help="seeds the data, LoRA init and order")
    p.add_argument("--eval-n", type=int, default=200, help="held-out prompts per task")
    p.add_argument("--eval-batch-size", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-readme", action="store_true", help="do not write OUT/README.md")
    return p.parse_args(argv)


def eos_ids(model) -> list[int]:
    """The model's end-of-sequence ids (its generation config's, from the GGUF metadata)."""
    eos = model.generation_config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def encode(tok, prompt: str, answer: str | None = None,
           eos: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the chat-rendered ``prompt`` (generation prompt included) and of the
    assistant turn that answers it, as the chat template writes that turn: ``answer``
    followed by the template's end-of-turn token (empty without an answer).

    Raises:
        ValueError: the template does not render the answered conversation as the prompt
            followed by the turn, or the turn does not end with one of ``eos`` (the model's
            end-of-sequence ids), so a trained adapter would not stop where the engine does.
    """
    messages = demo_tasks.chat_messages(prompt)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    if answer is None:
        return prompt_ids, []
    whole = tok.apply_chat_template(messages + [{"role": "assistant", "content": answer}],
                                    tokenize=False)
    if not whole.startswith(text):
        raise ValueError("the chat template renders the answered conversation differently "
                         "from the prompt with its generation prompt")
    turn = tok(whole[len(text):].rstrip(), add_special_tokens=False)["input_ids"]
    if eos is not None and (not turn or turn[-1] not in eos):
        raise ValueError(f"the assistant turn ends with token {turn[-1:]} "
                         f"({tok.convert_ids_to_tokens(turn[-1:])}), not an end-of-sequence "
                         f"id of the model ({eos})")
    return prompt_ids, turn


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int, device):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (``-100`` except on the
    answer and end-of-turn tokens), each ``[B, T]`` int64."""
    width = max(len(p) + len(a) for p, a in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (p, a) in enumerate(batch):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(a)
    return ids.to(device), mask.to(device), labels.to(device)


def autocast(device: str):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def generate(model, tok, prompts: list[str], args, max_new_tokens: int,
             eos: list[int]) -> list[str]:
    """Greedy completions of ``prompts`` (batched, left padding; stopping at any of
    ``eos``), special tokens removed."""
    model.eval()
    outputs: list[str] = []
    for start in range(0, len(prompts), args.eval_batch_size):
        chunk = [encode(tok, p)[0] for p in prompts[start:start + args.eval_batch_size]]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), eos[0], dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with autocast(args.device):
            out = model.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device),
                                 do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=eos[0])
        outputs += tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return outputs


def accuracy(model, tok, task: str, args) -> float:
    """Exact-match accuracy on the first ``args.eval_n`` held-out prompts of ``task``.

    Generation stops at ``args.max_new_tokens`` or at 8 tokens past the longest expected
    answer, whichever comes first: an output that long cannot equal any answer (unless its
    tail were all whitespace), and the base model's long replies would otherwise dominate
    the time on a CPU."""
    examples = demo_tasks.held_out(task, args.eval_n)
    eos = eos_ids(model)
    longest = max(len(encode(tok, p, a, eos)[1]) for p, a in examples)
    outputs = generate(model, tok, [p for p, _ in examples], args,
                       min(args.max_new_tokens, longest + 8), eos)
    return sum(demo_tasks.exact_match(a, o) for (_, a), o in zip(examples, outputs)) / len(examples)


def save_float16(model: PeftModel, folder: Path) -> int:
    """``save_pretrained`` into ``folder``, then the saved tensors cast to float16 in place;
    returns the safetensors file's size in bytes.

    ``base_model_name_or_path`` names the upstream model the GGUF file quantizes rather than
    this machine's cache folder, and peft's model-card template (``README.md``) is dropped."""
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL
    model.save_pretrained(folder)
    (folder / "README.md").unlink(missing_ok=True)
    path = folder / "adapter_model.safetensors"
    tensors = {k: v.to(torch.float16).contiguous() for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    path.chmod(0o644)
    return path.stat().st_size


def train_one(base, tok, task: str, args) -> dict:
    """Train, save and score ``task``'s adapter; the LoRA init is seeded by ``args.seed``
    and the task's place in ``TASKS``, so a task trains alike alone or with the others."""
    recipe = RECIPES[task]
    torch.manual_seed(args.seed * 1000 + list(demo_tasks.TASKS).index(task))
    model = get_peft_model(copy.deepcopy(base), recipe.config())
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    examples = demo_tasks.train_examples(task, args.steps * args.batch_size, seed=args.seed)
    eos = eos_ids(base)
    encoded = [encode(tok, p, a, eos) for p, a in examples]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        return max(0.0, (args.steps - step) / max(1, args.steps - args.warmup))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    start = time.perf_counter()
    losses: list[float] = []
    bar = tqdm(range(args.steps), desc=f"train {task}", file=sys.stderr)
    for step in bar:
        batch = encoded[step * args.batch_size:(step + 1) * args.batch_size]
        ids, mask, labels = collate(batch, eos[0], args.device)
        with autocast(args.device):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.4f}")
    train_s = time.perf_counter() - start
    folder = args.out / demo_tasks.TASKS[task].adapter
    size = save_float16(model, folder)
    model = PeftModel.from_pretrained(copy.deepcopy(base), folder).to(args.device)
    start = time.perf_counter()
    acc = accuracy(model, tok, task, args)
    eval_s = time.perf_counter() - start
    first, last = losses[:10], losses[-10:]
    print(f"{task}: {recipe.describe()}, {params:,} trainable params, {size / 1e6:.2f} MB "
          f"float16; loss {sum(first) / len(first):.4f} -> {sum(last) / len(last):.4f}; "
          f"train {train_s:.0f} s, eval {eval_s:.0f} s; held-out exact match {acc:.3f}",
          flush=True)
    return dict(task=task, params=params, size=size, acc=acc, train_s=train_s,
                loss_first=sum(first) / len(first), loss_last=sum(last) / len(last))


def write_readme(path: Path, rows: list[dict], base_acc: dict, args, argv: list[str],
                 wall_s: float) -> None:
    device = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else
              f"CPU ({platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} threads)")
    command = "python scripts/train_demo_adapters.py" + "".join(
        f" {shlex.quote(a)}" for a in argv)
    lines = [
        "# The demo's adapters",
        "",
        "Four LoRA adapters of SmolLM2-135M-Instruct (the GGUF file that "
        "`manylora.demo.model.fetch_smollm2` fetches), each trained on one task of "
        "`manylora.demo.tasks`, in PEFT's layout (`adapter_config.json`, "
        "`adapter_model.safetensors` in float16). Each prompt is sent as a one-turn chat "
        "rendered with the model's own chat template; an answer counts when it equals the "
        "expected one after stripping whitespace.",
        "",
        "| adapter | task | shape | size | held-out exact match | base model |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = demo_tasks.TASKS[r["task"]]
        lines.append(f"| `{t.adapter}` | {t.description} | {RECIPES[r['task']].describe()} "
                     f"| {r['size'] / 1e6:.2f} MB | {r['acc']:.3f} | "
                     f"{base_acc[r['task']]:.3f} |")
    lines += [
        "",
        f"Held-out: the first {args.eval_n} prompts per task of "
        "`manylora.demo.tasks.held_out`, greedy, at most "
        f"{args.max_new_tokens} new tokens; no held-out prompt occurs in training.",
        "",
        "Trained with",
        "",
        "```",
        command,
        "```",
        "",
        f"seed {args.seed}, {args.steps} steps of {args.batch_size} examples per adapter, "
        f"AdamW at peak learning rate {args.lr} ({args.warmup} warm-up steps, then linear "
        "decay), loss on the answer and end-of-turn tokens only, lora_alpha = 2 x rank, "
        f"no dropout; on {device}, torch {torch.__version__}, {wall_s / 60:.1f} minutes in "
        "all (training and evaluation).",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    wall = time.perf_counter()
    gguf = fetch_smollm2()
    print(f"Loading {gguf.name} (dequantized to float32)", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    base = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                dtype=torch.float32).to(args.device)
    base.requires_grad_(False)
    print(f"end-of-sequence ids {eos_ids(base)} (the tokenizer's eos: {tok.eos_token_id})",
          file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, base_acc = [], {}
    for task in args.tasks:
        start = time.perf_counter()
        rows.append(train_one(base, tok, task, args))
        t0 = time.perf_counter()
        base_acc[task] = accuracy(base, tok, task, args)
        print(f"{task}: base model held-out exact match {base_acc[task]:.3f} "
              f"(eval {time.perf_counter() - t0:.0f} s); task wall time "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    wall_s = time.perf_counter() - wall
    print(f"\n{'task':<10} {'adapter':<36} {'MB':>6} {'adapter EM':>10} {'base EM':>8}")
    for r in rows:
        print(f"{r['task']:<10} {RECIPES[r['task']].describe():<36} {r['size'] / 1e6:>6.2f} "
              f"{r['acc']:>10.3f} {base_acc[r['task']]:>8.3f}")
    print(f"total {sum(r['size'] for r in rows) / 1e6:.2f} MB; wall time {wall_s:.0f} s")
    if not args.no_readme:
        write_readme(args.out / "README.md", rows, base_acc, args, argv, wall_s)
    if any(r["acc"] < 0.9 for r in rows):
        print("warning: an adapter is below 0.9 held-out exact match", file=sys.stderr)


if __name__ == "__main__":
    main()
