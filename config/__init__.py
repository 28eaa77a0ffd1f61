"""The recipe schema and its errors: the leaf every other package may import (it imports none of them).

Imports run one way: config <- data, models, parallelisms <- training <- train.py.
"""
from config.errors import RecipeError, Refusal
from config.schema import CHOICES, SECTIONS, Config, RampTable, choices

__all__ = ["CHOICES", "SECTIONS", "Config", "RampTable", "RecipeError", "Refusal", "choices"]
