"""The one exception type for bad user input (recipes, overrides, corpus paths, meshes).

train.py catches it and prints its message as one line, without a traceback, before any process group starts.
Messages name the key or file and say how to fix it.
"""


class RecipeError(Exception):
    """A user-facing, one-line configuration error."""
