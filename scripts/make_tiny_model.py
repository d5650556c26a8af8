#!/usr/bin/env python3
"""Generate the embedded default's model: a tiny Llama-style model trained on a checkable task.

Run with the vLLM venv's interpreter (it has torch, tokenizers and transformers):

    .cache/vllm-venv/bin/python scripts/make_tiny_model.py --out .cache/model-src/tiny-pd

What it writes into --out (a fresh directory; it refuses to overwrite a non-empty one unless --force):
  config.json, generation_config.json, model.safetensors   LlamaForCausalLM, hidden 128, 2 layers, 4 heads
  tokenizer.json, tokenizer_config.json, special_tokens_map.json
                                                            byte-level BPE trained with `tokenizers` on
                                                            generated text; chat template in the config
  eval.jsonl                                                held-out items: prompt, question, answer
  train_report.json                                         seed, steps, loss, held-out accuracy (HF greedy)

The task: "Q: copy W1 W2 W3\nA:" -> " W1 W2 W3" and "Q: reverse W1 W2 W3\nA:" -> " W3 W2 W1", words from a
fixed list of 32. Held-out eval triples never occur in training, so a right answer means the model copies or
reverses, not that it memorised the item. The chat template renders a user turn as "Q: ...\nA:", so the same
items work through /v1/chat/completions (question = the user message) and /v1/completions (prompt).

Deterministic: fixed seed, one thread, deterministic algorithms, a fixed number of steps (not a time budget),
so the same versions of torch/transformers/tokenizers give the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

WORDS = [
    "apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "peach",
    "pear", "plum", "kiwi", "fig", "lime", "olive", "date", "berry",
    "red", "blue", "green", "black", "white", "pink", "gold", "silver",
    "cat", "dog", "fox", "owl", "bear", "wolf", "lion", "frog",
]
TASKS = ("copy", "reverse")
N_ITEMS = 3
BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# Rendered by vLLM / transformers for chat requests: a user turn becomes the trained "Q: ...\nA:" form, an
# assistant turn its answer followed by EOS. System messages are accepted and ignored (the model has none).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'Q: ' + message['content'] + '\\nA:' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
)


def answer_for(task: str, items: list[str]) -> str:
    if task == "copy":
        return " ".join(items)
    if task == "reverse":
        return " ".join(reversed(items))
    raise ValueError(f"unknown task {task!r}")


def question_for(task: str, items: list[str]) -> str:
    return f"{task} {' '.join(items)}"


def prompt_for(question: str) -> str:
    """The completion prompt, exactly what the chat template renders for one user turn (without BOS)."""
    return f"Q: {question}\nA:"


def split_items(seed: int, n_eval: int) -> tuple[list[tuple[str, tuple[str, ...]]], list[tuple[str, tuple[str, ...]]]]:
    """All (task, triple) pairs with distinct words, split into train and a held-out eval set.

    The eval triples are held out for both tasks (a triple seen as 'copy' in training is not evaluated as
    'reverse' either), so the eval measures generalisation to unseen word combinations.
    """
    rng = random.Random(seed)  # noqa: S311 (reproducible data, not security)
    triples = []
    for a in WORDS:
        for b in WORDS:
            for c in WORDS:
                if len({a, b, c}) == N_ITEMS:
                    triples.append((a, b, c))
    rng.shuffle(triples)
    held = triples[:n_eval]
    rest = triples[n_eval:]
    eval_items = [(TASKS[i % len(TASKS)], t) for i, t in enumerate(held)]
    train_items = [(task, t) for t in rest for task in TASKS]
    return train_items, eval_items


def corpus_lines(train_items, rng: random.Random, n: int) -> list[str]:
    """Text the BPE tokenizer is trained on: the task lines plus free text made of the same words and digits,
    so every word is one token and numbers/punctuation tokenise compactly."""
    lines = []
    for _line in range(n):
        task, t = train_items[rng.randrange(len(train_items))]
        q = question_for(task, list(t))
        lines.append(prompt_for(q) + " " + answer_for(task, list(t)))
        lines.append(" ".join(rng.choice(WORDS) for _word in range(rng.randint(3, 12))) + ".")
        lines.append(" ".join(str(rng.randint(0, 999)) for _num in range(rng.randint(2, 6))))
    return lines


def build_tokenizer(lines: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="model directory to create")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (fixed: determinism)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--n-eval", type=int, default=200, help="held-out eval items written to eval.jsonl")
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--max-position-embeddings", type=int, default=4096)
    ap.add_argument("--min-accuracy", type=float, default=0.9,
                    help="fail if the held-out accuracy (HF greedy) is below this")
    ap.add_argument("--force", action="store_true", help="write into a non-empty --out")
    args = ap.parse_args(argv)

    out: Path = args.out
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"make_tiny_model: {out} is not empty (use --force)", file=sys.stderr)
        return 2

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    t0 = time.monotonic()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    train_items, eval_items = split_items(args.seed, args.n_eval)
    rng = random.Random(args.seed + 1)  # noqa: S311 (reproducible data, not security)
    raw_tok = build_tokenizer(corpus_lines(train_items, rng, 4000), args.vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw_tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=args.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    bos_id, eos_id, pad_id = (tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD))
    for w in WORDS:  # each word (with its leading space) must be one token: the task is per-token
        ids = raw_tok.encode(" " + w, add_special_tokens=False).ids
        if len(ids) != 1:
            print(f"make_tiny_model: word {w!r} is {len(ids)} tokens; raise --vocab-size", file=sys.stderr)
            return 1

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)

    def encode(task: str, t) -> tuple[list[int], int]:
        """Token ids of one training line and the index where the answer starts (loss only from there)."""
        prompt_ids = tokenizer(prompt_for(question_for(task, list(t))), add_special_tokens=True)["input_ids"]
        ans_ids = tokenizer(" " + answer_for(task, list(t)), add_special_tokens=False)["input_ids"]
        return prompt_ids + ans_ids + [eos_id], len(prompt_ids)

    encoded = [encode(task, t) for task, t in train_items]
    width = max(len(ids) for ids, _start in encoded)

    def batch(indices):
        x = torch.full((len(indices), width), pad_id, dtype=torch.long)
        y = torch.full((len(indices), width), -100, dtype=torch.long)
        att = torch.zeros((len(indices), width), dtype=torch.long)
        for row, i in enumerate(indices):
            ids, start = encoded[i]
            x[row, : len(ids)] = torch.tensor(ids)
            att[row, : len(ids)] = 1
            y[row, start: len(ids)] = torch.tensor(ids[start:])
        return x, y, att

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    model.train()
    loss_val = float("nan")
    for step in range(args.steps):
        idx = [rng.randrange(len(encoded)) for _row in range(args.batch_size)]
        x, y, att = batch(idx)
        loss = model(input_ids=x, attention_mask=att, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_val = loss.item()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss_val:.4f}  {time.monotonic() - t0:.0f} s", flush=True)
    train_s = time.monotonic() - t0

    # Held-out accuracy, greedy, the same way verify asks vLLM: prompt -> completion up to EOS.
    model.eval()
    correct = 0
    with torch.no_grad():
        for task, t in eval_items:
            ids = tokenizer(prompt_for(question_for(task, list(t))), add_special_tokens=True)["input_ids"]
            gen = model.generate(torch.tensor([ids]), max_new_tokens=N_ITEMS + 2, do_sample=False,
                                 eos_token_id=eos_id, pad_token_id=pad_id)
            text = tokenizer.decode(gen[0, len(ids):], skip_special_tokens=True).strip()
            correct += text == answer_for(task, list(t))
    accuracy = correct / len(eval_items)
    print(f"held-out accuracy (HF greedy): {correct}/{len(eval_items)} = {accuracy:.3f}")

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    with open(out / "eval.jsonl", "w", encoding="utf-8") as f:
        for task, t in eval_items:
            q = question_for(task, list(t))
            f.write(json.dumps({"task": task, "question": q, "prompt": prompt_for(q),
                                "answer": answer_for(task, list(t))}, sort_keys=True) + "\n")
    report = {
        "seed": args.seed, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
        "final_loss": round(loss_val, 6), "train_seconds": round(train_s, 1),
        "eval_items": len(eval_items), "eval_correct": correct, "eval_accuracy": accuracy,
        "train_items": len(train_items), "words": WORDS, "tasks": list(TASKS),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__},
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    for f in out.iterdir():  # safetensors writes 0600; the model is copied to hosts and read by another user
        f.chmod(0o644)
    if accuracy < args.min_accuracy:
        print(f"make_tiny_model: held-out accuracy {accuracy:.3f} < --min-accuracy {args.min_accuracy}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
