"""Download WikiText-2 (or WikiText-103) and cache it tokenised, once, on a machine with internet.

Compute nodes usually have no internet: run this on a login node before submitting jobs.
The training scripts then read the cache (a fraction of a second, offline).

    python prepare_data.py                         # WikiText-2 from the Hugging Face hub
    python prepare_data.py --dataset wikitext-103  # 50x the text, for the scaling exercise
    python prepare_data.py --data-dir DIR          # from local train/valid/test text files
    COURSE_DATA_CACHE=/p/project/.../data_cache python prepare_data.py   # where the cache goes

Pass the same --dataset and --max-vocab to the training scripts: the cap is part of the cache.
"""

import argparse
import sys
from pathlib import Path

from utils.args import OneLineParser, vocab_cap
from utils.data import (HUB_DATASETS, DataUnavailableError, default_cache_dir, hub_cache_file,
                        hub_reachable, load_corpus)


def offline_message(dataset: str) -> str:
    """One line: why nothing was downloaded, and what works instead."""
    title = HUB_DATASETS[dataset].title
    local = ("train.txt, valid.txt, test.txt" if dataset == "wikitext-2"
             else "wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens")
    fallback = ("; without either, the quick-start run uses the synthetic corpus"
                if dataset == "wikitext-2" else "")
    flag = "" if dataset == "wikitext-2" else f" --dataset {dataset}"
    return (f"prepare_data: the Hugging Face hub is not reachable from here, so {title} was not "
            "downloaded. Run this script on a machine with internet (a login node), or train "
            f"with{flag} --data-dir DIR ({local}){fallback}.")


def main() -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=list(HUB_DATASETS), default="wikitext-2")
    p.add_argument("--max-vocab", type=vocab_cap, default=None, metavar="N",
                   help="keep the N most frequent training words (default: 32768 for "
                        "wikitext-103, no cap for wikitext-2)")
    p.add_argument("--data-dir", help="tokenise local files instead of downloading")
    p.add_argument("--cache-dir", default=None, help="default: $COURSE_DATA_CACHE or data_cache/")
    args = p.parse_args()
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    cached = hub_cache_file(cache_dir, args.dataset, args.max_vocab).is_file()
    if args.data_dir or cached or hub_reachable():
        try:  # a damaged cache is downloaded again (or refused with one line when offline)
            corpus = load_corpus(args.dataset, args.data_dir, cache_dir, warn=print,
                                 max_vocab=args.max_vocab, cache_required=True)
        except DataUnavailableError as e:
            print(f"prepare_data: error: {e}", file=sys.stderr)
            return 1
    else:
        print(offline_message(args.dataset), file=sys.stderr)
        return 1
    print(f"prepare_data: {corpus.source} cached in {cache_dir}: vocabulary {corpus.vocab_size}, "
          f"tokens train {len(corpus.train)}, valid {len(corpus.valid)}, test {len(corpus.test)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
