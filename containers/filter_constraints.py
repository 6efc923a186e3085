"""Print the constraints of this Python's lane without the packages the base image already has (NGC: torch,
Transformer Engine, numpy, ...), so that `pip install -c` keeps the container's builds instead of replacing them.

The lane is the image's own Python: constraints/py312.txt (megatron-core 0.19) on NGC's Python 3.12,
constraints/py311.txt (megatron-core 0.16) on 3.11; setup.cfg picks the matching megatron-core the same way.

Usage (inside the image build): python containers/filter_constraints.py constraints > /tmp/constraints.txt
(a directory picks the lane's file; a file is used as given).
"""

import importlib.metadata as md
import os
import re
import sys


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lane_file(path: str) -> str:
    if not os.path.isdir(path):
        return path
    name = "py%d%d.txt" % sys.version_info[:2]
    chosen = os.path.join(path, name)
    if not os.path.isfile(chosen):
        have = ", ".join(sorted(os.listdir(path)))
        raise SystemExit(f"{path} has no {name}: Python {sys.version_info[0]}.{sys.version_info[1]} is not a "
                         f"supported lane (have: {have}); use a base image with Python 3.11 or 3.12")
    return chosen


def main(path: str) -> None:
    installed = {norm(d.metadata["Name"]) for d in md.distributions() if d.metadata["Name"]}
    for line in open(lane_file(path)):
        name = re.split(r"[=<>!~;\[ ]", line.strip(), maxsplit=1)[0]
        if name and not line.lstrip().startswith("#") and norm(name) in installed:
            continue
        sys.stdout.write(line)


if __name__ == "__main__":
    main(sys.argv[1])
