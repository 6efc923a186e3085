"""Launching training: from a resolved ``TrainConfig`` to processes on one or many nodes.

One concept per module:

- ``nodelist``  expands SLURM host lists (``gpu[01-04,07]``) without calling scontrol;
- ``slurm``     reads a SLURM job's environment (nodes, this node's rank, node 0's address, GPUs);
- ``torchrun``  builds the torchrun command line (an argument list) and the environment of the ranks;
- ``container`` wraps that command in ``apptainer exec --nv`` / ``singularity exec`` / ``docker run``;
- ``sbatch``    writes (and submits) a SLURM batch script that runs the launcher once per node;
- ``probe``     asks the runtime that will train (host or container) about GPUs, FP8 and the tokenizer;
- ``preflight`` checks paths, prepared data, the checkpoint and its spec before anything starts;
- ``process``   runs the launched command, forwarding SIGINT/SIGTERM and propagating its exit code;
- ``elastic``   torchrun with one-line endings (a signal N exits 128+N; a failed rank names itself);
- ``failures``  a failed rank's one-line reason, written by the rank and printed last by the launcher;
- ``sizing``    the memory estimate per GPU (``--dry-run`` prints it; a launch over the GPU's memory is warned);
- ``cli``       the ``train/run.py`` command: ties the steps together.
"""
