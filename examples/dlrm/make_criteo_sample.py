"""Writes a small file in Criteo's TSV format (random values) to try the TSV reader:

python examples/dlrm/make_criteo_sample.py sample.tsv --lines 20000
"""

import argparse
import random


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    with open(args.path, "w") as f:
        for _ in range(args.lines):
            cats = [f"{rng.getrandbits(32):08x}" if rng.random() > 0.05 else "" for _ in range(26)]
            dense = [str(rng.randint(0, 1000)) if rng.random() > 0.1 else "" for _ in range(13)]
            # The label leans on the first category, so a model has something to learn.
            label = int(int(cats[0] or "0", 16) % 4 == 0) if rng.random() > 0.1 else rng.randint(0, 1)
            f.write("\t".join([str(label)] + dense + cats) + "\n")


if __name__ == "__main__":
    main()
