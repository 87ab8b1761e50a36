"""Write docs/models.md from minserve/assets/training_report.json, so the page shows what was measured.

Run it after ``scripts/train_tiny_models.py``: ``python scripts/models_report.py [machine description]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "minserve" / "assets" / "training_report.json"
PAGE = ROOT / "docs" / "models.md"


def render(report: dict, machine: str) -> str:
    models = report["models"]
    rows = [
        f"| `{name}` | {m['parameters'] / 1e6:.2f} M | {s['hidden_size']} × {s['num_hidden_layers']} layers, "
        f"{s['num_attention_heads']} q / {s['num_key_value_heads']} kv heads, MLP {s['intermediate_size']} | "
        f"{m['tokens_trained'] / 1e6:.1f} M | {m['train_seconds'] / 60:.1f} min | **{m['held_out_perplexity']:.1f}** |"
        for name, m in models.items()
        for s in [m["shape"]]
    ]
    samples = "\n\n".join(
        f"`{name}`, greedy, prompt `{sample['prompt']!r}`:\n\n```python\n{sample['prompt']}{sample['completion']}\n```"
        for name, m in models.items()
        for sample in m["samples"]
    )
    return f"""# The embedded models

minserve ships two models inside the package (`minserve/assets/`), so every chapter, test and demo runs
offline: `minserve-tiny`, the default, and `minserve-tiny-draft`, a draft model for speculative decoding
that uses the same tokenizer. Both are Llama-architecture checkpoints in Hugging Face format (config.json,
model.safetensors in bfloat16, tokenizer.json), and transformers loads them as they are.

## How they were trained

- **Corpus:** {report["corpus"]}. Files are split into training and held-out sets by a hash of their
  path: {report["train_tokens_in_corpus"]:,} training tokens and {report["held_out_tokens_in_corpus"]:,}
  held-out tokens. The standard library is on every Python install and the PSF licence allows this use.
- **Tokenizer:** byte-level BPE with {report["vocab_size"]:,} tokens, trained on the training split. The
  special tokens are `<|endoftext|>` (EOS) and `<|system|>`, `<|user|>`, `<|assistant|>` for a simple chat
  template (the models are not chat-tuned).
- **Training:** AdamW, {report["seq_len_tokens"]}-token windows, linear warm-up then cosine decay, float32 on
  the CPU ({report["torch_threads"]} threads), then rounded to bfloat16. Every number below is measured on the
  rounded weights that ship. The rotary table allows 2,048 positions, but training used
  {report["seq_len_tokens"]}-token windows, so text quality drops past that. The engine experiments still run
  correctly there.
- **Total time:** {report["total_seconds"] / 60:.1f} minutes on {machine}, for both models and the
  evaluation.

Retrain both from scratch with one command:

```bash
make models      # = python scripts/train_tiny_models.py --out minserve/assets; then scripts/models_report.py
```

## Results on the held-out split

| model | parameters | shape | tokens trained | training time | held-out perplexity |
|---|---|---|---|---|---|
{chr(10).join(rows)}
| bigram baseline (add-one smoothing, same split) | — | — | — | — | {report["bigram_held_out_perplexity"]:.1f} |

The draft's greedy next token equals the tiny model's at **{report["draft_greedy_agreement"]:.1%}** of
held-out positions. That agreement rate is what speculative decoding (chapter 08) lives on.

## Sample completions

{samples}
"""


def main(machine: str = "a 2-core x86-64 CPU (the course machine)") -> None:
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(render(json.loads(REPORT.read_text()), machine))
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
