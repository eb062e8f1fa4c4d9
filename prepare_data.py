"""Download WikiText-2 and cache it tokenised, once, on a machine with internet.

Compute nodes usually have no internet: run this on a login node before submitting jobs.
The training scripts then read the cache (a fraction of a second, offline).

    python prepare_data.py                         # from the Hugging Face hub
    python prepare_data.py --data-dir DIR          # from local train/valid/test text files
    COURSE_DATA_CACHE=/p/project/.../data_cache python prepare_data.py   # where the cache goes
"""

import argparse
import sys
from pathlib import Path

from utils.data import (DataUnavailableError, default_cache_dir, hub_cache_file, hub_reachable,
                        load_corpus)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="tokenise local files instead of downloading")
    p.add_argument("--cache-dir", default=None, help="default: $COURSE_DATA_CACHE or data_cache/")
    args = p.parse_args()
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if args.data_dir or hub_cache_file(cache_dir).is_file() or hub_reachable():
        try:  # a damaged cache is downloaded again (or refused with one line when offline)
            corpus = load_corpus("wikitext-2", args.data_dir, cache_dir, warn=print)
        except DataUnavailableError as e:
            print(f"prepare_data: error: {e}", file=sys.stderr)
            return 1
    else:
        print("prepare_data: the Hugging Face hub is not reachable from here, so WikiText-2 was "
              "not downloaded. Run this script on a machine with internet (a login node), or "
              "train with --data-dir DIR (train.txt, valid.txt, test.txt); without either, "
              "the quick-start run uses the synthetic corpus.", file=sys.stderr)
        return 1
    print(f"prepare_data: {corpus.source} cached in {cache_dir}: vocabulary {corpus.vocab_size}, "
          f"tokens train {len(corpus.train)}, valid {len(corpus.valid)}, test {len(corpus.test)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
