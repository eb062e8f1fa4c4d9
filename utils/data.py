"""WikiText-2 or WikiText-103 (word level) as token tensors, and the windows the model trains on.

Three sources give the same `Corpus`:
- the Hugging Face hub (`Salesforce/wikitext`, `wikitext-2-v1` or `wikitext-103-v1`): the
  cluster path. Run `python prepare_data.py [--dataset wikitext-103]` once on a login node;
  compute nodes then read the cache offline;
- a local folder with train/valid/test text files (`train.txt`... or `wiki.train.tokens`...);
- a synthetic corpus generated on the fly, for fully offline smoke tests.

Tokenisation is the standard one for WikiText (as in PyTorch's word-language-model example):
split each line on white space and end it with `<eos>`. The vocabulary comes from the training
split only, optionally capped at its most frequent words (`max_vocab`, by default only for
WikiText-103); other words become `<unk>`. The tokenised corpus is cached in one file per source
and cap, written atomically, so every later run and every rank loads it in a fraction of a second.
Each read checks the file against the CRC-32s torch.save wrote into it: a damaged cache (a bad
copy, a flipped bit) is rebuilt, or named in one line where it cannot be.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import socket
import sys
import threading
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, Sampler

from utils.distributed_utils import is_root_process
from utils.files import DiskFullError, atomic_open, atomic_torch_save, free_mib, torch_file_problem
from utils.launch import exit_with_error, tell_torchrun

UNK, EOS = "<unk>", "<eos>"
IGNORE_INDEX = -100  # targets with this value count neither in the loss nor in the token count
SPLITS = ("train", "valid", "test")
HUB_NAME = "Salesforce/wikitext"
CACHE_FORMAT = 1
REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB_FILE = "vocab.txt"  # a run's words, one per line: line i is the word of id i


@dataclass(frozen=True)
class HubDataset:
    title: str             # how messages name it
    config: str            # the configuration of HUB_NAME on the hub
    max_vocab: int | None  # the default vocabulary cap (None: every word of the training split)


# WikiText-103 has 267k distinct words: a 267k x 768 embedding and output layer would dominate
# the model, and its logits (batch 32 x 256 x 267k in fp32) would take 8.7 GB. Capped near
# WikiText-2's 33,278 words, the model and its FLOPs per token stay almost the same.
HUB_DATASETS = {
    "wikitext-2": HubDataset("WikiText-2", "wikitext-2-v1", None),
    "wikitext-103": HubDataset("WikiText-103", "wikitext-103-v1", 32768),
}
DATASETS = ("auto", *HUB_DATASETS, "synthetic")


class DataUnavailableError(RuntimeError):
    """The requested data can be neither read from the cache nor fetched here."""


@dataclass
class Corpus:
    vocab: list[str]
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    source: str

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)


# ---------------------------------------------------------------------------------------------
# Tokenisation and vocabulary


def count_words(lines) -> Counter:
    counts = Counter()
    for line in lines:
        counts.update(line.split())
    return counts


def build_vocab(counts: Counter, max_vocab: int | None = None) -> list[str]:
    """`<unk>` and `<eos>` first, then the training words by falling frequency.

    With `max_vocab` only the most frequent words are kept, `max_vocab` entries in all; equally
    frequent words at the cut keep the order in which the text first used them.
    """
    if max_vocab is not None and max_vocab < 2:
        raise ValueError(f"max_vocab {max_vocab} leaves no room for {UNK} and {EOS}")
    words = (w for w, _ in counts.most_common() if w not in (UNK, EOS))
    kept = None if max_vocab is None else max_vocab - 2
    return [UNK, EOS, *itertools.islice(words, kept)]


def encode(lines, vocab: list[str]) -> torch.Tensor:
    """The ids of each line's words and its `<eos>`, collected line by line into one int64
    array: WikiText-103's 103M words as a list of strings would take several GB."""
    stoi = {w: i for i, w in enumerate(vocab)}
    unk, eos = stoi[UNK], stoi[EOS]
    ids = array("q")  # int64, 8 bytes per token
    for line in lines:
        ids.extend([stoi.get(w, unk) for w in line.split()])
        ids.append(eos)
    if not ids:  # torch.frombuffer refuses an empty buffer
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(ids, dtype=torch.long)  # shares the array's memory: no second copy


def build_corpus(split_lines: dict[str, list[str]], source: str,
                 max_vocab: int | None = None) -> Corpus:
    """Word counts first, then ids, line by line: no list of all the words is ever built."""
    vocab = build_vocab(count_words(split_lines["train"]), max_vocab)
    return Corpus(vocab, *(encode(split_lines[s], vocab) for s in SPLITS), source=source)


def write_vocab(vocab: list[str], path: str | os.PathLike) -> None:
    """The words one per line, in id order (line i is the word of id i), as UTF-8, atomically:
    what tools/generate.py turns a trained model's ids back into words with. (Words never
    contain white space: the text was split on it.)"""
    with atomic_open(path, "wb") as f:
        f.write("".join(f"{word}\n" for word in vocab).encode("utf-8"))


def read_vocab(path: str | os.PathLike) -> list[str]:
    """The words write_vocab wrote, in id order."""
    return Path(path).read_bytes().decode("utf-8").split("\n")[:-1]


# ---------------------------------------------------------------------------------------------
# Sources


LOCAL_NAMES = ({s: f"{s}.txt" for s in SPLITS}, {s: f"wiki.{s}.tokens" for s in SPLITS})


def local_split_files(data_dir: str | os.PathLike) -> dict[str, Path]:
    data_dir = Path(data_dir)
    for names in LOCAL_NAMES:
        files = {s: data_dir / name for s, name in names.items()}
        if all(f.is_file() for f in files.values()):
            return files
    raise DataUnavailableError(
        f"--data-dir {data_dir} must contain train.txt, valid.txt and test.txt "
        "(or wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens)")


def read_local_splits(files: dict[str, Path]) -> dict[str, list[str]]:
    return {s: read_text_file(f).splitlines() for s, f in files.items()}


def read_text_file(path: Path) -> str:
    """The file as UTF-8 text; anything else is refused with the file, line and byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataUnavailableError(
            f"{path} is not UTF-8 text: byte {e.start} (line {line}) is {data[e.start:e.start + 1]!r}; "
            f"convert the file, e.g. iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8.txt") from None


def read_hub_splits(cache_dir: Path, config: str) -> dict[str, list[str]]:
    from datasets import load_dataset  # imported here: only the download path needs it

    # Keep Hugging Face's own download cache next to ours, not in $HOME (small quota on clusters).
    ds = load_dataset(HUB_NAME, config, cache_dir=str(cache_dir / "huggingface"))
    return {s: ds[{"valid": "validation"}.get(s, s)]["text"] for s in SPLITS}


def synthetic_splits(n_train: int = 100_000, n_eval: int = 10_000, vocab_size: int = 500,
                     seed: int = 0) -> dict[str, list[str]]:
    """Text from a random Markov chain: each word is mostly followed by one of four others, so
    a model can learn it (loss falls from ln(500) = 6.2 towards ln(4) = 1.4)."""
    g = torch.Generator().manual_seed(seed)
    total = n_train + 2 * n_eval
    successors = torch.randint(vocab_size, (vocab_size, 4), generator=g).tolist()
    choice = torch.randint(4, (total,), generator=g).tolist()
    jump = (torch.rand(total, generator=g) < 0.1).tolist()
    random_word = torch.randint(vocab_size, (total,), generator=g).tolist()
    line_len = torch.randint(5, 25, (total,), generator=g).tolist()
    word, lines, line = 0, [], []
    for i in range(total):
        word = random_word[i] if jump[i] else successors[word][choice[i]]
        line.append(f"w{word}")
        if len(line) >= line_len[len(lines)]:
            lines.append(" ".join(line))
            line = []
    # cut by line counts proportional to the requested token counts
    n = len(lines)
    a, b = n * n_train // total, n * (n_train + n_eval) // total
    valid, test = lines[a:b], lines[b:]
    # Validation and test keep the first quarter of their share (about 2,700 tokens each, 84
    # windows of the tiny preset's 32): the tests' hundreds of short runs spend a quarter as long
    # evaluating. Cut after generating, so the training text stays the same.
    return {"train": lines[:a], "valid": valid[:len(valid) // 4], "test": test[:len(test) // 4]}


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether huggingface.co answers within `timeout` seconds (respects the offline variables).

    Without this check `datasets` retries for about half a minute before failing.
    """
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or \
            os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("0", ""):
        return False
    result = []

    def connect():  # DNS look-ups ignore socket timeouts, hence the thread
        try:
            socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
            result.append(True)
        except OSError:
            pass

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(timeout)
    return bool(result)


# ---------------------------------------------------------------------------------------------
# Cache


def default_cache_dir() -> Path:
    """$COURSE_DATA_CACHE, else data_cache/ in the repository (clone it on project storage).
    An empty COURSE_DATA_CACHE counts as unset (not as the current folder)."""
    return Path(os.environ.get("COURSE_DATA_CACHE") or REPO_ROOT / "data_cache")


def _cache_file(cache_dir: Path, name: str, key: str) -> Path:
    digest = hashlib.sha256(f"{CACHE_FORMAT}:{key}".encode()).hexdigest()[:16]
    return cache_dir / f"{name}-{digest}.pt"


class CorruptCacheError(DataUnavailableError):
    """A cache file exists but cannot be read (truncated by a full disk, a killed copy...) or
    its contents differ from what was written (a flipped bit, a bad copy)."""


def _load_cached(path: Path) -> Corpus | None:
    """The cached corpus; None if there is none. CorruptCacheError if the file is unreadable or
    does not match its checksums (about 0.15 s per GB, docs/benchmarks.md)."""
    if not path.is_file():
        return None
    problem = torch_file_problem(path)
    if problem:
        raise CorruptCacheError(f"the data cache {path} is damaged ({problem})")
    try:
        d = torch.load(path, weights_only=True)
        corpus = Corpus(d["vocab"], d["train"], d["valid"], d["test"], source=d["source"])
        if not all(isinstance(t, torch.Tensor) for t in (corpus.train, corpus.valid, corpus.test)):
            raise TypeError("a split is not a tensor")
    except Exception as e:  # torch.load raises many kinds for damaged files
        raise CorruptCacheError(f"the data cache {path} is damaged ({type(e).__name__} "
                                "when reading it)") from None
    return corpus


def _load_or_forget(path: Path, warn) -> Corpus | None:
    """The cached corpus, or None (to rebuild it) if there is none or the file is damaged."""
    try:
        return _load_cached(path)
    except CorruptCacheError as e:
        (warn or print)(f"WARNING: {e}: rebuilding it")
        return None


class CacheNotWritableError(DataUnavailableError):
    """The cache folder cannot take the file (read-only, not a folder, a full disk)."""


def _save_cached(corpus: Corpus, path: Path) -> None:
    """Written atomically: readers never see a half-written cache, and several ranks building it
    at once each replace the file with identical content. CacheNotWritableError if the folder
    cannot take it."""
    try:
        atomic_torch_save({"vocab": corpus.vocab, "train": corpus.train, "valid": corpus.valid,
                           "test": corpus.test, "source": corpus.source}, path)
    except DiskFullError:
        raise CacheNotWritableError(f"cannot write the data cache {path} (no space left on "
                                    f"device: {free_mib(path.parent):.1f} MiB free)") from None
    except OSError as e:
        raise CacheNotWritableError(f"cannot write the data cache {path} "
                                    f"({e.strerror or e})") from None


def _save_or_say(corpus: Corpus, path: Path, warn, required: bool) -> None:
    """Cache it; if the folder cannot take it, train anyway (the cache only saves time) after
    one warning, unless the cache is what was asked for (prepare_data.py)."""
    try:
        _save_cached(corpus, path)
    except CacheNotWritableError as e:
        if required:
            raise DataUnavailableError(f"{e}: give a writable --cache-dir (or "
                                       "COURSE_DATA_CACHE)") from None
        (warn or print)(f"WARNING: {e}: training without it (the text is tokenised again "
                        "next time); give a writable --cache-dir to keep it")


def _cached(cache_dir: Path, name: str, key: str, build, warn=None,
            required: bool = False) -> Corpus:
    path = _cache_file(cache_dir, name, key)
    corpus = _load_or_forget(path, warn)
    if corpus is None:
        corpus = build()
        _save_or_say(corpus, path, warn, required)
    return corpus


def resolve_max_vocab(dataset: str, max_vocab: int | None) -> int | None:
    """The vocabulary cap in effect: `max_vocab` if given, else the dataset's default."""
    if max_vocab is not None:
        return max_vocab
    return HUB_DATASETS[dataset].max_vocab if dataset in HUB_DATASETS else None


def _vocab_key(max_vocab: int | None) -> str:
    # Uncapped corpora keep the keys they had before caps existed, so their caches stay valid.
    return "" if max_vocab is None else f":max_vocab={max_vocab}"


def hub_cache_file(cache_dir: Path, dataset: str = "wikitext-2",
                   max_vocab: int | None = None) -> Path:
    """The cache file of a hub dataset; `max_vocab` None means the dataset's default cap."""
    config = HUB_DATASETS[dataset].config
    max_vocab = resolve_max_vocab(dataset, max_vocab)
    return _cache_file(cache_dir, dataset, f"hub:{HUB_NAME}:{config}{_vocab_key(max_vocab)}")


def prepare_command(dataset: str, max_vocab: int | None = None) -> str:
    """The prepare_data.py command that caches this hub dataset with this cap."""
    command = "python prepare_data.py"
    if dataset != "wikitext-2":
        command += f" --dataset {dataset}"
    max_vocab = resolve_max_vocab(dataset, max_vocab)
    if max_vocab != HUB_DATASETS[dataset].max_vocab:
        command += f" --max-vocab {max_vocab}"
    return command


def load_corpus(dataset: str = "auto", data_dir: str | None = None,
                cache_dir: str | os.PathLike | None = None, warn=None,
                max_vocab: int | None = None, cache_required: bool = False) -> Corpus:
    """The corpus for `dataset` in {"auto", "wikitext-2", "wikitext-103", "synthetic"}.

    - `data_dir` given: the text files there (for all but "synthetic").
    - "wikitext-2", "wikitext-103": the cached hub download, downloading it if the hub is
      reachable; otherwise DataUnavailableError telling to run prepare_data.py on a login node.
    - "auto": like "wikitext-2", but without cache and hub it falls back to the synthetic
      corpus and calls `warn` with one line.
    - `max_vocab`: keep only the most frequent training words (None: the dataset's default,
      32768 entries for WikiText-103, no cap otherwise).
    - a cache folder that cannot take the file: one warning, the corpus is used uncached
      (`cache_required`: DataUnavailableError instead, for prepare_data.py).
    """
    if dataset not in DATASETS:
        raise DataUnavailableError(f"unknown dataset {dataset!r}: use {', '.join(DATASETS)}")
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    max_vocab = resolve_max_vocab(dataset, max_vocab)
    if dataset == "synthetic":
        return _cached(cache_dir, "synthetic", "synthetic:v2" + _vocab_key(max_vocab),
                       lambda: build_corpus(synthetic_splits(), "synthetic", max_vocab), warn,
                       cache_required)
    if data_dir:
        files = local_split_files(data_dir)
        digest = hashlib.sha256()
        for s in SPLITS:
            digest.update(files[s].read_bytes())
        return _cached(cache_dir, Path(data_dir).resolve().name,
                       f"local:{digest.hexdigest()}{_vocab_key(max_vocab)}",
                       lambda: build_corpus(read_local_splits(files), f"local:{data_dir}",
                                            max_vocab), warn, cache_required)
    hub = "wikitext-2" if dataset == "auto" else dataset
    title, prepare = HUB_DATASETS[hub].title, prepare_command(hub, max_vocab)
    try:
        corpus = _load_cached(hub_cache_file(cache_dir, hub, max_vocab))
    except CorruptCacheError as e:
        if not hub_reachable():  # only a download rebuilds it: say where and how
            raise DataUnavailableError(
                f"{e}: rebuild it with `{prepare}` on a login node (with internet)") from None
        (warn or print)(f"WARNING: {e}: downloading {title} again")
        return download_hub_corpus(cache_dir, hub, max_vocab, warn, cache_required)
    if corpus is not None:
        return corpus
    if hub_reachable():
        return download_hub_corpus(cache_dir, hub, max_vocab, warn, cache_required)
    if dataset == "auto":
        (warn or print)(
            f"WARNING: WikiText-2 is neither cached in {cache_dir} nor downloadable (no hub "
            "access): training on the SYNTHETIC corpus. Use --data-dir DIR or run prepare_data.py.")
        return load_corpus("synthetic", cache_dir=cache_dir, max_vocab=max_vocab)
    raise DataUnavailableError(
        f"{title} is not cached in {cache_dir} and the Hugging Face hub is not reachable "
        f"from this node: run `{prepare}` on a login node (with internet) first, "
        "or pass --data-dir DIR with train.txt/valid.txt/test.txt")


def download_hub_corpus(cache_dir: Path, dataset: str, max_vocab: int | None = None, warn=None,
                        cache_required: bool = False) -> Corpus:
    config = HUB_DATASETS[dataset].config
    corpus = build_corpus(read_hub_splits(cache_dir, config), f"hub:{HUB_NAME}:{config}",
                          resolve_max_vocab(dataset, max_vocab))
    _save_or_say(corpus, hub_cache_file(cache_dir, dataset, max_vocab), warn, cache_required)
    return corpus


def load_corpus_or_exit(dataset: str, data_dir: str | None, cache_dir: str | None, warn=None,
                        max_vocab: int | None = None) -> Corpus:
    """load_corpus for command-line scripts: a data problem ends the run with one line."""
    try:
        return load_corpus(dataset, data_dir, cache_dir, warn=warn, max_vocab=max_vocab)
    except DataUnavailableError as e:
        exit_with_error(str(e))


# ---------------------------------------------------------------------------------------------
# Samples


def num_windows(tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens that share only their boundary token."""
    return max(0, (tokens - 1) // seq_len)


def check_splits(corpus: Corpus, seq_len: int, batch_size: int, replicas: int = 1) -> None:
    """Stop with one line (on rank 0) if a split is too short for this --seq-len and batch.

    Validation and test need one window; training needs one global batch (batch_size windows
    for each of `replicas` data-parallel ranks), or every epoch would train nothing.
    """
    problem = None
    for split in SPLITS:
        tokens = len(getattr(corpus, split))
        if num_windows(tokens, seq_len) == 0:
            fix = (f"use --seq-len {tokens - 1} or less" if tokens > 1
                   else "put text into it")
            problem = (f"the {split} split of {corpus.source} has {tokens} tokens, fewer than "
                       f"one window of --seq-len {seq_len} + 1: {fix}")
            break
    if problem is None:
        tokens, global_batch = len(corpus.train), batch_size * replicas
        n = num_windows(tokens, seq_len)
        if n < global_batch:
            fixes = []
            if (tokens - 1) // global_batch >= 1:
                fixes.append(f"--seq-len {(tokens - 1) // global_batch} or less")
            if n // replicas >= 1:
                fixes.append(f"--batch-size {n // replicas} or less")
            problem = (f"the train split of {corpus.source} has {tokens} tokens: "
                       f"{n} windows of --seq-len {seq_len}, fewer than one global batch of "
                       f"{global_batch} (--batch-size {batch_size} x {replicas} data-parallel "
                       f"rank{'s' if replicas > 1 else ''}): use {' or '.join(fixes) or 'fewer ranks or more training text'}")
    if problem is not None:
        if is_root_process():
            print(f"error: {problem}", file=sys.stderr, flush=True)
        tell_torchrun(f"error: {problem}")
        sys.exit(1)


class TokenWindows(Dataset):
    """Sample i is x = tokens[i*T : i*T+T] and its targets y = tokens[i*T+1 : i*T+T+1].

    Each window holds T+1 tokens and consecutive windows share only their boundary token, so
    every token is predicted exactly once per epoch. (Taking one window per token position, as
    some courses do, shows every token T times per epoch.)

    Indices from len(self) on are padding samples whose targets are all IGNORE_INDEX: they let
    every rank run the same number of evaluation batches without counting anything twice.
    A split shorter than one window has no samples: check_splits says what to change.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = num_windows(len(tokens), seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i >= self.n:
            return (torch.zeros(self.seq_len, dtype=torch.long),
                    torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long))
        w = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return w[:-1], w[1:]


def pad_batch(x: torch.Tensor, y: torch.Tensor, batch_size: int):
    """A short last batch filled up to `batch_size` with padding samples (tokens 0, targets
    IGNORE_INDEX: they count nowhere). Evaluation then has one shape, and a compiled model
    (--compile) compiles it once instead of again for the last batch."""
    pad = batch_size - len(x)
    if pad <= 0:
        return x, y
    return (torch.cat([x, x.new_zeros(pad, *x.shape[1:])]),
            torch.cat([y, y.new_full((pad, *y.shape[1:]), IGNORE_INDEX)]))


class DistributedEvalSampler(Sampler):
    """Rank r evaluates samples r, r+W, r+2W, ... and pads with padding samples (see
    TokenWindows) so that every rank runs the same number of batches.

    torch's DistributedSampler pads by repeating real samples, which would count them twice
    in the validation loss.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0):
        self.n, self.num_replicas, self.rank = len(dataset), num_replicas, rank
        self.num_samples = -(-self.n // num_replicas)  # ceil

    def __iter__(self):
        # every index >= n is a padding sample
        return iter(range(self.rank, self.num_samples * self.num_replicas, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples
