"""Hub comparison presets (HH-RLHF, UltraFeedback, HelpSteer3; local fixtures in their schema) become
preference-model training data in the cookbook's format."""

import pytest

from posttrain.datasets.loaders import LoadSpec, load
from posttrain.preference.comparison_format import COMPLETION_B, ComparisonRenderer, labeled_comparisons_from_table
from posttrain.renderers import get_renderer
from tests.posttrain.preference.tiny_pairs import tiny_tokenizer


@pytest.mark.parametrize("preset", ["hh_rlhf", "ultrafeedback", "helpsteer3"])
def test_a_hub_preset_renders_into_label_token_datums_in_both_orders(hub_mirror, preset):
    table = load(LoadSpec("comparison", preset, limit=6, heldout_fraction=0.0)).table
    labeled = labeled_comparisons_from_table(table, split=None)
    assert len(labeled) == 2 * table.num_rows and table.num_rows > 0
    renderer = ComparisonRenderer(get_renderer("chatml", tiny_tokenizer()))
    tokenizer = tiny_tokenizer()
    for comparison in labeled[:4]:
        datum = renderer.datum(comparison)
        text = tokenizer.decode(datum.model_input.to_ints())
        assert comparison.comparison.prompt[-1]["content"][:20] in text and COMPLETION_B in text
        trained = datum.loss_fn_inputs["target_tokens"].to_numpy()[-1]
        assert tokenizer.decode([int(trained)]) == comparison.label[0]
