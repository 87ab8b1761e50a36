"""Train minserve's two embedded models from scratch on the Python standard library.

    python scripts/train_tiny_models.py                  # both models, ~40 minutes on 2 CPU cores
    python scripts/train_tiny_models.py --smoke          # a few steps, for the test suite

The corpus is the running interpreter's own standard library (``*.py`` files, tests and site-packages left
out): every Python install has it, its licence (PSF) allows this use, and the models then complete Python
code. Files are split into train and held-out by a hash of their path, so the split is stable across runs.

Outputs, in Hugging Face format so that ``transformers`` loads them too:

    <out>/minserve-tiny/         config.json, generation_config.json, model.safetensors, tokenizer*.json
    <out>/minserve-tiny-draft/   the same, several times smaller, same tokenizer
    <out>/training_report.json   parameters, tokens, time, held-out perplexity, bigram baseline, agreement

Training uses transformers' ``LlamaForCausalLM`` on purpose: the checkpoint minserve ships is then a plain
transformers checkpoint, and minserve's own model is checked against it by the parity tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
EOS = "<|endoftext|>"
VOCAB_SIZE = 2048
HELD_OUT_PERCENT = 5

# A plain role-tagged template: the tiny models are not chat-tuned, but the server's chat endpoint needs one.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """The architecture of one embedded model (Llama with grouped-query attention)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    learning_rate: float
    train_tokens: int


TINY = ModelShape("minserve-tiny", 256, 4, 4, 2, 688, 2e-3, 5_000_000)
DRAFT = ModelShape("minserve-tiny-draft", 128, 2, 4, 2, 344, 3e-3, 3_000_000)
SEQ_LEN_TOKENS = 512
BATCH_SEQUENCES = 8
MAX_POSITION_EMBEDDINGS = 2048


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted, with tests and site-packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages"}
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in skip or p.startswith("test_") for p in parts):
            continue
        files.append(path)
    return files


def is_held_out(path: Path) -> bool:
    """Stable split by path hash: about HELD_OUT_PERCENT of files are held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def read_corpus() -> tuple[list[str], list[str]]:
    train, held_out = [], []
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        (held_out if is_held_out(path) else train).append(text)
    return train, held_out


def train_tokenizer(train_texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(train_texts, trainer=trainer)
    return tokenizer


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one token stream, each followed by the end-of-text token."""
    eos_id = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def build_model(shape: ModelShape, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return LlamaForCausalLM(config)


def learning_rate(step: int, total_steps: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to a tenth of the peak."""
    warmup = max(1, total_steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_model(shape: ModelShape, stream: torch.Tensor, eos_id: int, seed: int, max_steps: int | None):
    torch.manual_seed(seed)
    model = build_model(shape, eos_id)
    tokens_per_step = SEQ_LEN_TOKENS * BATCH_SEQUENCES
    total_steps = max_steps or shape.train_tokens // tokens_per_step
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.learning_rate, weight_decay=0.1, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    start_s = time.perf_counter()
    for step in range(total_steps):
        starts = torch.randint(0, len(stream) - SEQ_LEN_TOKENS - 1, (BATCH_SEQUENCES,), generator=generator)
        batch = torch.stack([stream[s : s + SEQ_LEN_TOKENS + 1] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, total_steps, shape.learning_rate)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == total_steps - 1:
            elapsed = time.perf_counter() - start_s
            rate = (step + 1) * tokens_per_step / elapsed
            print(f"{shape.name} step {step + 1}/{total_steps} loss {loss.item():.3f} {rate:,.0f} tok/s", flush=True)
    train_s = time.perf_counter() - start_s
    # What ships is bfloat16 (half the bytes); evaluate exactly what ships.
    model = model.to(torch.bfloat16).to(torch.float32).eval()
    return model, total_steps * tokens_per_step, train_s


@torch.no_grad()
def held_out_logits(model, stream: torch.Tensor, max_windows: int):
    """Logits and targets over non-overlapping held-out windows."""
    n = min(max_windows, (len(stream) - 1) // SEQ_LEN_TOKENS)
    for i in range(n):
        window = stream[i * SEQ_LEN_TOKENS : (i + 1) * SEQ_LEN_TOKENS + 1]
        yield model(input_ids=window[None, :-1]).logits[0], window[1:]


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, max_windows: int) -> float:
    """minserve's perplexity rule (:func:`minserve.quality.windowed_perplexity`) on a transformers model,
    over the first ``max_windows`` windows of the training sequence length."""
    from minserve.quality.perplexity import windowed_perplexity

    def logits_of(window: torch.Tensor) -> torch.Tensor:
        return model(input_ids=window[None]).logits[0]

    return windowed_perplexity(logits_of, stream[: max_windows * SEQ_LEN_TOKENS], SEQ_LEN_TOKENS).perplexity


@torch.no_grad()
def greedy_agreement(target, draft, stream: torch.Tensor, max_windows: int) -> float:
    """How often the draft's greedy next token equals the target's, over held-out positions."""
    agree, count = 0, 0
    pairs = zip(held_out_logits(target, stream, max_windows), held_out_logits(draft, stream, max_windows), strict=True)
    for (target_logits, _), (draft_logits, _) in pairs:
        agree += (target_logits.argmax(-1) == draft_logits.argmax(-1)).sum().item()
        count += len(target_logits)
    return agree / count


def bigram_perplexity(train: torch.Tensor, held_out: torch.Tensor) -> float:
    """Add-one-smoothed bigram model fitted on the training stream, scored on the held-out one."""
    counts = torch.ones(VOCAB_SIZE, VOCAB_SIZE, dtype=torch.float64)
    counts.index_put_((train[:-1], train[1:]), torch.ones(len(train) - 1, dtype=torch.float64), accumulate=True)
    log_probs = (counts / counts.sum(1, keepdim=True)).log()
    return math.exp(-log_probs[held_out[:-1], held_out[1:]].mean().item())


@torch.no_grad()
def sample_completions(model, tokenizer, prompts: list[str], max_new_tokens: int = 40) -> list[dict]:
    samples = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        samples.append({"prompt": prompt, "completion": tokenizer.decode(out[0, ids.shape[1] :].tolist())})
    return samples


def save(model, tokenizer, directory: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(directory)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    _write_portable_tokenizer_config(directory / "tokenizer_config.json")


def _write_portable_tokenizer_config(path: Path) -> None:
    """transformers 5 writes a class name and a special-token key that transformers 4 does not know;
    the 4.x spelling is read by both."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = config.pop("extra_special_tokens", SPECIAL_TOKENS[1:])
    path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "minserve" / "assets")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a slice of the corpus (tests)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    started_s = time.perf_counter()
    train_texts, held_out_texts = read_corpus()
    if args.smoke:
        train_texts, held_out_texts = train_texts[:20], held_out_texts[:5]
    tokenizer = train_tokenizer(train_texts)
    eos_id = tokenizer.token_to_id(EOS)
    train_stream = encode_stream(tokenizer, train_texts)
    held_out_stream = encode_stream(tokenizer, held_out_texts)
    print(f"corpus: {len(train_stream):,} train tokens, {len(held_out_stream):,} held-out tokens", flush=True)

    steps = 3 if args.smoke else None
    windows = 2 if args.smoke else 400
    report: dict = {
        "corpus": "Python standard library (*.py, tests excluded), " + sysconfig.get_python_version(),
        "train_tokens_in_corpus": len(train_stream),
        "held_out_tokens_in_corpus": len(held_out_stream),
        "vocab_size": VOCAB_SIZE,
        "seq_len_tokens": SEQ_LEN_TOKENS,
        "bigram_held_out_perplexity": bigram_perplexity(train_stream, held_out_stream),
        "models": {},
    }
    trained = {}
    for shape in (TINY, DRAFT):
        model, tokens, train_s = train_model(shape, train_stream, eos_id, args.seed, steps)
        trained[shape.name] = model
        report["models"][shape.name] = {
            "shape": asdict(shape),
            "parameters": sum(p.numel() for p in model.parameters()),
            "tokens_trained": tokens,
            "train_seconds": round(train_s, 1),
            "held_out_perplexity": perplexity(model, held_out_stream, windows),
            "samples": sample_completions(model, tokenizer, ["def fib(n):", "import os\n\n\ndef "]),
        }
        save(model, tokenizer, args.out / shape.name)
    report["draft_greedy_agreement"] = greedy_agreement(
        trained[TINY.name], trained[DRAFT.name], held_out_stream, windows
    )
    report["total_seconds"] = round(time.perf_counter() - started_s, 1)
    report["torch_threads"] = torch.get_num_threads()
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "models"}, indent=2))
    return report


if __name__ == "__main__":
    main()
