"""Every data asset of the code location, for `Definitions(assets=[...])`.

`base_model` comes first: the token assets (`rendered_tokens`, `preference_pairs`) depend on it for
their tokenizer, so it must be registered wherever they are.
"""

from assets.base_model import base_model
from assets.datasets import chat_dataset
from assets.preferences import preference_comparisons, preference_pairs
from assets.problems import code_problems, rl_problems
from assets.tokens import rendered_tokens

DATA_ASSETS = (
    base_model,
    chat_dataset,
    rendered_tokens,
    preference_comparisons,
    preference_pairs,
    rl_problems,
    code_problems,
)
