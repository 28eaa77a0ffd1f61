"""The two exception types for refusals, each a one-line message that names what is wrong and how to fix it.

- `RecipeError`: a recipe key, an override, a corpus path or a command-line flag is at fault. train.py catches it and
  prints its message as one line, without a traceback, before any process group starts.
- `Refusal`: runtime code (parallelisms/, training/) refuses a call it cannot compute exactly or consistently: a
  shape, a layout, an attention argument, a checkpoint's contents. A ValueError, so callers that catch bad values
  keep working. Where the cause is a recipe key, the caller turns it into a RecipeError naming that key
  (training/launch_checks/preflight.py does so for the Ulysses head rule).
"""


class RecipeError(Exception):
    """A user-facing, one-line configuration error."""


class Refusal(ValueError):
    """Runtime code refuses inputs it cannot handle exactly (instead of computing something else)."""
