"""The RoPE settings a recipe's [model] section or a [[ramp]] stage sets, with one "unset" and one list of types.

The recipe keeps its TOML spellings (0 = from the named config / keep the previous stage's, rope_type "auto" in
[model] and "" in [[ramp]], rope_scaling_factor = -1 = switch scaling off); `RopeSettings.from_recipe` reads every
one of them into `UNSET` (None) once, so the schema, the ramp, the model, the HF config and the planner compare
against one marker. The scaling types are spelled once, in the `RopeScaling` alias here: this module sits below
config/schema.py, which types [model] rope_type with it and reads its sections through `RopeSettings`, so nothing
here imports the schema. The Hugging Face `rope_type` names are those plus `DEFAULT_ROPE_TYPE` (plain RoPE, theta only).
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

RopeScaling = Literal["auto", "llama3", "yarn"]
"""[model] rope_type's allowed values (the recipe loader's CHOICES read them through the schema's field)."""

UNSET = None
"""The one "not set here" marker of every RoPE setting (the named config's, or the previous stage's, is kept)."""

_RECIPE_AUTO = "auto"
"""[model] rope_type's TOML spelling of unset (part of `RopeScaling`)."""

RAMP_KEEP_TYPE = ""
"""[[ramp]] rope_type's TOML spelling of unset (keep the previous stage's type)."""

SCALING_OFF = -1.0
"""rope_scaling_factor's TOML spelling of "switch the scaling off" (a value, not unset: plain RoPE from then on)."""

ROPE_SCALING_TYPES: tuple[str, ...] = tuple(t for t in typing.get_args(RopeScaling) if t != _RECIPE_AUTO)
"""The scalings a rope_scaling_factor can apply: llama3 (Llama 3.1) | yarn (HF's YaRN)."""

DEFAULT_ROPE_TYPE = "default"
"""Hugging Face's rope_type name of plain RoPE (theta only, no scaling)."""

ROPE_TYPES: tuple[str, ...] = (DEFAULT_ROPE_TYPE, *ROPE_SCALING_TYPES)
"""Every Hugging Face rope_type this repo computes (models/rope.py) and reads or writes (models/hf_config.py)."""


def _unset_if_recipe_default(value):
    """A TOML value with the recipe's "not set" spelling (0, "", "auto") as `UNSET`; any other value as is."""
    return UNSET if value in (0, RAMP_KEEP_TYPE, _RECIPE_AUTO) else value


@dataclass(frozen=True)
class RopeSettings:
    """The RoPE a recipe section sets; a field left `UNSET` keeps the named config's (or the previous stage's)."""
    theta: float | None = UNSET
    scaling_type: str | None = UNSET
    factor: float | None = UNSET
    """A scaling factor, `SCALING_OFF` to switch scaling off, or `UNSET`."""
    original_max_position: int | None = UNSET

    @classmethod
    def from_recipe(cls, section) -> RopeSettings:
        """The settings of a [model] section or a [[ramp]] table (the latter has no rope_original_max_position)."""
        return cls(theta=_unset_if_recipe_default(section.rope_theta),
                   scaling_type=_unset_if_recipe_default(section.rope_type),
                   factor=_unset_if_recipe_default(section.rope_scaling_factor),
                   original_max_position=_unset_if_recipe_default(getattr(section, "rope_original_max_position", 0)))

    def recipe_fields(self) -> dict:
        """The set fields under their [model] key names and TOML spellings (what a ramp stage writes into its
        [model] section)."""
        out = dict(rope_theta=self.theta, rope_scaling_factor=self.factor, rope_type=self.scaling_type,
                   rope_original_max_position=self.original_max_position)
        return {k: v for k, v in out.items() if v is not UNSET}

    def model_overrides(self) -> dict:
        """The set fields as keyword overrides of a `LlamaConfig` (models/model_config.py: a factor of None there
        is plain RoPE)."""
        out = self.recipe_fields()
        if "rope_scaling_factor" in out and out["rope_scaling_factor"] < 0:
            out["rope_scaling_factor"] = None
        return out


def is_scaling_type(value) -> bool:
    """Whether `value` names a RoPE scaling (llama3 | yarn)."""
    return value in ROPE_SCALING_TYPES
