"""``TrainConfig``: the field table (:mod:`.fields`) with its construction (command line, YAML, dict), its YAML
form and its resolution (:mod:`.resolve`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from megatron_vlm.training.config import parse
from megatron_vlm.training.config.fields import ConfigFields
from megatron_vlm.training.config.resolve import resolve as resolve_config


@dataclass
class TrainConfig(ConfigFields):
    """Every setting of a training run; see the package docstring (:mod:`megatron_vlm.training.config`)."""

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_args(cls, argv: list[str] | None = None, *, resolve: bool = True,
                  env_defaults: dict[str, Any] | None = None) -> "TrainConfig":
        """Parse ``argv`` (with ``--config`` YAML underneath); resolve and validate unless ``resolve=False``."""
        given = vars(parse.build_parser().parse_args(argv))
        config_file = given.pop("config", None)
        values = parse.read_yaml_values(config_file) if config_file else {}
        values.update(given)
        cfg = cls(**values)
        return cfg.resolved(env_defaults) if resolve else cfg

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "TrainConfig":
        return cls(**parse.coerce_mapping(data, source))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "TrainConfig":
        """Read a config written by ``to_yaml`` (or written by hand); the ``derived`` section is ignored."""
        return cls(**parse.read_yaml_values(path))

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.metadata["kind"] == "ranges":
                v = [f"{a}-{b}" for a, b in v]
            elif isinstance(v, (list, tuple)):
                v = list(v)
            out[f.name] = v
        return out

    def to_argv(self) -> list[str]:
        """Command-line flags that give this config (see :func:`megatron_vlm.training.config.parse.to_argv`)."""
        return parse.to_argv(self)

    def to_yaml(self) -> str:
        import yaml

        body = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)
        derived = dict(world_size=self.world_size, run_dir=str(self.run_dir))
        if self.checkpoint_dir != str(self.run_dir):
            derived["checkpoint_dir"] = self.checkpoint_dir
        if self.micro_batch_size and self.global_batch_size and self.world_size % self.model_parallel == 0:
            derived.update(data_parallel=self.dp, grad_accum=self.grad_accum)
        header = "# megatron-vlm training config (read with TrainConfig.from_yaml; 'derived' is informative)\n"
        return header + body + yaml.safe_dump({"derived": derived}, sort_keys=False)

    # ---- resolution and validation ------------------------------------------------------------------
    def resolved(self, env_defaults: dict[str, Any] | None = None) -> "TrainConfig":
        """A copy with open values filled in, paths absolute, and everything validated (``ConfigError``);
        see :func:`megatron_vlm.training.config.resolve.resolve`."""
        return resolve_config(self, env_defaults)
