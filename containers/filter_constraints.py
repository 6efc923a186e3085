"""Print constraints.txt without the packages the base image already has (NGC: torch, Transformer Engine,
numpy, ...), so that `pip install -c` keeps the container's builds instead of replacing them.

Usage (inside the image build): python containers/filter_constraints.py constraints.txt > /tmp/constraints.txt
"""

import importlib.metadata as md
import re
import sys


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(path: str) -> None:
    installed = {norm(d.metadata["Name"]) for d in md.distributions() if d.metadata["Name"]}
    for line in open(path):
        name = re.split(r"[=<>!~;\[ ]", line.strip(), maxsplit=1)[0]
        if name and not line.lstrip().startswith("#") and norm(name) in installed:
            continue
        sys.stdout.write(line)


if __name__ == "__main__":
    main(sys.argv[1])
