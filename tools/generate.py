"""What your model learned: text written by a trained run of any step of the course.

    python tools/generate.py runs/to_distributed_training
    python tools/generate.py runs/fsdp_training --prompt "The history of the"
    python tools/generate.py runs/pp_training/best_model --max-new-tokens 200 --top-k 0 --seed 2

RUN_DIR_OR_CHECKPOINT is a run's --out-dir (then its final model: final_model.pt, final_model/ or
Lightning's checkpoints/last.ckpt; else its best model, else its last checkpoint) or any model it
saved, in the format of any step (utils/saved_model.py loads them all).

The model writes one word at a time. It scores every word of its vocabulary as the next one;
the scores, divided by --temperature (below 1: safer, above 1: wilder; 0: always the likeliest
word) and cut to the --top-k likeliest, become probabilities; one word is drawn and appended,
and the last max_seq_len words (the run's --seq-len: all the model can see) go in again. The
words are WikiText's: the text split on spaces, <eos> at the end of every line (printed as a
line break) and <unk> for the rare words the vocabulary left out. A prompt word the run never
saw is read as <unk>.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from utils.args import OneLineParser, non_negative_float, non_negative_int, positive_int  # noqa: E402
from utils.data import EOS, UNK  # noqa: E402
from utils.distributed_utils import pick_device  # noqa: E402
from utils.saved_model import TrainedModel, load_trained_model  # noqa: E402


def parse_args(argv=None):
    p = OneLineParser(description="Text written by a trained model of any step of the course.")
    p.add_argument("run", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run's --out-dir, or one model it saved (a .pt or .ckpt file, a folder)")
    p.add_argument("--prompt", default="",
                   help="the words to continue (default: none, the model starts a line)")
    p.add_argument("--max-new-tokens", type=positive_int, default=100,
                   help="how many words to write (default 100)")
    p.add_argument("--temperature", type=non_negative_float, default=0.8,
                   help="below 1 safer, above 1 wilder, 0 always the likeliest word (default 0.8)")
    p.add_argument("--top-k", type=non_negative_int, default=200,
                   help="draw among the K likeliest words only; 0: among all (default 200)")
    p.add_argument("--seed", type=int, default=0, help="the same seed writes the same text")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: a GPU if there is one")
    return p.parse_args(argv)


def encode(prompt: str, vocab: list[str]) -> tuple[list[int], list[str]]:
    """The ids of the prompt's words, and the words the vocabulary lacks (read as <unk>)."""
    ids = {word: i for i, word in enumerate(vocab)}
    words = prompt.split()
    unknown = list(dict.fromkeys(w for w in words if w not in ids))
    return [ids.get(w, ids[UNK]) for w in words], unknown


def decode(ids: list[int], vocab: list[str]) -> str:
    """The words of `ids` joined by spaces, with a line break for every <eos>."""
    words = [vocab[i] for i in ids]
    return "\n".join(line.strip() for line in " ".join(words).split(EOS))


@torch.no_grad()
def generate(model, ids: list[int], max_new_tokens: int, words: int, temperature: float = 0.8,
             top_k: int = 200, seed: int = 0) -> list[int]:
    """`max_new_tokens` ids that `model` writes after `ids`, each one of its first `words` ids
    (the performance step's padding ids beyond them are no word: never drawn)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same on any device
    window = model.cfg.max_seq_len  # the positions the model was trained for
    ids = list(ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], device=device)
        scores = model(context)[0, -1, :words].float().cpu()  # the next word's
        if temperature == 0:
            ids.append(int(scores.argmax()))
            continue
        scores = scores / temperature
        if 0 < top_k < words:
            scores[scores < torch.topk(scores, top_k).values[-1]] = -float("inf")
        ids.append(int(torch.multinomial(torch.softmax(scores, -1), 1, generator=generator)))
    return ids[len(ids) - max_new_tokens:]


def describe(trained: TrainedModel) -> str:
    """Which model, and what its run reported (summary.json)."""
    params = sum(p.numel() for p in trained.model.parameters()) / 1e6
    lines = [f"model: {trained.checkpoint} ({params:.1f}M parameters, {trained.words} words)"]
    s = trained.summary
    if s:
        lines.append(f"trained by {s['script']}, preset {s['preset']}, {s['steps']} steps; "
                     f"perplexity of its final model: validation {s['val_ppl']:.1f}, "
                     f"test {s['test_ppl']:.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    trained = load_trained_model(args.run, pick_device(args.device))
    prompt, unknown = encode(args.prompt, trained.vocab)
    print(describe(trained))
    if unknown:
        print(f"note: not in the run's vocabulary, read as {UNK}: {' '.join(unknown)}")
    # Without a prompt the model starts a line: after an <eos>, as after every line it read.
    start = prompt or [trained.vocab.index(EOS)]
    new = generate(trained.model, start, args.max_new_tokens, trained.words, args.temperature,
                   args.top_k, args.seed)
    print()
    print(decode(prompt + new, trained.vocab))
    return 0


if __name__ == "__main__":
    sys.exit(main())
