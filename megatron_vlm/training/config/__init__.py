"""Training configuration: every setting of a training run, one dataclass field per launcher flag.

``TrainConfig`` is the contract between the launcher (``train/run.py``) and the trainer
(``train/pretrain_vlm.py``):

- ``TrainConfig.from_args(argv)`` parses the command line; ``--config run.yaml`` loads a YAML file first and
  the command line overrides it (every flag can be set in the YAML under its field name).
- ``cfg.resolved()`` fills what the user left open (stage defaults, ``--smoke-test`` shrinking, tensorboard
  dir, precision), makes paths absolute and validates; errors name the input and the fix.
- ``cfg.to_yaml()`` / ``TrainConfig.from_yaml(path)`` write and read the resolved config. The launcher writes it
  to ``cfg.config_path`` (``<save_dir>/<name>/config.yaml``; node r > 0 of a multi-node run:
  ``config.node<r>.yaml``) and starts the trainer with ``--config`` pointing there. ``cfg.checkpoint_dir``
  (``<save_dir>/<name>``, a local directory or an ``msc://`` URL) is where the trainer saves checkpoints;
  ``cfg.run_dir`` is the local directory of config, metrics and logs (the same directory unless ``--log-dir``
  is given, which a remote ``--save-dir`` defaults to ``outputs/<name>``).

Relative paths, on the command line or in a YAML file, are relative to the current directory; the resolved
config holds absolute paths only.

Precedence of a value: command line > YAML > environment (SLURM, device detection, passed by the launcher as
``env_defaults``) > ``--smoke-test`` shrinking > stage default > field default. ``--smoke-test`` is the
exception: it forces TP=PP=1 and tiny batches whatever was asked, and says so in ``resolution_notes``.

This package imports nothing heavier than PyYAML: the launcher runs it on hosts without torch. Its modules:
:mod:`.fields` (the field table, stage defaults, derived values), :mod:`.parse` (argument parser, YAML and
value coercion), :mod:`.checks` (the validators), :mod:`.resolve` (filling open values, then the checks) and
:mod:`.train_config` (``TrainConfig``: construction, YAML round trip, ``resolved()``).
"""

from megatron_vlm.training.config.fields import (CONFIG_FILE, SMOKE_TEST_TRAIN_ITERS, STAGE_DEFAULTS,
                                                 ConfigError, ConfigFields)
from megatron_vlm.training.config.parse import build_parser, parse_int_list, parse_range
from megatron_vlm.training.config.resolve import absolute_path
from megatron_vlm.training.config.train_config import TrainConfig

__all__ = ["CONFIG_FILE", "SMOKE_TEST_TRAIN_ITERS", "STAGE_DEFAULTS", "ConfigError", "ConfigFields",
           "TrainConfig", "absolute_path", "build_parser", "parse_int_list", "parse_range"]
